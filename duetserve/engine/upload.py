"""Host-to-device uploads of small per-step inputs without a host sync."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(segments: list[Sequence[int | float] | np.ndarray], dtype: torch.dtype,
           device: torch.device) -> list[torch.Tensor]:
    """``segments`` (lists or 1-D numpy arrays) as 1-D tensors of ``dtype`` on ``device``
    through one copy.

    The segments are written into one host buffer (numpy slice assignment, no per-element
    Python loop for arrays). On CUDA that buffer is pinned and copied with
    ``non_blocking=True``: the copy is queued on the current stream and the host does not wait
    (a pageable source would make PyTorch synchronise the stream). Each segment starts
    64-byte aligned, so Triton, which specialises kernels on pointer alignment, never compiles
    a variant for an offset. ``dtype`` must have a numpy equivalent (integers, float32).

    Raises:
        OverflowError: a value does not fit ``dtype``.

    Returns:
        one tensor per segment, views of one buffer (empty segments give empty views).
    """
    align = 64 // torch.empty((), dtype=dtype).element_size()  # elements in 64 bytes
    bounds, total = [], 0
    for seg in segments:
        bounds.append((total, total + len(seg)))
        total += len(seg) + (-len(seg) % align)
    host = torch.empty(total, dtype=dtype, pin_memory=device.type == "cuda")
    view = host.numpy()
    for (a, b), seg in zip(bounds, segments):
        if b > a:
            if isinstance(seg, np.ndarray) and seg.dtype.itemsize > view.itemsize and view.dtype.kind in "iu":
                info = np.iinfo(view.dtype)  # numpy would wrap silently where a list raises
                if seg.min() < info.min or seg.max() > info.max:
                    raise OverflowError(f"segment values [{seg.min()}, {seg.max()}] do not fit {dtype}")
            view[a:b] = seg
    packed = host.to(device, non_blocking=True) if device.type == "cuda" else host
    return [packed[a:b] for a, b in bounds]
