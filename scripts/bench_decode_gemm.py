"""GPU microbenchmark of the Triton decode GEMM (``duetserve.model.triton_gemm``) against cuBLAS, Qwen3-8B shapes.

1. Each weight GEMM at M = 1, 8, 16 rows (the Triton GEMM's range, ``triton_gemm.MAX_M``): qkv
   4096->6144, o 4096->4096, gate_up 4096->2x12288, down 12288->4096 and lm_head 4096->151936
   (gate_up and lm_head are wider than ``triton_gemm.MAX_N``: cuBLAS in the engine), timed inside a
   CUDA graph of
   back-to-back launches over enough weight copies that L2 (50 MB) holds none of them; cuBLAS
   once, Triton over a small sweep of tile configs (one that fails to compile or launch is
   skipped with its error printed; the sweep stops at ``--budget-s``).
2. A layer chain: one decoder layer's kernels (add+RMSNorm, qkv, q/k-norm+RoPE+KV write, o,
   add+RMSNorm, gate_up, SiLU-and-mul, down, through ``layers``; no attention) for 36 layers of
   distinct weights, in one graph: cuBLAS everywhere (``DUETSERVE_DECODE_GEMM=cublas``), the
   default (Triton + PDL up to ``MAX_N`` rows), the same without PDL, with the sweep's best tiles
   per shape and M, and with the Triton GEMM on gate_up too (no ``MAX_N``); ms per 36 layers and
   % of the weight-read floor (bytes / 4.19 TB/s).

Writes JSON to ``--out``; prints a short table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from duetserve.model import fused_ops, layers
from duetserve.model import triton_fused as tf
from duetserve.model import triton_gemm as tg

COPY_BW = 4.19e12
L2_BYTES = 50 << 20
LAYERS = 36
ROWS = (1, 8, 16)
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 12288, 32, 8, 128, 151936
SHAPES = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER),
          "lm_head": (VOCAB, HIDDEN)}  # name: (weight rows, K)
SWEEP = [tg.GemmConfig(bn, bk, hk, w, s) for bn, bk, hk, w, s in (
    (32, 256, 256, 4, 4), (16, 256, 256, 4, 4), (32, 128, 256, 4, 6), (32, 256, 512, 4, 3),
    (32, 512, 512, 8, 3), (32, 128, 128, 8, 3), (64, 256, 256, 4, 4), (64, 128, 128, 4, 6), (64, 256, 256, 8, 4))]


def graph_us(fn, reps: int, replays: int = 10) -> float:
    """Median microseconds per ``fn(i)`` over ``replays`` replays of a graph of ``fn(0) .. fn(reps - 1)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)  # compile, size workspaces
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return sorted(times)[len(times) // 2]


def sweep(budget_s: float) -> list[dict]:
    """Section 1: one row per (shape, M): cuBLAS and every config's microseconds."""
    rows, t0, skipped = [], time.monotonic(), 0
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-3 * L2_BYTES // (2 * n * k)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            floor_us = (2 * n * k + 2 * m * k + 2 * m * n) / COPY_BW * 1e6
            row = {"shape": name, "n": n, "k": k, "m": m, "floor_us": floor_us,
                   "cublas_us": graph_us(lambda i: F.linear(x, ws[i % copies]), 4 * copies), "triton": []}
            ref = F.linear(x, ws[0]).double()
            default = tg.default_config(n, k)
            for cfg in [default, *(c for c in SWEEP if c != default)]:
                if cfg != default and time.monotonic() - t0 > budget_s:
                    skipped += 1
                    continue
                try:
                    y = tg.decode_gemm(x, ws[0], None, cfg).double()
                    err = ((y - ref).norm() / ref.norm()).item()
                    us = graph_us(lambda i: tg.decode_gemm(x, ws[i % copies], None, cfg), 4 * copies)
                    row["triton"].append({"config": dataclasses.asdict(cfg), "us": us, "rel_err": err})
                    if cfg == default:
                        row["default_us"] = us
                except Exception as exc:  # a config that does not compile or fit: report, go on
                    print(f"{name} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            best = min(row["triton"], key=lambda r: r["us"], default=None)
            row["best"] = best
            print(f"{name:>14} m={m:<3} floor {floor_us:7.1f} us  cublas {row['cublas_us']:7.1f}  "
                  f"triton best {best['us'] if best else float('nan'):7.1f} {best['config'] if best else ''}",
                  flush=True)
            rows.append(row)
    if skipped:
        print(f"sweep budget of {budget_s:.0f} s spent: {skipped} (shape, M, config) points skipped", flush=True)
    return rows


def chain_weights() -> list[dict]:
    """Distinct bf16 weights of ``LAYERS`` Qwen3-8B decoder layers."""
    def rand(shape: str):
        n, k = SHAPES[shape]
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    return [{"qkv": rand("qkv"), "o": rand("o"), "gate_up": rand("gate_up"), "down": rand("down"),
             "norm1": torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5,
             "norm2": torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5,
             "qn": torch.ones(HEAD_DIM, device="cuda", dtype=torch.bfloat16),
             "kn": torch.ones(HEAD_DIM, device="cuda", dtype=torch.bfloat16)} for _ in range(LAYERS)]


def chain(x, weights, rope) -> torch.Tensor:
    """``LAYERS`` decoder layers without attention (its output stands in for the attention output)."""
    positions, cos, sin, k_cache, v_cache, slots = rope
    m, residual = x.shape[0], None
    for w in weights:
        h, residual = fused_ops.rms_norm(x, w["norm1"], 1e-6, residual)
        q, k, v = layers.linear(h, w["qkv"]).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q = fused_ops.apply_rope_and_cache(positions, q.view(m, HEADS, HEAD_DIM), k.view(m, KV_HEADS, HEAD_DIM),
                                           v.view(m, KV_HEADS, HEAD_DIM), cos, sin, k_cache, v_cache, slots,
                                           w["qn"], w["kn"], 1e-6)
        h, residual = fused_ops.rms_norm(layers.linear(q.view(m, -1), w["o"]), w["norm2"], 1e-6, residual)
        x = layers.linear(fused_ops.silu_and_mul(layers.linear(h, w["gate_up"])), w["down"])
    return x


def set_mode(mode: str) -> None:
    """``DUETSERVE_DECODE_GEMM=mode`` for what runs next in this process."""
    os.environ[layers.DECODE_GEMM_ENV] = mode
    layers.decode_gemm_mode.cache_clear()


def layer_chain(best: dict) -> list[dict]:
    """Section 2: ms per ``LAYERS`` layers for each variant and M; ``best`` maps (rows, K, M) to tiles."""
    weights = chain_weights()
    floor_ms = sum(t.numel() * 2 for w in weights for t in w.values()) / COPY_BW * 1e3
    freqs = torch.outer(torch.arange(4096.0), 1e6 ** (-torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)).cuda()
    cache = [torch.zeros(8, 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    gemm, pdl, max_n = tg.decode_gemm, tg.pdl_supported, tg.MAX_N

    def tuned(x, w, bias=None, config=None):
        return gemm(x, w, bias, config or best.get((w.shape[0], w.shape[1], x.shape[0])))

    # name: (mode, GEMM, PDL test, MAX_N)
    variants = {"cublas": ("cublas", gemm, pdl, max_n), "default": ("triton", gemm, pdl, max_n),
                "default, no pdl": ("triton", gemm, lambda x: False, max_n),
                "default, tuned": ("triton", tuned, pdl, max_n), "triton on gate_up": ("triton", gemm, pdl, 1 << 30)}
    rows = []
    with layers.graph_kernels():  # as the engine records its decode graphs
        for m in ROWS:
            x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
            positions = torch.arange(m, device="cuda") + 100
            rope = (positions, freqs.cos(), freqs.sin(), *cache, torch.arange(m, device="cuda"))
            outputs = {}
            for name, (mode, variant_gemm, variant_pdl, variant_max_n) in variants.items():
                set_mode(mode)
                tg.decode_gemm, tg.pdl_supported, tf.pdl_supported, tg.MAX_N = (variant_gemm, variant_pdl, variant_pdl,
                                                                                variant_max_n)
                try:
                    ms = graph_us(lambda i: outputs.__setitem__(name, chain(x, weights, rope)), 1) / 1e3
                    pct = 100 * floor_ms / ms
                    rows.append({"m": m, "variant": name, "ms": ms, "floor_ms": floor_ms, "pct_of_floor": pct})
                    print(f"chain m={m:<3} {name:<18} {ms:6.3f} ms  {pct:5.1f}% of the {floor_ms:.3f} ms floor",
                          flush=True)
                except Exception as exc:
                    outputs.pop(name, None)
                    print(f"chain m={m} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                finally:
                    tg.decode_gemm, tg.pdl_supported, tf.pdl_supported, tg.MAX_N = gemm, pdl, pdl, max_n
                    set_mode("triton")
            ref = outputs.get("cublas")
            for name, out in outputs.items() if ref is not None else ():  # the last replay's output of each variant
                err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                next(r for r in rows if r["m"] == m and r["variant"] == name)["rel_err_vs_cublas"] = err
    return rows


def pdl_ptx() -> dict:
    """Whether the default kernel is launched with PDL, and the global loads and stores its PTX issues
    before ``griddepcontrol.wait`` (``triton_gemm.accesses_before_wait``: weight loads only, no store)."""
    kernel, seen = tg._gemm_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((kwargs["launch_pdl"], kernel[grid](*args, **kwargs).asm["ptx"]))
            return launch

    tg._gemm_kernel = Spy()
    try:
        x = torch.randn(8, HIDDEN, device="cuda", dtype=torch.bfloat16)
        tg.decode_gemm(x, torch.randn(2 * HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16))
    finally:
        tg._gemm_kernel = kernel
    (launch_pdl, ptx), = seen
    return {"launch_pdl": launch_pdl, "before_wait": tg.accesses_before_wait(ptx)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_decode_gemm.json"))
    ap.add_argument("--budget-s", type=float, default=100.0, help="seconds the tile sweep may take")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.monotonic()
    try:
        pdl = pdl_ptx()
    except Exception as exc:  # report, and still time the kernels
        pdl = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(f"PDL: {pdl}", flush=True)
    gemms = sweep(args.budget_s)
    best = {(r["n"], r["k"], r["m"]): tg.GemmConfig(**r["best"]["config"]) for r in gemms if r["best"]}
    chains = layer_chain(best)
    args.out.write_text(json.dumps({"pdl": pdl, "gemm": gemms, "chain": chains, "seconds": time.monotonic() - t0},
                                   indent=1))
    print(f"\nPDL: {pdl}")
    print(f"weight GEMMs, us per call in a graph (floor = bytes / {COPY_BW / 1e12:.2f} TB/s)")
    print(f"{'shape':>14} {'M':>3} {'floor':>7} {'cublas':>7} {'%':>4} {'default':>7} {'best':>7} {'%':>4}  "
          "best tiles (n, k, head, warps, stages)")
    for r in gemms:
        b = r["best"]
        tri = b["us"] if b else float("nan")
        cfg = tuple(b["config"].values()) if b else ""
        dflt = r.get("default_us") or float("nan")
        print(f"{r['shape']:>14} {r['m']:>3} {r['floor_us']:7.1f} {r['cublas_us']:7.1f} "
              f"{100 * r['floor_us'] / r['cublas_us']:4.0f} {dflt:7.1f} {tri:7.1f} {100 * r['floor_us'] / tri:4.0f}  "
              f"{cfg}")
    floor_ms = chains[0]["floor_ms"] if chains else float("nan")
    print(f"\nlayer chain x {LAYERS} (no attention), ms; floor {floor_ms:.3f} ms")
    for r in chains:
        print(f"  m={r['m']:<3} {r['variant']:<18} {r['ms']:6.3f}  {r['pct_of_floor']:5.1f}% of floor  "
              f"rel err vs cublas {r.get('rel_err_vs_cublas', float('nan')):.1e}")
    print(f"total {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
