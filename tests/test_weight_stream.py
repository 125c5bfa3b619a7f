"""scripts/bench_weight_stream.py, bench_decode_stream.py and bench_bulk_copy.py: the stream weight layout (CPU) and their exit
without CUDA (the decode stream's parameter block: tests/test_decode_stream.py)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CUDA

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT = SCRIPTS / "bench_weight_stream.py"
DECODE_SCRIPT = SCRIPTS / "bench_decode_stream.py"
COPY_SCRIPT = SCRIPTS / "bench_bulk_copy.py"


def _script(path: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_warp_slice_order_gives_each_lane_16_contiguous_columns():
    order = _script().warp_slice_order()
    assert sorted(order.tolist()) == list(range(64))
    assert order[:10].tolist() == [0, 1, 16, 17, 32, 33, 48, 49, 2, 3]
    for q in range(4):  # lane % 4: B fragment elements kappa = 2q, 2q+1 (b0) and 2q+8, 2q+9 (b1)
        for ks in range(4):
            cols = [order[ks * 16 + kappa].item() for kappa in (2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9)]
            assert cols == [16 * q + 4 * ks + j for j in range(4)]


def test_stream_layout_places_every_element_by_hand():
    s = _script()
    w = torch.arange(32 * 8192, dtype=torch.float32).view(1, 32, 8192)
    t = s.stream_layout(w).view(1, 2, 2, 8, 16, 512)  # [L, part, group, chunk, row, column]
    order = s.warp_slice_order()
    for part, group, chunk, row, pos in [(1, 1, 3, 5, 2 * 8 + 4), (0, 0, 0, 0, 0), (0, 1, 7, 15, 511), (1, 0, 2, 9, 300)]:
        logical = pos // 8 ^ row % 8  # the 16-byte chunk stored at pos // 8 holds this logical one
        col_in_chunk = logical * 8 + pos % 8
        warp, within = divmod(col_in_chunk, 64)
        col = part * 4096 + chunk * 512 + warp * 64 + order[within].item()
        assert t[0, part, group, chunk, row, pos].item() == w[0, group * 16 + row, col].item()
    assert sorted(t.flatten().tolist()) == w.flatten().tolist()


def test_stream_layout_rejects_shapes_it_cannot_tile():
    s = _script()
    with pytest.raises(ValueError, match="K % 4096"):
        s.stream_layout(torch.zeros(1, 16, 1024))
    with pytest.raises(ValueError, match="N % 16"):
        s.stream_layout(torch.zeros(1, 8, 4096))


def test_interleave_gate_up_groups_eight_gate_then_eight_up_rows():
    gate = torch.arange(16 * 2).view(1, 16, 2)
    up = 100 + gate
    gu = _script().interleave_gate_up(gate, up)
    assert gu.shape == (1, 32, 2)
    assert gu[0, :8].equal(gate[0, :8]) and gu[0, 8:16].equal(up[0, :8])
    assert gu[0, 16:24].equal(gate[0, 8:]) and gu[0, 24:].equal(up[0, 8:])


@pytest.mark.skipif(CUDA, reason="checks the exit without CUDA")
@pytest.mark.parametrize("script", [SCRIPT, DECODE_SCRIPT, COPY_SCRIPT], ids=["weight_stream", "decode_stream", "bulk_copy"])
def test_exits_cleanly_without_cuda(tmp_path, script):
    out = tmp_path / "out.json"
    run = subprocess.run([sys.executable, str(script), "--out", str(out)], check=False, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr and "Traceback" not in run.stderr
    assert not out.exists()
