"""GPU isolation check (issue 6): decode step time on S_d SMs alone and beside a 16k-token prefill.

Qwen3-8B shapes, dummy bf16 weights, decode batch 32 x context 2048, green contexts, decode
steps replayed from the CUDA graphs recorded for each split level. For each
S_d: decode alone on S_d SMs, decode while a 16384-token prefill runs on the other SMs, the
ratio (target <= 1.5), the prefill time, and the cost model's predictions beside them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from duetserve.calibrate.workload import QWEN3_8B, make_batch
from duetserve.config import EngineConfig
from duetserve.engine.engine import LLMEngine
from duetserve.engine.policy import Plan
from duetserve.engine.scheduler import SchedulerOutput
from duetserve.planner.cost_model import CostModel, ModelShape
from duetserve.planner.hardware import load_profile


def stream_times(engine: LLMEngine, out: SchedulerOutput, reps: int = 3) -> dict[str, float]:
    """Median busy seconds of each stream over ``reps`` runs (after one warm-up)."""
    list(engine.runner.execute(out))
    runs = []
    for _ in range(reps):
        list(engine.runner.execute(out))
        runs.append(engine.runner.last_stream_seconds)
    return {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_spatial.json"))
    ap.add_argument("--backend", default="greenctx")
    ap.add_argument("--k", type=int, default=12, help="decode steps measured per iteration")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(QWEN3_8B))
    engine = LLMEngine(EngineConfig(model=str(folder), load_format="dummy", device="cuda", dtype="bfloat16",
                                    max_num_seqs=64, max_num_batched_tokens=16384, num_kv_blocks=8192,
                                    max_model_len=20000, partition_backend=args.backend,
                                    policy="duet"))  # a policy that splits: decode graphs for every level
    for k, v in engine.runner.kv_caches:
        k.normal_()
        v.normal_()
    backend = engine.partition  # decode graphs are recorded for each of its split levels
    if backend.granularity == 0:
        print("no partition backend:", backend.reason)
        return 1
    # GPU time only: the streams' CUDA events see no serving host time
    model = CostModel(ModelShape.preset("qwen3-8b"),
                      dataclasses.replace(load_profile("h200"), host_per_request_s=0.0, host_eager_s=0.0))
    decodes = make_batch(engine, 32, 2048, 1, extra_tokens=args.k - 1)  # KV slots for the k look-ahead steps
    prefill = make_batch(engine, 1, 16384, 16384)
    rows = []
    for s_d in (16, 24, 32, 48, 64):
        if s_d not in backend.levels():
            continue
        plan = Plan(spatial=True, s_prefill=backend.num_sms - s_d, s_decode=s_d, k=args.k)
        alone = stream_times(engine, SchedulerOutput(decodes, [], plan, []))["decode"] / args.k
        both = stream_times(engine, SchedulerOutput(decodes, prefill, plan, []))
        t_d, t_p = model.predict_spatial([(1, 2047)] * 32, [(16384, 0)], s_d, backend.num_sms)
        alone_pred = model.predict([(1, 2047)] * 32, s_d).total
        rows.append({"s_decode": s_d, "decode_alone_ms": alone * 1e3, "decode_beside_ms": both["decode"] / args.k * 1e3,
                     "ratio": both["decode"] / args.k / alone, "prefill_ms": both["prefill"] * 1e3,
                     "pred_decode_alone_ms": alone_pred * 1e3, "pred_decode_beside_ms": float(t_d) * 1e3,
                     "pred_prefill_ms": float(t_p) * 1e3})
        print(rows[-1], flush=True)
    args.out.write_text(json.dumps({"backend": backend.name, "rows": rows}, indent=1))
    print(f"\nisolation ({backend.name}): decode batch 32 x ctx 2048, k={args.k}, beside one 16384-token prefill")
    print(f"{'S_d':>4} {'alone':>7} {'beside':>7} {'ratio':>6} {'pred a':>7} {'pred b':>7} {'prefill':>8} {'pred p':>7}")
    for r in rows:
        print(f"{r['s_decode']:>4} {r['decode_alone_ms']:7.2f} {r['decode_beside_ms']:7.2f} {r['ratio']:6.2f} "
              f"{r['pred_decode_alone_ms']:7.2f} {r['pred_decode_beside_ms']:7.2f} {r['prefill_ms']:8.1f} "
              f"{r['pred_prefill_ms']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
