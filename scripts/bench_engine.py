"""GPU benchmark of the engine's model runner: decode step and prefill time, Qwen3-8B shapes, dummy bf16.

Decode: batch 1/8/32/64/128 x context 512/2048/8192, with CUDA graphs and eagerly, against
the floor ``bytes(weights + KV read) / 4.19 TB/s`` (docs/design.md section 5's measured copy rate).
Every request samples at temperature 1 (the API's default); on CUDA the 8-step decode is also timed
with the torch sampler in place of the race kernel (``multi_step_torch_sampler_ms``, the column
``torch-smp``). Mixed batches (decodes beside one prompt, ``MIXED``): the piecewise graphs against
eager in the same engine. Prefill: 8192 tokens as 1 x 8192 and 8 x 1024, TFLOP/s over useful (causal) FLOPs against
797 TFLOP/s. ``graphs`` runs the engine's default (in the decode graphs, the Triton decode GEMM
for batches of up to ``triton_gemm.MAX_M`` rows on weights of up to ``triton_gemm.MAX_N`` rows, and
programmatic dependent launch; ``layers``), ``eager`` runs without graphs (cuBLAS, plain launches);
variant ``graphs-cublas``: graphs with ``DUETSERVE_DECODE_GEMM=cublas`` (cuBLAS and plain launches
in the graphs too), the baseline beside it; variant ``graphs-stream``: ``--decode-stream`` (the
weight-stream kernels for batches of up to 8; larger batches as ``graphs``). Writes JSON to ``--out`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from duetserve.calibrate.workload import QWEN3_8B, make_batch
from duetserve.config import EngineConfig
from duetserve.engine.engine import LLMEngine
from duetserve.engine.policy import Plan
from duetserve.engine.scheduler import SchedulerOutput

COPY_BW = 4.19e12
MULTI_STEP = 8  # steps of the multi-step decode variant
MIXED = ((5, 64), (5, 256), (5, 539), (5, 1019), (32, 480))  # (decodes, prompt tokens) of the mixed batches
GEMM_RATE = 797e12
# child env: the default variants never inherit the switch from the caller
VARIANT_ENV = {"graphs": {"DUETSERVE_DECODE_GEMM": "triton"}, "eager": {"DUETSERVE_DECODE_GEMM": "triton"},
               "graphs-cublas": {"DUETSERVE_DECODE_GEMM": "cublas"},
               "graphs-stream": {"DUETSERVE_DECODE_GEMM": "triton"}}  # --decode-stream: batches up to 8


def time_step(engine: LLMEngine, out: SchedulerOutput, iters: int) -> float:
    """Median seconds of ``runner.execute(out)`` (includes the one host sync for sampling)."""
    for _ in range(3):
        list(engine.runner.execute(out))
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        list(engine.runner.execute(out))
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def time_mixed(engine: LLMEngine, decodes: int, prompt: int, iters: int) -> dict:
    """One temporal iteration of ``decodes`` decodes (context 1024) beside a ``prompt``-token prefill,
    replayed from the piecewise graphs and run eagerly (``runner.piecewise`` off), ms."""
    seqs = make_batch(engine, decodes, 1024, 1), make_batch(engine, 1, prompt, prompt)
    out = SchedulerOutput(*seqs, Plan(), [])
    row = {"decodes": decodes, "prompt": prompt, "piecewise_ms": time_step(engine, out, iters) * 1e3}
    graphs, engine.runner.piecewise = engine.runner.piecewise, None
    try:
        row["eager_ms"] = time_step(engine, out, iters) * 1e3
    finally:
        engine.runner.piecewise = graphs
    for s in seqs[0] + seqs[1]:
        engine.block_manager.free(s.seq)
    print(row, flush=True)
    return row


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes a decode step reads from weights: every parameter but the embedding table."""
    emb = engine.model.model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in engine.model.parameters() if p is not emb)


