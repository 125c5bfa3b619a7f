"""GPU experiment: how fast bulk copies (TMA) stream a matrix's rows, by copy size (issue 5).

The weight-stream kernels (``duetserve/model/csrc/decode_stream.cu``) that read the engine's own
``[N, K]`` weights fill each ring stage with one bulk copy per weight row. This measures that
pattern alone (``scripts/weight_stream/bulk_copy.cu``: no multiplies, each stage freed as soon as
it lands) over a 4 GiB matrix of 8 KB and 24 KB rows (K = 4096 and 12288 in bf16), against one
contiguous copy per stage: TB/s per copy size, stage size and ring depth, issued from one lane
or one lane a row. Each case is the median of 5 launches timed with CUDA events
(``bench_weight_stream.events_ms``).

Needs a CUDA GPU of compute capability 9.0 with nvcc and CuPy (the lent H200's image has both).
Writes JSON to ``--out``; prints a short table last. Exit code 2 without CUDA.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).resolve().parent / "weight_stream" / "bulk_copy.cu"
# (row bytes, copy bytes, stages, stage bytes, one lane a row); copy = stage: one contiguous copy a stage
CASES = [(8192, 16384, 9, 16384, 0)] + [(8192, p, 9, 16384, lanes) for p in (4096, 2048, 1024, 512) for lanes in (0, 1)] \
    + [(8192, p, n, 32768, 1) for p, n in ((2048, 3), (2048, 4), (2048, 6), (1024, 4), (4096, 4))] \
    + [(24576, p, 9, 16384, 1) for p in (2048, 1024)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/bulk_copy.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_bulk_copy.py needs a CUDA GPU", file=sys.stderr)
        return 2
    # events_ms: bench_weight_stream.py beside this script (its folder is on sys.path when run)
    import cupy
    from bench_weight_stream import events_ms
    warnings.filterwarnings("ignore", message="ExternalStream is deprecated")
    cubin = Path(tempfile.mkdtemp()) / "bulk_copy.cubin"
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    subprocess.run([nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-o", str(cubin), str(SOURCE)],
                   check=True)
    fn = cupy.RawModule(path=str(cubin)).get_function("bulk_copy")
    smem = 200 * 1024 + 256
    fn.max_dynamic_shared_size_bytes = smem
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    rows_out = []
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        for row_bytes, piece, stages, stage_bytes, lanes in CASES:
            if piece == stage_bytes:  # contiguous: rows of one stage each
                row_bytes = stage_bytes
            rows = buf.numel() // row_bytes // (stage_bytes // piece) * (stage_bytes // piece)
            kernel_args = (np.uint64(buf.data_ptr()), np.int64(rows), np.int32(row_bytes), np.int32(piece),
                           np.int32(lanes), np.int32(stages), np.int32(stage_bytes))
            ms = events_ms(lambda a=kernel_args: fn((sms,), (64,), a, shared_mem=smem), replays=5)
            tbs = rows * row_bytes / ms / 1e9
            rows_out.append({"row_bytes": row_bytes, "copy_bytes": piece, "stages": stages, "stage_bytes": stage_bytes,
                             "lane_per_row": bool(lanes), "tb_per_s": tbs})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows_out, indent=1))
    print(f"{'row B':>6} {'copy B':>7} {'stages':>6} {'stage B':>7} {'lanes':>5} {'TB/s':>6}")
    for r in rows_out:
        print(f"{r['row_bytes']:6d} {r['copy_bytes']:7d} {r['stages']:6d} {r['stage_bytes']:7d} "
              f"{'row' if r['lane_per_row'] else 'one':>5} {r['tb_per_s']:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
