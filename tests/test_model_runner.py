"""ModelRunner's host-side input packing (no model needed)."""
from __future__ import annotations

import torch

from duetserve.engine.model_runner import ModelRunner


def test_upload_packs_segments_at_64_byte_offsets():
    runner = ModelRunner.__new__(ModelRunner)  # _upload uses only the device
    runner.device = torch.device("cpu")
    a, b, c, d = runner._upload([[1, 2, 3], [], [4, 5], list(range(9))], torch.int64)
    assert (a.tolist(), b.tolist(), c.tolist(), d.tolist()) == ([1, 2, 3], [], [4, 5], list(range(9)))
    assert [t.storage_offset() for t in (a, b, c, d)] == [0, 8, 8, 16]  # 8 int64 = 64 bytes
    x, y = runner._upload([[7] * 17, [1]], torch.int32)
    assert y.storage_offset() == 32 and y.tolist() == [1] and x.dtype == torch.int32
