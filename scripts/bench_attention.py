"""Check and time the Triton paged attention kernels on a CUDA GPU (Qwen3-8B heads, bf16).

Every shape is first checked against ``TorchAttention`` run in float32 on the same inputs
(relative error < 1e-2, every output element written), then timed with
``triton.testing.do_bench`` (median; it flushes the L2 cache between runs).

- decode: batch 1/8/32/64/128 x context 512/2048/8192, block size 16; achieved bandwidth is
  the K/V bytes read (plus q and out) over the time, against the H200's measured copy rate
  4.19 TB/s (DESIGN.md section 5). The default key split count is timed, and every other
  power of two up to ``MAX_SPLITS`` to show the best one.
- prefill: 8192 tokens as 1 x 8192 and 8 x 1024, and a 2048-token chunk after 6144 cached
  ones; TFLOP/s over useful causal FLOPs ``4 Hq D sum(q c + q (q + 1) / 2)`` (``c`` cached
  tokens), against 797 TFLOP/s (bf16 GEMM); torch's SDPA on contiguous K/V beside it.

A failing shape prints its error and the run goes on. Writes JSON to ``--out`` and prints a
table last. Usage: ``python scripts/bench_attention.py --out attention.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from duetserve.model.attention import AttentionMetadata, TorchAttention

HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DEVICE, DTYPE = "cuda", torch.bfloat16
COPY_BW, GEMM_RATE = 4.19e12, 797e12
TOL = 1e-2
CHECK_SEQS = 8  # sequences compared with the float32 reference (each is computed independently)


def make_inputs(qlens: list[int], ctxs: list[int]):
    """q ``[T, HQ, D]``, a paged cache holding exactly these contexts (blocks shuffled) and metadata."""
    dev = torch.device(DEVICE)
    counts = [-(-c // BLOCK_SIZE) for c in ctxs]
    perm = torch.randperm(sum(counts), device=dev, dtype=torch.int32)
    width = max(counts)
    tables = torch.zeros(len(ctxs), width, dtype=torch.int32, device=dev)
    slots, start = [], 0
    for i, (n, ql, c) in enumerate(zip(counts, qlens, ctxs)):
        tables[i, :n] = perm[start:start + n]
        start += n
        pos = torch.arange(c - ql, c, device=dev)
        slots.append(tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    k_cache, v_cache = (torch.randn(sum(counts), BLOCK_SIZE, HKV, HEAD_DIM, device=dev, dtype=DTYPE) for _ in "kv")
    starts = torch.tensor([0] + qlens, device=dev).cumsum(0).int()
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), query_start_loc=starts,
                             context_lens=torch.tensor(ctxs, dtype=torch.int32, device=dev), block_tables=tables,
                             num_decodes=0, query_lens_cpu=qlens, context_lens_cpu=ctxs)
    q = torch.randn(sum(qlens), HQ, HEAD_DIM, device=dev, dtype=DTYPE)
    return q, k_cache, v_cache, meta


def check(out: torch.Tensor, q, k_cache, v_cache, meta, scale: float, decode: bool) -> float:
    """Relative error of ``out`` against ``TorchAttention`` in float32 on the first ``CHECK_SEQS`` sequences.

    Raises:
        AssertionError: NaN left in ``out`` or the error is >= ``TOL``.
    """
    assert out.isfinite().all(), "output has NaN: not every element was written"
    n = min(CHECK_SEQS, len(meta.query_lens_cpu))
    rows = sum(meta.query_lens_cpu[:n])
    sub = AttentionMetadata(slot_mapping=meta.slot_mapping[:rows], query_start_loc=meta.query_start_loc[:n + 1],
                            context_lens=meta.context_lens[:n], block_tables=meta.block_tables[:n],
                            num_decodes=n if decode else 0, query_lens_cpu=meta.query_lens_cpu[:n],
                            context_lens_cpu=meta.context_lens_cpu[:n])
    kc, vc = k_cache.float(), v_cache.float()
    new_k, new_v = (c.view(-1, HKV, HEAD_DIM)[sub.slot_mapping] for c in (kc, vc))
    ref = TorchAttention().forward(q[:rows].float(), new_k, new_v, kc, vc, sub, scale)
    err = ((out[:rows].float() - ref).norm() / ref.norm()).item()
    assert err < TOL, f"relative error {err:.2e} >= {TOL}"
    return err


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def run_decode(batch: int, ctx: int, ta) -> dict:
    qlens, ctxs = [1] * batch, [ctx] * batch
    q, k_cache, v_cache, meta = make_inputs(qlens, ctxs)
    scale = HEAD_DIM ** -0.5
    out = torch.full_like(q, float("nan"))
    auto = ta.default_num_splits(batch, HKV, meta.block_tables.shape[1] * BLOCK_SIZE, q.device)

    def call(splits):
        return lambda: ta.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                                 out=out, num_splits=splits)

    call(auto)()
    err = check(out, q, k_cache, v_cache, meta, scale, decode=True)
    times = {s: bench_ms(call(s)) for s in sorted({auto} | {2 ** i for i in range(6) if 2 ** i <= ta.MAX_SPLITS})}
    nbytes = 2 * batch * ctx * HKV * HEAD_DIM * 2 + 2 * q.numel() * 2
    best = min(times, key=times.get)
    return {"batch": batch, "context": ctx, "splits": auto, "us": times[auto] * 1e3, "bytes": nbytes,
            "gb_s": nbytes / times[auto] / 1e6, "floor_us": nbytes / COPY_BW * 1e6,
            "best_splits": best, "best_us": times[best] * 1e3, "us_by_splits": {str(s): t * 1e3 for s, t in times.items()},
            "rel_err": err}


def run_prefill(name: str, qlens: list[int], ctxs: list[int], ta) -> dict:
    q, k_cache, v_cache, meta = make_inputs(qlens, ctxs)
    scale = HEAD_DIM ** -0.5
    out = torch.full_like(q, float("nan"))

    def call():
        ta.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                                   scale, out=out)

    call()
    err = check(out, q, k_cache, v_cache, meta, scale, decode=False)
    ms = bench_ms(call)
    flops = 4 * HQ * HEAD_DIM * sum(ql * (c - ql) + ql * (ql + 1) / 2 for ql, c in zip(qlens, ctxs))
    sdpa_ms = sdpa_time(qlens) if qlens == ctxs and len(set(qlens)) == 1 else None  # equal prompts, no cache
    return {"name": name, "tokens": sum(qlens), "us": ms * 1e3, "flops": flops, "tflop_s": flops / ms / 1e9,
            "of_gemm": flops / ms / 1e9 / (GEMM_RATE / 1e12), "rel_err": err,
            "sdpa_tflop_s": flops / sdpa_ms / 1e9 if sdpa_ms else None}


def sdpa_time(qlens: list[int]) -> float | None:
    """torch SDPA (causal, GQA) on contiguous ``[B, H, L, D]`` tensors, ms; None if it fails."""
    b, n = len(qlens), qlens[0]
    qs = torch.randn(b, HQ, n, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    ks, vs = (torch.randn(b, HKV, n, HEAD_DIM, device=DEVICE, dtype=DTYPE) for _ in "kv")
    try:
        return bench_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
    except Exception as exc:  # a reference figure only
        print(f"SDPA failed: {exc!r}", flush=True)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention.json", help="JSON results path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    import duetserve.model.triton_attention as ta

    t0 = time.time()
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "heads": [HQ, HKV, HEAD_DIM], "block_size": BLOCK_SIZE, "decode": [], "prefill": [], "errors": []}
    jobs = [("decode", f"decode b={b} ctx={c}", lambda b=b, c=c: run_decode(b, c, ta))
            for b in (1, 8, 32, 64, 128) for c in (512, 2048, 8192)]
    jobs += [("prefill", name, lambda name=name, q=q, c=c: run_prefill(name, q, c, ta)) for name, q, c in
             (("1x8192", [8192], [8192]), ("8x1024", [1024] * 8, [1024] * 8), ("2048 after 6144", [2048], [8192]))]
    for kind, name, job in jobs:
        try:
            row = job()
            result[kind].append(row)
            print(f"ok   {name}: {row['us']:.1f} us (rel err {row['rel_err']:.1e})", flush=True)
        except Exception as exc:  # report and go on to the next shape
            result["errors"].append({"shape": name, "error": repr(exc)})
            print(f"FAIL {name}: {exc!r}", flush=True)
            traceback.print_exc()
        torch.cuda.empty_cache()
    result["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']}; heads {HQ}/{HKV}x{HEAD_DIM} "
          f"{str(DTYPE).removeprefix('torch.')}, block {BLOCK_SIZE}; {result['seconds']:.0f} s")
    print(f"{'decode':>14} {'splits':>6} {'us':>8} {'GB/s':>6} {'floor us':>8} {'x floor':>7} {'best split':>10}")
    for r in result["decode"]:
        print(f"b={r['batch']:>3} c={r['context']:>5} {r['splits']:>6} {r['us']:>8.1f} {r['gb_s']:>6.0f} "
              f"{r['floor_us']:>8.1f} {r['us'] / r['floor_us']:>7.2f} {r['best_splits']:>4} {r['best_us']:>5.1f}")
    print(f"{'prefill':>16} {'us':>8} {'TFLOP/s':>8} {'of 797':>6} {'SDPA TFLOP/s':>12}")
    for r in result["prefill"]:
        sdpa = f"{r['sdpa_tflop_s']:.0f}" if r["sdpa_tflop_s"] else "-"
        print(f"{r['name']:>16} {r['us']:>8.0f} {r['tflop_s']:>8.0f} {r['of_gemm']:>6.0%} {sdpa:>12}")
    print(f"{len(result['errors'])} failed shape(s)" + "".join(f"\n  {e['shape']}: {e['error']}"
                                                                 for e in result["errors"]))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
