"""Does every GEMM the executor launches terminate on TPC-masked streams? (issue 6, the tpcmask hazard)

docs/design.md section 5 records cuBLAS decode-shaped GEMMs that never finished on a stream masked to
few TPCs. This sweeps every split level the ``tpcmask`` backend offers (or ``--levels``): on
the level's decode stream, bf16 ``F.linear`` with Qwen3-8B's decode shapes (qkv, o, gate_up,
down, lm_head) for each decode batch size; on its prefill stream (the complement mask), the
same layers for each prefill chunk size. One child process runs the items in order and prints
each one as it finishes; an item that makes no progress for ``--timeout`` seconds counts as
a hang, the child is killed and a new one resumes after it. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096),
          "lm_head": (4096, 151936)}

CHILD = r"""
import json, sys, torch, torch.nn.functional as F
from duetserve.partition.tpcmask import TpcMaskBackend
shapes, items = json.loads(sys.argv[1]), json.loads(sys.argv[2])
backend = TpcMaskBackend(0)
torch.manual_seed(0)
ws = {k: torch.randn(n, k_, device="cuda", dtype=torch.bfloat16) * 0.02 for k, (k_, n) in shapes.items()}
x = torch.randn(max(i[2] for i in items), 12288, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
for i, (s_d, side, rows, name) in enumerate(items):
    pair = backend.pair(s_d)
    stream = pair.decode if side == "decode" else pair.prefill
    with torch.cuda.stream(stream):
        for _ in range(3):
            F.linear(x[:rows, :shapes[name][0]], ws[name])
    stream.synchronize()
    print(i, flush=True)
"""


def sweep(items: list[tuple], timeout: float) -> list[str]:
    """Status of each item: ``ok``, ``hang`` or ``error: ...``."""
    status: list[str] = []
    while len(status) < len(items):
        todo = items[len(status):]
        proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(SHAPES), json.dumps(todo)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        done, wait, hung = 0, timeout + 30, False  # the first item also pays CUDA start-up
        while done < len(todo):
            try:
                line = lines.get(timeout=wait)
            except queue.Empty:
                hung = True
                break
            if line is None:  # the child exited early: an error
                break
            done += 1
            status.append("ok")
            wait = timeout
        if hung:
            proc.kill()
            status.append("hang")
        elif done < len(todo):  # an error before any item ran (no TPC-mask support) fails every item left
            proc.wait()
            error = "error: " + proc.stderr.read().strip()[-200:]
            status.extend([error] * (len(todo) - done if done == 0 else 1))
        proc.wait()
    return status


def _pump(stream, lines: queue.Queue) -> None:
    """Forward the child's stdout lines into ``lines``; None at its end."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("tpcmask_watchdog.json"))
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds without progress that count as a hang")
    ap.add_argument("--levels", default="", help="decode SM counts (default: every level the backend offers)")
    ap.add_argument("--decode-batches", default="1,8,32,64,128,256")
    ap.add_argument("--prefill-tokens", default="512,2048,8192,32768",
                    help="prefill rows (32768: pdmux runs whole prompts, up to the context length)")
    args = ap.parse_args()
    if args.levels:
        levels = [int(v) for v in args.levels.split(",")]
    else:
        from duetserve.partition.tpcmask import TpcMaskBackend

        levels = TpcMaskBackend(0).levels()
    items = [(s, "decode", b, name) for s in levels for b in map(int, args.decode_batches.split(",")) for name in SHAPES]
    items += [(s, "prefill", t, name) for s in levels for t in map(int, args.prefill_tokens.split(","))
              for name in SHAPES if name != "lm_head"]
    t0 = time.monotonic()
    status = sweep(items, args.timeout)
    rows = [{"s_decode": s, "stream": side, "rows": n, "gemm": name, "status": st}
            for (s, side, n, name), st in zip(items, status)]
    args.out.write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r["status"] != "ok"]
    print(f"\ntpcmask watchdog: {len(rows)} masked bf16 GEMMs (Qwen3-8B layers, 3 calls each) over "
          f"{len(levels)} levels {levels[0]}..{levels[-1]} SMs, {time.monotonic() - t0:.0f} s")
    print(f"ok: {len(rows) - len(bad)}   not ok: {len(bad)}")
    for r in bad[:30]:
        print(f"  S_d={r['s_decode']:>3} {r['stream']:<7} rows={r['rows']:>5} {r['gemm']:<8} {r['status'][:60]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
