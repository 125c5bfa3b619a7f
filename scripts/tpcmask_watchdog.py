"""Does every decode-step kernel terminate on TPC-masked streams? (issue 6, the tpcmask hazard)

DESIGN section 5 records cuBLAS decode-shaped GEMMs that never finished on a stream masked to
few TPCs. For each decode SM count the optimizer may pick, this runs one Qwen3-8B-shaped decode
step (the model's own kernels: linear layers through cuBLAS, attention, norms) on a masked
stream in a child process with a timeout, and the linear shapes one by one when a step hangs.
A hang marks the level unsafe; the report lists safe and unsafe levels. Prints a table and
writes JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import sys, torch, torch.nn.functional as F
from duetserve.partition.tpcmask import TpcMaskBackend
s_d, batch, what = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
backend = TpcMaskBackend(0)
stream = backend.pair(s_d).decode
shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096),
          "lm_head": (4096, 151936)}
torch.manual_seed(0)
ws = {k: torch.randn(n, k_, device="cuda", dtype=torch.bfloat16) * 0.02 for k, (k_, n) in shapes.items()}
x = {k: torch.randn(batch, k_, device="cuda", dtype=torch.bfloat16) for k, (k_, n) in shapes.items()}
torch.cuda.synchronize()
with torch.cuda.stream(stream):
    for name in (shapes if what == "all" else [what]):
        for _ in range(3):
            F.linear(x[name], ws[name])
stream.synchronize()
print("ok")
"""


def run_child(s_d: int, batch: int, what: str, timeout: float) -> str:
    """``ok``, ``hang`` (timed out) or ``error: ...`` for one masked run."""
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(s_d), str(batch), what], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hang"
    return "ok" if proc.returncode == 0 and "ok" in proc.stdout else f"error: {proc.stderr.strip()[-200:]}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("tpcmask_watchdog.json"))
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds before a run counts as hung")
    ap.add_argument("--levels", default="8,16,32,48", help="decode SM counts to test")
    ap.add_argument("--batches", default="1,32", help="decode batch sizes")
    args = ap.parse_args()
    rows, diagnosed = [], 0
    for s_d in (int(x) for x in args.levels.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            status = run_child(s_d, batch, "all", args.timeout)
            row = {"s_decode": s_d, "batch": batch, "status": status}
            if status != "ok" and diagnosed < 2:  # each diagnosis costs up to 5 timeouts
                diagnosed += 1
                row["per_shape"] = {w: run_child(s_d, batch, w, args.timeout)
                                    for w in ("qkv", "o", "gate_up", "down", "lm_head")}
            rows.append(row)
            print(row, flush=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print("\ntpcmask watchdog: bf16 F.linear decode shapes (Qwen3-8B) on a stream masked to S_d SMs")
    for r in rows:
        extra = " ".join(f"{k}={v}" for k, v in r.get("per_shape", {}).items())
        print(f"S_d={r['s_decode']:>3} batch={r['batch']:>3} {r['status'][:40]:<40} {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
