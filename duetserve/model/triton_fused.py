"""Triton kernels for the decoder's token-level ops: add+RMSNorm, q/k-norm+RoPE (optionally storing
the new K/V into the paged cache), SiLU-and-mul.

Each replaces a chain of small torch kernels by one launch (the torch references, and the
dispatch between the two, are in ``duetserve.model.fused_ops``). Arithmetic is float32 inside a
kernel; results are rounded to the input dtype where the Hugging Face code rounds (after the
normalisation, before the norm weight; cos/sin to the input dtype; SiLU before the product),
so bf16 results stay within one rounding of transformers' at each step.

No kernel takes the number of tokens as an argument (it is only the grid), so one compiled
kernel serves every batch size, and all of them can be captured in a CUDA graph once warm.

While CUDA graphs are recorded (``layers.graph_kernels_enabled``), on Hopper the kernels are
launched with programmatic dependent launch, like ``triton_gemm``'s: each may start while the
previous kernel drains, waits for it (``griddepcontrol.wait``) before any global memory access,
then lets the next kernel launch.

On a machine without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``
set before this module is imported).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from duetserve.model.layers import graph_kernels_enabled
from duetserve.model.triton_gemm import pdl_supported

_SILU_BLOCK = 1024  # intermediate columns per SiLU-and-mul program
_ROPE_TILE = 512  # elements (heads x half head size) per RoPE program and half


def _warps(elements: int) -> int:
    """Warps for a program of ``elements`` values: about 8 values a thread, 1 to 8 warps."""
    return max(1, min(8, elements // 256))


def _pdl(x: torch.Tensor) -> bool:
    """Whether kernels on ``x`` are launched with programmatic dependent launch (module docstring)."""
    return graph_kernels_enabled() and pdl_supported(x)


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """With ``PDL``: wait for the previous kernel to finish, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row: ``s = x (+ residual)`` in the input dtype, then ``w * (s * rsqrt(mean(s^2) + eps))``."""
    _pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, 0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * (x32 * inv).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add and RMSNorm over the last dim (see ``fused_ops.rms_norm``).

    Args:
        x: ``[T, N]`` (last dim contiguous), float32/float16/bfloat16.
        weight: ``[N]``.
        residual: ``[T, N]`` in x's dtype, or None.

    Returns:
        ``(normed, new_residual)``: normed ``[T, N]`` in the promoted dtype of weight and x;
        new_residual ``x + residual`` in x's dtype (a new tensor), or ``x`` itself without residual.
    """
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    block = triton.next_power_of_2(n)
    pdl = _pdl(x)
    _rms_norm_kernel[(x.shape[0],)](x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0),
                                    res_out.stride(0), n, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
                                    PDL=pdl, num_warps=_warps(block), launch_pdl=pdl)
    return out, res_out


