"""Check and time the Triton paged attention kernels on a CUDA GPU (Qwen3-8B heads, bf16).

Every shape is first checked against ``TorchAttention`` run in float32 on the same inputs
(relative error < 1e-2, every output element written), then timed.

- decode: batch 1/8/32/64/128 x context 512/2048/8192, block size 16, block tables as wide
  as the engine's CUDA graphs make them (Qwen3-8B's 40960 tokens), so the default split count
  is the one the engine runs. Timed as the engine runs it: replays of a CUDA graph of many
  calls, each on its own copy of the KV cache (the copies together twice the L2 cache, like a
  model's layers), so neither Python launch time nor L2 hits count. Achieved bandwidth is the
  K/V bytes read (plus q and out) over the time, against the H200's measured copy rate
  4.19 TB/s (docs/design.md section 5). Batches 1/8/32 also sweep the split count (1, 2, 4, ...,
  ``MAX_SPLITS``) to show the best one.
- decode contexts from a served run (``--decode-log``, the server's iteration log, JSONL or
  gzipped): decode-only iterations at the quartiles and maximum of their summed context (those
  of at least ``LOG_MIN_CONTEXT`` tokens), each with its own uneven contexts and beside a
  uniform batch of the same size and summed context, and (``--cache-tokens``) once more in a
  server-sized one-layer cache with its blocks scattered over it, timed as above. Served long-context
  decode steps ran about 1.3x their predicted time on Mooncake (docs/benchmarks.md, sixteenth
  session); this tells whether the kernel does at those contexts.
- skewed decode batches: one context of ``GRAPH_CONTEXT`` tokens among short ones (``SKEWED``),
  where the long one gets many more splits than the mean and its last split merges them all.
- prefill: 8192 tokens as 1 x 8192 and 8 x 1024, and a 2048-token chunk after 6144 cached
  ones, timed with ``triton.testing.do_bench`` (median; it flushes the L2 cache between runs);
  TFLOP/s over useful causal FLOPs ``4 Hq D sum(q c + q (q + 1) / 2)`` (``c`` cached
  tokens), against 797 TFLOP/s (bf16 GEMM); torch's SDPA on contiguous K/V beside it.

- ``--baseline PATH``: another version of ``duetserve/model/triton_attention.py`` (e.g. written
  by ``git show REV:duetserve/model/triton_attention.py``), whose decode kernel is timed on the
  same inputs right after ours, at its own default split count; the tables give its time and
  ours over it.

A failing shape prints its error and the run goes on. Writes JSON to ``--out`` and prints a
table last. Usage: ``python scripts/bench_attention.py --out attention.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from duetserve.argtypes import non_negative_int
from duetserve.calibrate.host import read_iteration_log
from duetserve.calibrate.workload import L2_BYTES, rotation_sets
from duetserve.model.attention import AttentionMetadata, TorchAttention

HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
GRAPH_CONTEXT = 40960  # Qwen3-8B's max_position_embeddings: the engine's graph block tables hold this many tokens
DEVICE, DTYPE = "cuda", torch.bfloat16
COPY_BW, GEMM_RATE = 4.19e12, 797e12
TOL = 1e-2
CHECK_SEQS = 8  # sequences compared with the float32 reference (each is computed independently)
SWEEP_BATCHES = (1, 8, 32)  # decode batches whose every split count is timed
GRAPH_CALLS = 32  # at least this many decode calls per timed graph replay
SKEWED = ((8, 512), (32, 512), (64, 512), (128, 256))  # (batch, short context): one GRAPH_CONTEXT, the rest short
LOG_MIN_CONTEXT = 100_000  # --decode-log: decode-only iterations with at least this many context tokens in all


def make_inputs(qlens: list[int], ctxs: list[int], width: int = 0, cache_tokens: int = 0):
    """q ``[T, HQ, D]``, a paged cache holding these contexts (blocks shuffled) and metadata;
    block tables ``max(width, blocks needed)`` wide (padded with block 0). The cache holds the
    larger of the blocks needed and ``cache_tokens`` worth of blocks (one layer of a server's
    cache, rounded up to whole blocks), the needed ones scattered over all of it, as a
    long-running server's are."""
    dev = torch.device(DEVICE)
    counts = [-(-c // BLOCK_SIZE) for c in ctxs]
    total = max(sum(counts), -(-cache_tokens // BLOCK_SIZE))
    perm = torch.randperm(total, device=dev, dtype=torch.int32)[:sum(counts)]
    width = max(width, *counts)
    tables = torch.zeros(len(ctxs), width, dtype=torch.int32, device=dev)
    slots, start = [], 0
    for i, (n, ql, c) in enumerate(zip(counts, qlens, ctxs)):
        tables[i, :n] = perm[start:start + n]
        start += n
        pos = torch.arange(c - ql, c, device=dev)
        slots.append(tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    k_cache, v_cache = (torch.randn(total, BLOCK_SIZE, HKV, HEAD_DIM, device=dev, dtype=DTYPE) for _ in "kv")
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


def graph_us(fns: list, replays: int = 5) -> float:
    """Median microseconds per call of ``fns`` (each called once eagerly already), recorded in
    one CUDA graph, called round-robin at least ``GRAPH_CALLS`` times, and replayed."""
    calls = math.ceil(GRAPH_CALLS / len(fns)) * len(fns)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def run_decode(ctxs: list[int], ta, cache_tokens: int = 0, base=None) -> dict:
    """One decode batch (a context per sequence): the default split count (and with a batch size in
    ``SWEEP_BATCHES`` every power of two up to ``MAX_SPLITS``) checked and timed from CUDA-graph
    replays; ``cache_tokens``: see ``make_inputs``; ``base``: a baseline kernel module, checked
    and timed the same way at its default split count (``base_us``). ``context`` in the result is
    the mean context, ``max_context`` the longest."""
    batch = len(ctxs)
    qlens = [1] * batch
    q, k_cache, v_cache, meta = make_inputs(qlens, ctxs, width=GRAPH_CONTEXT // BLOCK_SIZE,
                                            cache_tokens=cache_tokens)
    kv_bytes = 2 * sum(-(-c // BLOCK_SIZE) for c in ctxs) * BLOCK_SIZE * HKV * HEAD_DIM * k_cache.element_size()
    copies = 0 if kv_bytes >= 2 * L2_BYTES else rotation_sets(kv_bytes) - 1  # each a copy of the whole cache
    if copies and cache_tokens:
        raise ValueError(f"{sum(ctxs)} context tokens are under twice the L2 cache: a {cache_tokens}-token cache "
                         f"would be copied {copies} times")
    caches = [(k_cache, v_cache)] + [(torch.randn_like(k_cache), torch.randn_like(v_cache)) for _ in range(copies)]
    scale = HEAD_DIM ** -0.5
    out = torch.full_like(q, float("nan"))
    counters = torch.zeros(batch * HKV, dtype=torch.int32, device=q.device)  # one buffer, as the engine's graphs
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    auto = ta.default_num_splits(batch, HKV, meta.block_tables.shape[1] * BLOCK_SIZE, sms)
    sweep = [2 ** i for i in range(ta.MAX_SPLITS.bit_length())] if batch in SWEEP_BATCHES else []
    times, err = {}, 0.0
    for mod, splits in [(ta, s) for s in sorted({auto, *sweep})] + ([(base, None)] if base else []):
        fns = [lambda kc=kc, vc=vc, m=mod, s=splits: m.paged_decode_attention(
            q, kc, vc, meta.block_tables, meta.context_lens, scale, out=out, num_splits=s, counters=counters)
               for kc, vc in caches]
        out.fill_(float("nan"))
        fns[0]()
        err = max(err, check(out, q, k_cache, v_cache, meta, scale, decode=True))
        times[splits if mod is ta else "base"] = graph_us(fns)
    base_us = times.pop("base", None)
    nbytes = 2 * sum(ctxs) * HKV * HEAD_DIM * 2 + 2 * q.numel() * 2
    best = min(times, key=times.get)
    return {"batch": batch, "context": round(sum(ctxs) / batch), "max_context": max(ctxs),
            "cache_tokens": k_cache.shape[0] * BLOCK_SIZE, "splits": auto, "us": times[auto], "bytes": nbytes,
            "gb_s": nbytes / times[auto] / 1e3, "floor_us": nbytes / COPY_BW * 1e6, "best_splits": best,
            "best_us": times[best], "us_by_splits": {str(s): t for s, t in times.items()}, "kv_copies": len(caches),
            "base_us": base_us, "rel_err": err}


def log_batches(path: str, count: int = 4) -> list[list[int]]:
    """Decode contexts (cached tokens + the new one) of ``count`` decode-only iterations of an
    iteration log (``duetserve serve --iteration-log``; ``.gz`` read gzipped): those at the
    quartiles and the maximum of the summed context among those with at least
    ``LOG_MIN_CONTEXT``, fewer if fewer qualify.

    Raises:
        OSError, ValueError: as ``read_iteration_log``.
    """
    batches = []
    for r in read_iteration_log(path):
        if r.get("num_prefill_tokens") == 0 and r.get("num_decodes") and r.get("requests"):
            ctxs = [c + q for q, c in r["requests"][:r["num_decodes"]]]
            if sum(ctxs) >= LOG_MIN_CONTEXT:
                batches.append(ctxs)
    batches.sort(key=sum)
    picks = sorted({round(f * (len(batches) - 1)) for f in (0.25, 0.5, 0.75, 1.0)}) if batches else []
    return [batches[i] for i in picks][:count]


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


def load_baseline(path: str):
    """The module in file ``path`` (a version of ``duetserve/model/triton_attention.py``).

    Raises:
        OSError: the file cannot be read. Whatever importing it raises.
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_triton_attention", path)
    if spec is None:
        raise OSError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def base_header(rows: list[dict]) -> str:
    """The baseline's table columns, if any row has a baseline time."""
    return f" {'base us':>8} {'x base':>6}" if any(r["base_us"] for r in rows) else ""


def base_cells(row: dict) -> str:
    return f" {row['base_us']:>8.1f} {row['us'] / row['base_us']:>6.2f}" if row["base_us"] else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention.json", help="JSON results path")
    parser.add_argument("--decode-log", metavar="PATH",
                        help="also time the decode batches of a served run's iteration log (JSONL, or .gz)")
    parser.add_argument("--cache-tokens", type=non_negative_int, default=811_728, metavar="N",
                        help="--decode-log batches: also time each in a one-layer cache of N tokens, its blocks "
                             "scattered over all of it, as a server's (default: 811728, the H200 server's cache "
                             "for Qwen3-8B; 0: not)")
    parser.add_argument("--baseline", metavar="PATH",
                        help="another triton_attention.py whose decode kernel is timed beside ours on the same inputs")
    args = parser.parse_args(argv)
    if args.baseline and not Path(args.baseline).is_file():
        parser.error(f"--baseline: no file {args.baseline}")
    try:
        logged = log_batches(args.decode_log) if args.decode_log else []
    except (OSError, ValueError) as exc:
        parser.error(f"--decode-log: {exc}")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    import duetserve.model.triton_attention as ta

    base = load_baseline(args.baseline) if args.baseline else None

    t0 = time.time()
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "heads": [HQ, HKV, HEAD_DIM], "block_size": BLOCK_SIZE, "decode": [], "uneven": [], "prefill": [],
              "errors": []}
    jobs = [("decode", f"decode b={b} ctx={c}", lambda b=b, c=c: run_decode([c] * b, ta, base=base))
            for b in (1, 8, 32, 64, 128) for c in (512, 2048, 8192)]
    jobs += [("uneven", f"skewed b={b} 1x{GRAPH_CONTEXT} + {b - 1}x{c}",
              lambda b=b, c=c: {**run_decode([GRAPH_CONTEXT] + [c] * (b - 1), ta, base=base), "variant": "skewed"})
             for b, c in SKEWED]
    for ctxs in logged:  # as served, uniform with the same batch and summed context, scattered in a big cache
        b, mean = len(ctxs), round(sum(ctxs) / len(ctxs))
        jobs += [("uneven", f"logged b={b} sum={sum(ctxs)} max={max(ctxs)}",
                  lambda ctxs=ctxs: {**run_decode(ctxs, ta, base=base), "variant": "served"}),
                 ("uneven", f"uniform b={b} ctx={mean}",
                  lambda b=b, mean=mean: {**run_decode([mean] * b, ta, base=base), "variant": "uniform"})]
        if -(-args.cache_tokens // BLOCK_SIZE) > sum(-(-c // BLOCK_SIZE) for c in ctxs):
            jobs.append(("uneven", f"logged b={b} in a {args.cache_tokens}-token cache",
                         lambda ctxs=ctxs: {**run_decode(ctxs, ta, args.cache_tokens, base), "variant": "scattered"}))
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
    print(f"{'decode':>14} {'splits':>6} {'us':>8} {'GB/s':>6} {'floor us':>8} {'x floor':>7} {'best split':>10}"
          + base_header(result["decode"]))
    for r in result["decode"]:
        print(f"b={r['batch']:>3} c={r['context']:>5} {r['splits']:>6} {r['us']:>8.1f} {r['gb_s']:>6.0f} "
              f"{r['floor_us']:>8.1f} {r['us'] / r['floor_us']:>7.2f} {r['best_splits']:>4} {r['best_us']:>5.1f}"
              + base_cells(r))
    if result["uneven"]:
        print(f"{'decode, uneven':>24} {'max ctx':>7} {'cache':>7} {'splits':>6} {'us':>8} {'floor us':>8} "
              f"{'x floor':>7}" + base_header(result["uneven"]))
        for r in result["uneven"]:
            print(f"{r['variant']:>9} b={r['batch']:>3} c={r['context']:>6} {r['max_context']:>7} {r['cache_tokens']:>7} "
                  f"{r['splits']:>6} {r['us']:>8.1f} {r['floor_us']:>8.1f} {r['us'] / r['floor_us']:>7.2f}"
                  + base_cells(r))
    sweep = [r for r in result["decode"] if r["batch"] in SWEEP_BATCHES]
    if sweep:
        splits = list(sweep[0]["us_by_splits"])
        print(f"decode us by split count (* default)\n{'':>13}" + "".join(f"{s:>7} " for s in splits))
        for r in sweep:
            cells = "".join(f"{r['us_by_splits'][s]:>7.1f}" + ("*" if s == str(r["splits"]) else " ") for s in splits)
            print(f"b={r['batch']:>3} c={r['context']:>5}" + cells)
    print(f"{'prefill':>16} {'us':>8} {'TFLOP/s':>8} {'of 797':>6} {'SDPA TFLOP/s':>12}")
    for r in result["prefill"]:
        sdpa = f"{r['sdpa_tflop_s']:.0f}" if r["sdpa_tflop_s"] else "-"
        print(f"{r['name']:>16} {r['us']:>8.0f} {r['tflop_s']:>8.0f} {r['of_gemm']:>6.0%} {sdpa:>12}")
    print(f"{len(result['errors'])} failed shape(s)" + "".join(f"\n  {e['shape']}: {e['error']}"
                                                                 for e in result["errors"]))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
