"""Skinny Triton GEMM for decode: ``y = x @ w^T (+ bias)`` for at most ``MAX_M`` rows.

At decode batch sizes a linear layer is a read of its weight: ``x`` is a few rows, ``w`` is
``[N, K]`` and tens of MB. Each program owns ``BLOCK_N`` output columns over the whole of
``K`` and streams their weight rows in ``[BLOCK_N, BLOCK_K]`` tiles (pipelined ``num_stages``
deep), multiplying each by the matching ``[BLOCK_K, BLOCK_M]`` slice of ``x^T`` on the tensor
cores as ``w_tile @ x_tile^T`` (the weight rows fill the MMA's long side; ``BLOCK_M`` is 16,
the MMA's smallest, with the rows past ``M`` masked).

K is not split across programs. A split would need its partial sums combined without an extra
kernel: atomics are nondeterministic; a "last program of a tile reduces" counter must start at
zero, so it costs a memset node (which also breaks the dependent-launch chain below) or lives
in a persistent buffer that resets itself, which two streams running the same layer at once
(prefill beside decode) would corrupt. Instead a program reads 32-64 weight rows, so that the
grid keeps every SM busy: for Qwen3-8B's layers 128-384 programs on 132 SMs (lm_head 2374).

Which layers use it (``layers.use_decode_gemm``): weights of at most ``MAX_N`` rows. Measured
on the H200 (sixth session, 36 Qwen3-8B layers without attention in one CUDA graph, weight-read
floor 3.32 ms, two runs): the Triton GEMM on qkv, o and down with cuBLAS on the merged gate/up
projection (24576 rows) took 3.93-4.00 ms at M = 1 and 4.14-4.20 at M = 8, against 4.31-4.39 and
4.49-4.54 with cuBLAS everywhere. gate/up on Triton too changed that by -0.08 to +0.02 ms (with
32-row tiles, not the 64 ``WIDE_N`` gives it; with SwiGLU fused into its epilogue it lost the
whole gain), and lm_head (151936 rows) was once faster and once slower on Triton (303 against
290 us, 289 against 301, at M = 8): both stay on cuBLAS.

Programmatic dependent launch (PDL): on compute capability >= 9 the kernel is launched with
``launch_pdl=True`` and may start while the previous kernel drains. It loads its first
``HEAD_K`` weight columns (weights are never written during a forward) before
``griddepcontrol.wait``, and touches nothing else (not ``x``, not ``y``: the caching allocator
may hand ``y`` memory the previous kernel still reads) before the wait. It then lets the next
kernel launch at once (``launch_dependents``); that kernel waits in turn for this one to finish.

``M`` is not specialised on, so one compiled kernel per (tiles, bias) serves every batch
size; no host synchronisation, the grid depends on shapes only: CUDA-graph capturable. On a
machine without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1`` set
before this module is imported), without PDL.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Most rows (tokens) one call takes; larger batches go to cuBLAS. Measured on the H200 (fifth
# session, Qwen3-8B shapes in CUDA graphs): at M = 8 the first attempt matched or beat cuBLAS on
# qkv, o and gate_up, at M = 32-64 cuBLAS won on every shape (o 12.0 against 14.5 us, gate_up 51.8
# against 57.8 at M = 64).
MAX_M = 16
# Widest weight (output columns) ``layers.use_decode_gemm`` sends here; wider ones go to cuBLAS
# (see the module docstring for the measurement).
MAX_N = 16384
WIDE_N = 16384  # weights wider than this get 64-row tiles (default_config)
BLOCK_M = 16  # x rows per MMA tile: M padded up to it (the tensor cores' smallest N)
_SMEM_BUDGET = 160 << 10  # bytes of pipelined tiles per program (Hopper: 227 KiB a block)
DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch parameters of ``decode_gemm`` (powers of two; ``head_k`` a multiple of 16)."""

    block_n: int = 32  # output columns per program
    block_k: int = 256  # reduction columns per pipelined tile
    head_k: int = 256  # weight columns loaded before the PDL wait
    num_warps: int = 4
    num_stages: int = 4


