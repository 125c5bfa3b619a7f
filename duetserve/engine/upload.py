"""Host-to-device uploads of small per-step inputs without a host sync."""
from __future__ import annotations

import torch


def upload(segments: list[list[int | float]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """``segments`` as 1-D tensors of ``dtype`` on ``device`` through one copy.

    On CUDA the copy goes from pinned memory with ``non_blocking=True``: it is queued on the
    current stream and the host does not wait (a pageable source would make PyTorch
    synchronise the stream). Each segment starts 64-byte aligned, so Triton, which specialises
    kernels on pointer alignment, never compiles a variant for an offset.

    Returns:
        one tensor per segment, views of one buffer (empty segments give empty views).
    """
    align = 64 // torch.empty((), dtype=dtype).element_size()  # elements in 64 bytes
    flat: list[int | float] = []
    bounds = []
    for seg in segments:
        bounds.append((len(flat), len(flat) + len(seg)))
        flat.extend(seg)
        flat.extend([0] * (-len(flat) % align))
    if device.type == "cuda":
        packed = torch.tensor(flat, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    else:
        packed = torch.tensor(flat, dtype=dtype)
    return [packed[a:b] for a, b in bounds]
