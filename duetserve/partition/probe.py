"""A probe kernel that records the SM each of its blocks ran on (PTX ``%smid``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _smid_kernel(out_ptr, spin_iters):
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    # Stay resident for a while so that later blocks spread over every SM the stream may use.
    acc = smid.to(tl.float32)
    for _ in range(spin_iters):
        acc = acc * 0.999 + 1.0
    tl.store(out_ptr + tl.program_id(0), tl.where(acc > -1.0, smid, -1))


def sms_used(stream, num_blocks: int = 4096, spin_iters: int = 20000) -> set[int]:
    """Launch ``num_blocks`` probe blocks on ``stream``; return the set of SM ids they ran on."""
    out = torch.full((num_blocks,), -1, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(stream):
        _smid_kernel[(num_blocks,)](out, spin_iters, num_warps=1)
    stream.synchronize()
    return set(out.tolist())