def default_config(n: int, k: int) -> GemmConfig:
    """Tiles for a ``[n, k]`` weight: 32 weight rows a program (64 for layers wider than ``WIDE_N``,
    such as gate_up and lm_head, whose grids have many waves either way);
    256-column tiles and as many pipeline stages (2 to 4) as fit in ``_SMEM_BUDGET``
    beside the head tile (the weight columns loaded before the PDL wait, staged in shared
    memory too: with lm_head's 64 x 256 head the kernel took 204,800 bytes in all, as triton 3.9
    compiled it ahead for sm_90 on a CPU; not yet read on the GPU's triton 3.6)."""
    rows, block_k = (64 if n > WIDE_N else 32), 256
    stage = (rows + BLOCK_M) * block_k * 2  # weight and x tiles, 16-bit
    head = rows * block_k * 2
    return GemmConfig(rows, block_k, head_k=block_k, num_stages=max(2, min(4, (_SMEM_BUDGET - head) // stage)))


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def pdl_supported(x: torch.Tensor) -> bool:
    """Whether kernels on ``x``'s device can use programmatic dependent launch: a CUDA tensor on
    compute capability >= 9 (Hopper), and Triton not interpreting."""
    return x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" and _capability(x.device)[0] >= 9


def accesses_before_wait(ptx: str) -> dict[str, int | bool]:
    """What a compiled kernel's PTX does to global memory before ``griddepcontrol.wait``: whether
    the wait is there, and how many global loads and stores/atomics precede it (PDL safety: loads
    of weights only, no store; the GPU test and ``scripts/bench_decode_gemm.py`` check it)."""
    head, wait, _ = ptx.partition("griddepcontrol.wait")
    return {"wait": bool(wait), "loads": head.count("ld.global"),
            "stores": sum(head.count(op) for op in ("st.global", "atom.global", "red.global"))}


@triton.jit
def _load_w(rows, offs_k, n_ok, k):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile of row pointers ``rows`` at columns ``offs_k``."""
    return tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < k)[None, :], other=0.0)


@triton.jit
def _load_xt(x_ptr, stride_xm, offs_m, m_ok, offs_k, k):
    """``x[:, offs_k]^T``: the ``[BLOCK_K, BLOCK_M]`` right operand (rows past ``m`` zero)."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & (offs_k < k)[None, :],
                other=0.0)
    return tl.trans(x)


@triton.jit(do_not_specialize=["m"])
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, HEAD_K: tl.constexpr):
    """Program ``p``, columns ``c = p*BLOCK_N ..`` of ``n``: ``y[:, c] = x @ w[c, :]^T (+ b[c])``, float32
    accumulation."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < m
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    offs_h = tl.arange(0, HEAD_K)
    w_head = _load_w(w_rows, offs_h, n_ok, k)
    if PDL:
        gdc_wait()  # everything above reads weights only
        gdc_launch_dependents()
    x_head = _load_xt(x_ptr, stride_xm, offs_m, m_ok, offs_h, k)
    acc = tl.dot(w_head, x_head)
    for k0 in range(HEAD_K, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        acc += tl.dot(_load_w(w_rows, offs_k, n_ok, k), _load_xt(x_ptr, stride_xm, offs_m, m_ok, offs_k, k))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def decode_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` for a decode batch, one launch (see the module docstring).

    Args:
        x: ``[M, K]``, ``1 <= M <= MAX_M``, bfloat16 or float16, last dim contiguous (row stride free).
        weight: ``[N, K]`` in x's dtype, last dim contiguous.
        bias: ``[N]`` in x's dtype, or None.
        config: tiles and launch parameters (default ``default_config(N, K)``).

    Returns:
        ``[M, N]`` in x's dtype: float32 accumulation, rounded once after the bias.

    Raises:
        ValueError: shapes, dtypes, devices or strides other than the above.
    """
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
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
    cfg = config or default_config(n, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pdl = pdl_supported(x)
    _gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, PDL=pdl, BLOCK_M=BLOCK_M,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HEAD_K=cfg.head_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=pdl)
    return y