def run_variant(eager: bool, backend: str, iters: int, decode_stream: bool = False) -> dict:
    """Decode (and, with graphs, prefill) timings of one engine build."""
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(QWEN3_8B))
    kv_per_token = 36 * 2 * 8 * 128 * 2
    extra = {"attention_backend": backend} if "attention_backend" in EngineConfig.__dataclass_fields__ else {}
    config = EngineConfig(model=str(folder), load_format="dummy", device="cuda", dtype="bfloat16", max_num_seqs=128,
                          max_num_batched_tokens=8192, num_kv_blocks=(90 << 30) // (16 * kv_per_token),
                          max_model_len=16384, enforce_eager=eager, partition_backend="none",
                          decode_stream=decode_stream, **extra)
    engine = LLMEngine(config)
    for k, v in engine.runner.kv_caches:
        k.normal_()
        v.normal_()
    wbytes = weight_bytes(engine)
    results = {"graphs": engine.graphs is not None, "decode": [], "prefill": []}
    for batch in (1, 8, 32, 64, 128):
        for ctx in (512, 2048, 8192):
            if batch * ctx > engine.block_manager.num_free_blocks * 16:
                continue
            seqs = make_batch(engine, batch, ctx, 1, MULTI_STEP - 1)
            row = {"batch": batch, "ctx": ctx}
            try:
                t = time_step(engine, SchedulerOutput(seqs, [], Plan(), []), iters)
                floor = (wbytes + batch * ctx * kv_per_token) / COPY_BW
                row.update(ms=t * 1e3, floor_ms=floor * 1e3, ratio=t / floor)
                # --num-decode-steps: steps queued one behind the other, the host work overlapped
                multi = SchedulerOutput(seqs, [], Plan(k=MULTI_STEP), [])
                t = time_step(engine, multi, iters) / MULTI_STEP
                row.update(multi_step_ms=t * 1e3, multi_step_ratio=t / floor)
                if engine.sampler.race:  # the same steps sampled by the torch path, side by side
                    engine.sampler.race = False
                    try:
                        row["multi_step_torch_sampler_ms"] = time_step(engine, multi, iters) / MULTI_STEP * 1e3
                    finally:
                        engine.sampler.race = True
            except Exception as exc:  # keep going: report the failure in the table
                row["error"] = repr(exc)
            results["decode"].append(row)
            print(row, flush=True)
            for s in seqs:
                engine.block_manager.free(s.seq)
    if engine.piecewise is not None:  # mixed batches: piecewise graphs against eager, side by side
        results["piecewise_mib"] = engine.piecewise.memory_bytes / 2**20
        results["mixed"] = [time_mixed(engine, nd, p, iters) for nd, p in MIXED]
    for n, length in ((1, 8192), (8, 1024)):
        seqs = make_batch(engine, n, length, length)
        t = time_step(engine, SchedulerOutput([], seqs, Plan(), []), max(3, iters // 4))
        linear = 2 * n * length * (wbytes // 2 - 151936 * 4096)  # 2 FLOPs per weight per token, no lm_head
        attn = 36 * n * (4 * 32 * 128 * length * (length + 1) / 2)  # causal QK^T and PV
        flops = linear + attn + 2 * n * 4096 * 151936
        results["prefill"].append({"shape": f"{n}x{length}", "ms": t * 1e3, "tflops": flops / t / 1e12,
                                   "frac_of_797": flops / t / GEMM_RATE})
        for s in seqs:
            engine.block_manager.free(s.seq)
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_engine.json"))
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variant", choices=tuple(VARIANT_ENV), help="run one variant (used internally)")
    ap.add_argument("--variants", default="graphs,eager", help="variants to run, each in its own process")
    args = ap.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANT_ENV)
    if unknown:
        ap.error(f"--variants: unknown {', '.join(sorted(unknown))} (known: {', '.join(VARIANT_ENV)})")
    if args.variant:
        args.out.write_text(json.dumps(run_variant(args.variant == "eager", args.attention_backend, args.iters,
                                                   decode_stream=args.variant == "graphs-stream")))
        return 0
    runs = {}
    for variant in args.variants.split(","):  # one process each: a fresh GPU memory pool per engine
        path = args.out.with_suffix(f".{variant}.json")
        subprocess.run([sys.executable, __file__, "--variant", variant, "--out", str(path), "--attention-backend",
                        args.attention_backend, "--iters", str(args.iters)], check=True,
                       env={**os.environ, **VARIANT_ENV[variant]})
        runs[variant] = json.loads(path.read_text())
    args.out.write_text(json.dumps(runs, indent=1))
    eager = {(r["batch"], r["ctx"]): r for r in runs.get("eager", {}).get("decode", [])}
    others = {v: {(r["batch"], r["ctx"]): r for r in run.get("decode", [])}
              for v, run in runs.items() if v not in ("graphs", "eager")}  # graph variants beside the default
    nan = {"ms": float("nan"), "ratio": float("nan"), "multi_step_ratio": float("nan")}
    base = runs.get("graphs") or next(iter(runs.values()))
    print(f"\ndecode step, ms (graphs recorded: {base['graphs']}); floor = bytes(weights+KV)/4.19 TB/s; "
          f"then each other variant's ms, ratio and 8-step ratio ({', '.join(others) or 'none'})")
    print(f"{'batch':>5} {'ctx':>5} {'graphs':>8} {'eager':>8} {'floor':>7} {'ratio':>6} {'speedup':>7} "
          f"{'8-step/step':>11} {'ratio':>6} {'torch-smp':>9}" + "".join(f" {v[-8:]:>8} {'ratio':>6} {'8-step':>6}" for v in others))
    for r in base["decode"]:
        key = (r["batch"], r["ctx"])
        e, rest = eager.get(key, nan), [o.get(key, nan) for o in others.values()]
        bad = [d.get("error") for d in (r, e, *rest) if "error" in d]
        if bad:
            print(f"{r['batch']:>5} {r['ctx']:>5} ERROR {bad[0][:70]}")
            continue
        print(f"{r['batch']:>5} {r['ctx']:>5} {r['ms']:8.2f} {e['ms']:8.2f} {r['floor_ms']:7.2f} {r['ratio']:6.2f} "
              f"{e['ms'] / r['ms']:7.2f} {r['multi_step_ms']:11.2f} {r['multi_step_ratio']:6.2f} "
              f"{r.get('multi_step_torch_sampler_ms', float('nan')):9.2f}"
              + "".join(f" {t['ms']:8.2f} {t['ratio']:6.2f} {t['multi_step_ratio']:6.2f}" for t in rest))
    if base.get("mixed"):
        print(f"\nmixed batch (decodes at context 1024 + one prompt), ms: piecewise graphs "
              f"({base['piecewise_mib']:.0f} MiB) against eager, one engine")
        print(f"{'decodes':>7} {'prompt':>6} {'piecewise':>9} {'eager':>8} {'speedup':>7}")
        for r in base["mixed"]:
            print(f"{r['decodes']:>7} {r['prompt']:>6} {r['piecewise_ms']:9.2f} {r['eager_ms']:8.2f} "
                  f"{r['eager_ms'] / r['piecewise_ms']:7.2f}")
    print("\nprefill (graphs build)")
    for r in base["prefill"]:
        print(f"{r['shape']:>8} {r['ms']:8.1f} ms {r['tflops']:6.0f} TFLOP/s  {100 * r['frac_of_797']:5.1f}% of 797")
    return 0


if __name__ == "__main__":
    sys.exit(main())
