"""Time ``plan_iteration`` on realistic batches (Qwen3-8B on the H200 profile, green-context
granularity), with the paper's rule and with a trim margin of 0.9 (``--trim-margin``, which
also prices the trimmed temporal batch). The optimizer runs once per engine iteration, on the
host between two iterations, so each call should take well under 1 ms of CPU (docs/design.md
section 4). Prints the median and p99 microseconds per scenario.

    python scripts/bench_optimizer.py [--iters 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from itertools import product

from duetserve.planner import CostModel, ModelShape, load_profile, plan_iteration


def scenarios(rng: random.Random) -> dict[str, tuple[list, list, float]]:
    """name -> (decode requests, prefill chunks, tau seconds)."""
    def decodes(n: int, lo: int, hi: int) -> list[tuple[int, int]]:
        return [(1, rng.randint(lo, hi)) for _ in range(n)]

    return {
        "temporal: 32 decodes + 512-token chunk": (decodes(32, 200, 4000), [(512, 1024)], 0.100),
        "spatial: 64 decodes + 8192-token prompt": (decodes(64, 500, 4000), [(8192, 0)], 0.050),
        "spatial: 256 decodes + 2 chunks of 4096": (decodes(256, 100, 8000), [(4096, 0), (4096, 4096)], 0.080),
        "fallback: 128 long decodes + 4096 chunk": (decodes(128, 8000, 12000), [(4096, 0)], 0.060),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    profile = load_profile("h200")
    cost = CostModel(ModelShape.preset("qwen3-8b"), profile)
    granularity = profile.granularity("greenctx")
    for (name, (decode, prefill, tau)), trim in product(scenarios(random.Random(0)).items(), (None, 0.9)):
        def plan():
            return plan_iteration(cost, decode, prefill, tau, profile.num_sms, granularity, trim_margin=trim)
        chosen = plan()
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            plan()
            times.append(time.perf_counter() - start)
        times.sort()
        shape = (f"spatial S_p={chosen.s_prefill} S_d={chosen.s_decode} k={chosen.k}" if chosen.spatial
                 else f"temporal limit={chosen.prefill_token_limit}")
        label = f"{name}{'' if trim is None else ', trim 0.9'}"
        print(f"{label:53s} median {statistics.median(times) * 1e6:7.1f} us  "
              f"p99 {times[int(0.99 * len(times))] * 1e6:7.1f} us  ({shape}, {chosen.predicted_s * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