@triton.jit
def _rope_heads(src, stride_h, dst, dst_stride_h, w_ptr, heads, h0, cos, sin, offs_d, d_ok, eps,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr):
    """Heads ``h0..h0+BLOCK_H-1`` of one token row: optional per-head RMSNorm, then rotate-half RoPE.

    ``src``/``dst`` point at the token's row, heads ``stride_h``/``dst_stride_h`` apart, each
    head ``2 * HALF`` contiguous values; ``cos``/``sin`` are ``[BLOCK_D]`` float32.
    """
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask = (offs_h < heads)[:, None] & d_ok[None, :]
    ptr = src + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        inv = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        a = (w1 * (a * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        b = (w2 * (b * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out = dst + offs_h[:, None] * dst_stride_h + offs_d[None, :]
    tl.store(out, (a * cos[None, :] - b * sin[None, :]).to(dtype), mask=mask)
    tl.store(out + HALF, (b * cos[None, :] + a * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _copy_heads(src, stride_h, dst, dst_stride_h, heads, h0, offs_d, d_ok, HALF: tl.constexpr,
                BLOCK_H: tl.constexpr):
    """Copy heads ``h0..h0+BLOCK_H-1`` of one token row as they are (V into the cache)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask = (offs_h < heads)[:, None] & d_ok[None, :]
    ptr = src + offs_h[:, None] * stride_h + offs_d[None, :]
    out = dst + offs_h[:, None] * dst_stride_h + offs_d[None, :]
    tl.store(out, tl.load(ptr, mask=mask), mask=mask)
    tl.store(out + HALF, tl.load(ptr + HALF, mask=mask), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, q_out, k_out, v_out, slot_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_cos,
                 num_q_heads, num_kv_heads, eps, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                 NORM: tl.constexpr, CACHE: tl.constexpr, PDL: tl.constexpr):
    """Program ``(t, tile)``: a tile of ``BLOCK_H`` query heads, or (tiles past the queries') key heads.

    Rotated keys go to row ``t`` of ``k_out``, or with ``CACHE`` to row ``slot_mapping[t]`` of the
    paged cache ``k_out``, where the same program also copies the token's values into ``v_out``
    (both caches ``stride_ot``/``stride_oh`` per slot/head).
    """
    _pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dtype = q_out.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(dtype).to(tl.float32)
    q_tiles = tl.cdiv(num_q_heads, BLOCK_H)
    if tile < q_tiles:
        _rope_heads(q_ptr + t * stride_qt, stride_qh, q_out + t * num_q_heads * 2 * HALF, 2 * HALF, qw_ptr,
                    num_q_heads, tile * BLOCK_H, cos, sin, offs_d, d_ok, eps, HALF, BLOCK_H, NORM)
    else:
        h0 = (tile - q_tiles) * BLOCK_H
        row = t
        if CACHE:
            row = tl.load(slot_ptr + t).to(tl.int64)
            _copy_heads(v_ptr + t * stride_vt, stride_vh, v_out + row * stride_ot, stride_oh, num_kv_heads, h0,
                        offs_d, d_ok, HALF, BLOCK_H)
        _rope_heads(k_ptr + t * stride_kt, stride_kh, k_out + row * stride_ot, stride_oh, kw_ptr, num_kv_heads, h0,
                    cos, sin, offs_d, d_ok, eps, HALF, BLOCK_H, NORM)


def _launch_rope(positions, q, k, cos, sin, q_weight, k_weight, eps, k_out, v=None, v_out=None,
                 slot_mapping=None) -> torch.Tensor:
    """Launch ``_rope_kernel``; ``k_out`` ``[rows, Hkv, D]``; ``v`` given: cache mode. Returns the new q."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    half = d // 2
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(hq, hkv)), _ROPE_TILE // block_d))
    grid = (t, triton.cdiv(hq, block_h) + triton.cdiv(hkv, block_h))
    norm, cache = q_weight is not None, v is not None
    v, v_out, slot_mapping = (v, v_out, slot_mapping) if cache else (k, k_out, positions)
    pdl = _pdl(q)
    _rope_kernel[grid](q, k, v, q_out, k_out, v_out, slot_mapping, positions, cos, sin,
                       q_weight if norm else q, k_weight if norm else k, q.stride(0), q.stride(1), k.stride(0),
                       k.stride(1), v.stride(0), v.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0), hq,
                       hkv, eps, HALF=half, BLOCK_D=block_d, BLOCK_H=block_h, NORM=norm, CACHE=cache, PDL=pdl,
                       num_warps=_warps(block_h * block_d), launch_pdl=pdl)
    return q_out


def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
               eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm of q and k, then rotate-half RoPE, in one launch (see ``fused_ops.apply_rope``).

    Args:
        positions: ``[T]`` integer positions.
        q: ``[T, Hq, D]``, k: ``[T, Hkv, D]`` (same dtype; last dim contiguous, other strides free,
            e.g. column slices of a fused QKV projection).
        cos, sin: ``[P, D/2]`` float32 tables.
        q_weight, k_weight: ``[D]`` norm weights in q's dtype, both or neither.

    Returns:
        New contiguous ``(q, k)`` in q's dtype.
    """
    k_out = torch.empty(k.shape, dtype=q.dtype, device=q.device)
    return _launch_rope(positions, q, k, cos, sin, q_weight, k_weight, eps, k_out), k_out


def apply_rope_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                         k_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """``apply_rope``, with the rotated k and the unrotated v stored straight into the paged caches at
    ``slot_mapping`` (what ``attention.write_kv`` does), all in one launch (see ``fused_ops.apply_rope_and_cache``).

    Args:
        positions, q, k, cos, sin, q_weight, k_weight, eps: as in ``apply_rope``.
        v: ``[T, Hkv, D]`` in q's dtype, last dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` in q's dtype, the same strides, each
            slot's ``Hkv * D`` values viewable as one row (``write_kv``'s ``view(-1, Hkv, D)``).
        slot_mapping: ``[T]`` int64 cache slots (block * block_size + offset); rows may share a
            slot (padding rows on a scratch slot: one of them wins).

    Returns:
        The new contiguous q ``[T, Hq, D]``. No host synchronisation: CUDA-graph capturable.

    Raises:
        ValueError: the caches differ in shape, strides or dtype from each other or from q.
    """
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or \
            not q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError("k_cache and v_cache must share shape and strides, and q, k, v and the caches a dtype")
    rows = k_cache.shape[-2:]
    return _launch_rope(positions, q, k, cos, sin, q_weight, k_weight, eps, k_cache.view(-1, *rows), v,
                        v_cache.view(-1, *rows), slot_mapping)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program ``(t, j)``: ``silu(gate) * up`` for columns ``j*BLOCK..`` of token ``t``, silu rounded first."""
    _pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + n + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :n]) * x[:, n:]`` ``[T, n]`` from ``x`` ``[T, 2n]`` (last dim contiguous), one launch."""
    n = x.shape[-1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    grid = (x.shape[0], triton.cdiv(n, _SILU_BLOCK))
    pdl = _pdl(x)
    _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), n, BLOCK=_SILU_BLOCK, PDL=pdl, num_warps=4,
                               launch_pdl=pdl)
    return out
