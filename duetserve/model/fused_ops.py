"""The decoder's token-level ops, each one call: add+RMSNorm, q/k-norm+RoPE (+ KV-cache write), SiLU-and-mul.

Every function dispatches to a fused Triton kernel (``duetserve.model.triton_fused``) on CUDA
and to its torch reference elsewhere. ``DUETSERVE_FUSED`` overrides the choice: ``0`` always
runs torch, ``1`` always runs Triton (on a CPU only under ``TRITON_INTERPRET=1``, for tests),
``auto`` (the default) Triton on CUDA tensors when triton imports.

The torch references follow Hugging Face transformers' Llama/Qwen3 code (``LlamaRMSNorm``,
``apply_rotary_pos_emb``, ``LlamaMLP``): the norm in float32 with the result cast back to the
input dtype before the weight multiplies it, RoPE in the input dtype with cos/sin cast to it,
SiLU in the input dtype.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

import torch
import torch.nn.functional as F

from duetserve.model.attention import write_kv

log = logging.getLogger(__name__)

FUSED_ENV = "DUETSERVE_FUSED"


@functools.cache
def triton_module(name: str, instead: str) -> ModuleType | None:
    """Import the Triton kernel module ``name`` on first use, or None where triton does not import
    (logged once, saying what runs ``instead``)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        log.warning("%s unavailable (%s); %s", name, exc, instead)
        return None


def _kernels() -> ModuleType | None:
    """The fused ops' Triton kernels (``triton_module``)."""
    return triton_module("duetserve.model.triton_fused", "the fused ops run their torch references")


def fused_mode() -> str:
    """``DUETSERVE_FUSED``: ``auto`` (the default), ``0`` or ``1``; read on every call (tests switch it).

    Raises:
        ValueError: any other value.
    """
    mode = os.environ.get(FUSED_ENV, "auto")
    if mode not in ("0", "1", "auto"):
        raise ValueError(f"{FUSED_ENV} must be 0, 1 or auto, got {mode!r}")
    return mode


def use_triton(x: torch.Tensor) -> bool:
    """Whether the ops on ``x`` run as Triton kernels (see the module docstring).

    Raises:
        ValueError: as ``fused_mode``.
        RuntimeError: ``DUETSERVE_FUSED=1`` but triton does not import.
    """
    mode = fused_mode()
    if mode == "auto":
        return x.is_cuda and _kernels() is not None
    if mode == "1" and _kernels() is None:
        raise RuntimeError(f"{FUSED_ENV}=1 but triton does not import")
    return mode == "1"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019) of ``x + residual``, returning the sum as the next residual.

    The fused residual add of vLLM's decoder layers: ``h, res = rms_norm(x, w, eps, res)``
    replaces ``res = res + x; h = norm(res)``.

    Args:
        x: ``[..., N]`` float tensor (Triton path: 2-D ``[T, N]``, last dim contiguous).
        weight: ``[N]``.
        eps: added to the mean square.
        residual: tensor shaped and typed like ``x``, or None (no add).

    Returns:
        ``(normed, new_residual)``: ``weight * (s * rsqrt(mean(s^2) + eps)).to(x.dtype)`` with
        ``s = x + residual`` in float32, in the promoted dtype of weight and x; and ``s`` in x's dtype
        (``x`` itself when ``residual`` is None).
    """
    if use_triton(x):
        return _kernels().rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), x


def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
               eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021, RoFormer), rotate-half layout, after an optional
    per-head RMSNorm of q and k (Qwen3's ``q_norm``/``k_norm``); one Triton launch for all of it.

    Args:
        positions: ``[T]`` int64 positions, rows of the tables.
        q: ``[T, Hq, D]``, k: ``[T, Hkv, D]``, same float dtype (may be strided views of a fused QKV output).
        cos, sin: ``[P, D/2]`` float32 tables (``RotaryEmbedding``), ``P`` above every position.
        q_weight, k_weight: ``[D]`` norm weights, both or neither (then no norm).
        eps: the norms' epsilon.

    Returns:
        ``(q, k)`` rotated, shapes of the inputs, in q's dtype.
    """
    if use_triton(q):
        return _kernels().apply_rope(positions, q, k, cos, sin, q_weight, k_weight, eps)
    return _rope_reference(positions, q, k, cos, sin, q_weight, k_weight, eps)


def apply_rope_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                         k_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """``apply_rope``, then the rotated k and ``v`` stored at ``slot_mapping`` of the paged caches
    (``attention.write_kv``): one Triton launch instead of three kernels; torch: rope, then ``write_kv``.

    Args:
        positions, q, k, cos, sin, q_weight, k_weight, eps: as in ``apply_rope``.
        v: ``[T, Hkv, D]`` values (not rotated), q's dtype.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` paged caches in q's dtype, same strides.
        slot_mapping: ``[T]`` int64 slot (block * block_size + offset) of each token.

    Returns:
        The rotated q ``[T, Hq, D]`` in q's dtype (the keys live in the cache only).
    """
    if use_triton(q):
        return _kernels().apply_rope_and_cache(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                                               q_weight, k_weight, eps)
    q, k = _rope_reference(positions, q, k, cos, sin, q_weight, k_weight, eps)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def _rope_reference(positions, q, k, cos, sin, q_weight, k_weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of ``apply_rope``."""
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps)[0], rms_norm(k, k_weight, eps)[0]
    cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` ``[T, H, D]``, ``cos``/``sin`` ``[T, 1, D/2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer 2020): ``silu(gate) * up`` ``[T, n]`` from ``x = [gate | up]`` ``[T, 2n]``."""
    if use_triton(x):
        return _kernels().silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
