"""Skinny Triton GEMM for decode: ``y = x @ w^T (+ bias)`` for at most ``MAX_M`` rows.

At decode batch sizes a linear layer is a read of its weight: ``x`` is a few rows, ``w`` is
``[N, K]`` and tens of MB. Each program owns ``BLOCK_N`` output columns over the whole of
``K`` and streams their weight rows in ``[BLOCK_N, BLOCK_K]`` tiles (pipelined ``num_stages``
deep), multiplying each by the matching ``[BLOCK_M, BLOCK_K]`` slice of ``x`` on the tensor
cores as ``w_tile @ x_tile^T`` (the weight rows fill the MMA's long side; ``BLOCK_M`` is ``M``
rounded up to a power of two, at least 16).

K is not split across programs. A split would need its partial sums combined without an extra
kernel: atomics are nondeterministic; a "last program of a tile reduces" counter must start at
zero, so it costs a memset node (which also breaks the dependent-launch chain below) or lives
in a persistent buffer that resets itself, which two streams running the same layer at once
(prefill beside decode) would corrupt. Instead ``BLOCK_N`` stays small (16-64) so that the
grid, ``cdiv(N, BLOCK_N)`` programs, keeps every SM busy: for Qwen3-8B's shapes 128-1536
programs on 132 SMs, several resident per SM.

SwiGLU prologue (``swiglu=True``): ``x`` is the gate/up projection's output ``[M, 2K]`` and the
kernel multiplies ``silu(gate) * up`` as it loads it, rounded like ``fused_ops.silu_and_mul``
(SiLU to the input dtype, then the product), so the down projection needs no activation kernel.

Programmatic dependent launch (PDL): on compute capability >= 9 the kernel is launched with
``launch_pdl=True`` and may start while the previous kernel drains. It loads its first
``HEAD_K`` weight columns (weights are never written during a forward) before
``griddepcontrol.wait``, and touches nothing else (not ``x``, not ``y``: the caching allocator
may hand ``y`` memory the previous kernel still reads) before the wait. It then lets the next
kernel launch at once (``launch_dependents``); that kernel waits in turn for this one to finish.

``M`` only shapes the grid's ``BLOCK_M`` bucket (16, 32 or 64) and is not specialised on, so one
compiled kernel per bucket serves every batch size; no host synchronisation, the grid depends
on shapes only: CUDA-graph capturable. On a machine without a GPU the kernel runs under Triton's
interpreter (``TRITON_INTERPRET=1`` set before this module is imported), without PDL.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MAX_M = 64  # most rows (tokens) one call takes; decode batches above it go to cuBLAS
_SMEM_BUDGET = 160 << 10  # bytes of pipelined tiles per program (Hopper: 227 KiB a block)
DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch parameters of ``decode_gemm`` (powers of two; ``head_k`` a multiple of 16)."""

    block_n: int = 32  # output columns (weight rows) per program
    block_k: int = 256  # reduction columns per pipelined tile
    head_k: int = 256  # weight columns loaded before the PDL wait
    num_warps: int = 4
    num_stages: int = 4


def default_config(n: int, k: int, m: int, swiglu: bool) -> GemmConfig:
    """Tiles for ``m`` rows times a ``[n, k]`` weight: 32 columns a program (64 for very wide layers
    such as gate_up and lm_head, whose grids have many waves either way), 256-column tiles (128 for
    the SwiGLU prologue over 32 or more rows, to bound its registers), and as many pipeline stages
    (2 to 4) as fit in ``_SMEM_BUDGET`` bytes of shared memory."""
    block_n, block_m = (64 if n > 16384 else 32), _block_m(m)
    block_k = 128 if swiglu and block_m >= 32 else 256
    stage = (block_n + block_m * (2 if swiglu else 1)) * block_k * 2  # weight and x tiles, 16-bit
    return GemmConfig(block_n, block_k, head_k=block_k, num_stages=max(2, min(4, _SMEM_BUDGET // stage)))


def _block_m(m: int) -> int:
    """The ``BLOCK_M`` bucket of ``m`` rows: 16, 32 or 64."""
    return max(16, triton.next_power_of_2(m))


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def pdl_supported(x: torch.Tensor) -> bool:
    """Whether kernels on ``x``'s device can use programmatic dependent launch: a CUDA tensor on
    compute capability >= 9 (Hopper), and Triton not interpreting."""
    return x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" and _capability(x.device)[0] >= 9


@triton.jit
def _load_x(x_ptr, stride_xm, offs_m, m_ok, offs_k, k, SWIGLU: tl.constexpr):
    """The ``[BLOCK_M, BLOCK_K]`` slice of the GEMM's left operand at columns ``offs_k``."""
    mask = m_ok[:, None] & (offs_k < k)[None, :]
    ptr = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    x = tl.load(ptr, mask=mask, other=0.0)
    if SWIGLU:
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
        up = tl.load(ptr + k, mask=mask, other=0.0)
        x = (act * up.to(tl.float32)).to(x.dtype)
    return x


@triton.jit(do_not_specialize=["m"])
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_K: tl.constexpr):
    """Program ``p``: ``y[:, p*BLOCK_N ..] = x @ w[p*BLOCK_N .., :]^T``, accumulated in float32."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < m
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    offs_h = tl.arange(0, HEAD_K)
    w_head = tl.load(w_rows + offs_h[None, :], mask=n_ok[:, None] & (offs_h < k)[None, :], other=0.0)
    if PDL:
        gdc_wait()  # everything above reads weights only
        gdc_launch_dependents()
    acc = tl.dot(w_head, tl.trans(_load_x(x_ptr, stride_xm, offs_m, m_ok, offs_h, k, SWIGLU)))
    for k0 in range(HEAD_K, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < k)[None, :], other=0.0)
        acc += tl.dot(w, tl.trans(_load_x(x_ptr, stride_xm, offs_m, m_ok, offs_k, k, SWIGLU)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def decode_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False,
                config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` for a decode batch, one launch (see the module docstring).

    Args:
        x: ``[M, K]`` (``[M, 2K]``, gate then up, with ``swiglu``), ``1 <= M <= MAX_M``, bfloat16 or
            float16, last dim contiguous (row stride free).
        weight: ``[N, K]`` in x's dtype, last dim contiguous.
        bias: ``[N]`` in x's dtype, or None.
        swiglu: multiply ``silu(x[:, :K]) * x[:, K:]`` (SwiGLU's activation) instead of ``x``.
        config: tiles and launch parameters (default ``default_config(M, N, K, swiglu)``).

    Returns:
        ``y`` ``[M, N]`` in x's dtype (float32 accumulation; one rounding at the end, after the bias).

    Raises:
        ValueError: shapes, dtypes, devices or strides other than the above.
    """
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if x.shape[1] != (2 * k if swiglu else k):
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} (swiglu={swiglu})")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"decode_gemm takes 1 to {MAX_M} rows, got {m}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share a dtype among {DTYPES}, got {x.dtype}, {weight.dtype}"
                         f"{'' if bias is None else ', ' + str(bias.dtype)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, weight and bias must be on one device")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    cfg = config or default_config(n, k, m, swiglu)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pdl = pdl_supported(x)
    _gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SWIGLU=swiglu, PDL=pdl, BLOCK_M=_block_m(m),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HEAD_K=cfg.head_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=pdl)
    return y
