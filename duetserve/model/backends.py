"""Choosing an attention backend: the torch reference, the Triton paged kernels or flash-attn."""
from __future__ import annotations

import importlib
import logging
import os

import torch
import torch.nn.functional as F

from duetserve.config import ATTENTION_BACKENDS
from duetserve.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttention,
    write_kv,
)

log = logging.getLogger(__name__)

FLASH_PAGE_MULTIPLE = 256  # flash-attn 2 checks that a paged cache's block size is a multiple of this


class FlashAttnBackend:
    """flash-attn 2's ``flash_attn_varlen_func`` over the paged cache (``block_table``).

    One call covers the whole flattened batch: decodes are sequences of one query, and
    flash-attn aligns the causal mask to the end of each sequence's keys.

    Raises (constructor):
        ValueError: ``flash_attn`` does not import, or ``block_size`` is not a multiple of 256.
    """

    def __init__(self, block_size: int):
        if block_size % FLASH_PAGE_MULTIPLE:
            raise ValueError(f"--attention-backend flash needs --block-size a multiple of {FLASH_PAGE_MULTIPLE} "
                             f"(flash-attn's paged cache), got {block_size}")
        try:
            from flash_attn import flash_attn_varlen_func
        except Exception as exc:  # ImportError, or a broken build failing to load its extension
            raise ValueError(f"--attention-backend flash: flash_attn does not import ({exc})") from exc
        self._varlen = flash_attn_varlen_func

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` (written first) or None (already in the cache);
        returns ``[T, Hq, D]`` in q's dtype, copied into ``out`` when given."""
        if k is not None:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        cu_seqlens_k = F.pad(meta.context_lens.cumsum(0, dtype=torch.int32), (1, 0))
        o = self._varlen(q, k_cache, v_cache, meta.query_start_loc, cu_seqlens_k, max(meta.query_lens_cpu),
                            max(meta.context_lens_cpu), softmax_scale=scale, causal=True,
                            block_table=meta.block_tables)
        return o if out is None else out.copy_(o)


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # not installed, or installed but broken
        return False
    return True


def make_attention_backend(name: str, device: torch.device | str, block_size: int = 16) -> AttentionBackend:
    """The attention backend called ``name`` for ``device``.

    Args:
        name: ``torch`` (reference), ``triton`` (paged Triton kernels; CUDA, or the CPU with
            ``TRITON_INTERPRET=1``), ``flash`` (flash-attn 2, CUDA, block size a multiple of 256)
            or ``auto``: flash where it imports and fits, else triton on CUDA; torch on the CPU.
        device: where the model runs.
        block_size: tokens per KV-cache block.

    Raises:
        ValueError: unknown name, or the backend cannot run here (no CUDA, package missing).
    """
    device = torch.device(device)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            if block_size % FLASH_PAGE_MULTIPLE == 0 and _importable("flash_attn"):
                name = "flash"
            elif _importable("triton"):
                name = "triton"
        log.info("attention backend: %s", name)
    if name == "torch":
        return TorchAttention()
    if device.type != "cuda" and not (name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"):
        hint = " (it also runs on the CPU under TRITON_INTERPRET=1, slowly)" if name == "triton" else ""
        raise ValueError(f"--attention-backend {name} needs a CUDA device{hint}")
    if name == "flash":
        return FlashAttnBackend(block_size)
    try:
        from duetserve.model.triton_attention import TritonAttention
    except ImportError as exc:
        raise ValueError(f"--attention-backend triton: triton does not import ({exc})") from exc
    return TritonAttention()
