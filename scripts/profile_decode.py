"""Where a decode step's GPU time goes: the top kernels of Qwen3-8B decode steps under torch.profiler.

Builds the engine's model as ``scripts/bench_engine.py`` does (Qwen3-8B shapes, dummy bf16
weights, CUDA graphs recorded up to the largest ``--shapes`` batch, the model's full 40960-token
block tables), then for each ``--shapes`` entry (batch x context, default 8x2048 and 64x2048) profiles ``STEPS``
decode steps (``ModelRunner.execute``, sampling included), eagerly and replayed from the CUDA
graphs (``--graphs-only``: replayed only). Prints, per run, the ``TOP`` GPU activities (kernels,
copies) by total GPU time with their launches and microseconds per step, the sum over all of them
per step, and the GPU span per step (first activity's start to last one's end, over ``STEPS``):
span minus sum is the time the GPU sat idle between kernels (launch gaps, host work). Writes
every activity to ``--out`` (JSON).
Usage: ``python scripts/profile_decode.py --out profile.json [--shapes 8x512,32x512] [--graphs-only]``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

SHAPES = ((8, 2048), (64, 2048))  # default (decode batch, context tokens)
STEPS = 5  # profiled decode steps per run (after 2 unprofiled ones)
TOP = 15
BLOCK = 16  # KV-cache block size, tokens


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"8x512,32x2048"`` -> ``((8, 512), (32, 2048))``.

    Raises:
        argparse.ArgumentTypeError: an entry that is not two positive integers joined by ``x``.
    """
    shapes = []
    for item in text.split(","):
        b, _, c = item.strip().partition("x")
        if not (b.isdigit() and c.isdigit() and int(b) > 0 and int(c) > 0):
            raise argparse.ArgumentTypeError(f"--shapes: expected BATCHxCONTEXT entries such as 8x512, got {item!r}")
        shapes.append((int(b), int(c)))
    return tuple(shapes)


def build_engine(shapes: tuple[tuple[int, int], ...]):
    """The engine on Qwen3-8B's config with dummy bf16 weights and decode CUDA graphs."""
    from duetserve.calibrate.workload import QWEN3_8B
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(QWEN3_8B))
    return LLMEngine(EngineConfig(model=str(folder), load_format="dummy", device="cuda", dtype="bfloat16",
                                  max_num_seqs=max(b for b, _ in shapes),
                                  num_kv_blocks=max(b * (c // BLOCK + 2) for b, c in shapes) + 64,
                                  partition_backend="none"))


def profile_run(engine, batch: int, ctx: int, graphs: bool) -> dict:
    """GPU activities of ``STEPS`` decode steps of ``batch`` sequences of ``ctx`` tokens, per step:
    ``{"kernels_per_step", "gpu_us_per_step", "activities": [{"name", "count", "us"}, ...]}``,
    activities sorted by GPU time (microseconds), counts and times divided by ``STEPS``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from duetserve.calibrate.workload import make_batch
    from duetserve.engine.policy import Plan
    from duetserve.engine.scheduler import SchedulerOutput

    runner = engine.runner
    recorded = runner.graphs
    runner.graphs = recorded if graphs else None
    seqs = make_batch(engine, batch, ctx, 1)
    out = SchedulerOutput(seqs, [], Plan(), [])
    try:
        for _ in range(2):
            list(runner.execute(out))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                list(runner.execute(out))
            torch.cuda.synchronize()
    finally:
        runner.graphs = recorded
        for s in seqs:
            engine.block_manager.free(s.seq)
    totals = defaultdict(lambda: [0, 0.0])
    start, end = float("inf"), 0.0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            totals[e.name][0] += 1
            totals[e.name][1] += e.time_range.elapsed_us()
            start, end = min(start, e.time_range.start), max(end, e.time_range.end)
    rows = sorted(({"name": n, "count": c / STEPS, "us": us / STEPS} for n, (c, us) in totals.items()),
                  key=lambda r: -r["us"])
    return {"batch": batch, "ctx": ctx, "mode": "graphs" if graphs else "eager",
            "kernels_per_step": sum(r["count"] for r in rows), "gpu_us_per_step": sum(r["us"] for r in rows),
            "span_us_per_step": (end - start) / STEPS, "activities": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("profile.json"), help="JSON results path")
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="BATCHxCONTEXT,... (default 8x2048,64x2048)")
    parser.add_argument("--graphs-only", action="store_true", help="profile graph replays only, not eager steps")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode: needs a CUDA GPU and none is visible; nothing profiled", file=sys.stderr)
        return 2
    engine = build_engine(args.shapes)
    if engine.graphs is None:
        print("profile_decode: the engine recorded no CUDA graphs (graph runs are eager)", file=sys.stderr)
    modes = (True,) if args.graphs_only else (False, True)
    runs = [profile_run(engine, b, c, graphs) for b, c in args.shapes for graphs in modes]
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "steps": STEPS, "runs": runs}, indent=1))
    for r in runs:
        print(f"\ndecode b={r['batch']} ctx={r['ctx']} {r['mode']}: {r['kernels_per_step']:.0f} GPU activities, "
              f"{r['gpu_us_per_step'] / 1e3:.2f} ms GPU time per step, span {r['span_us_per_step'] / 1e3:.2f} ms")
        print(f"{'us/step':>9} {'share':>6} {'count':>6}  kernel")
        for a in r["activities"][:TOP]:
            print(f"{a['us']:9.1f} {a['us'] / r['gpu_us_per_step']:6.1%} {a['count']:6.0f}  {a['name'][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
