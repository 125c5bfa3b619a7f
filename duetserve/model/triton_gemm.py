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

Which layers use it (``layers.use_decode_gemm``): weights of at most ``MAX_N`` rows, for Qwen3-8B
every layer's qkv, o, gate_up and down (lm_head's 151936 rows stay on cuBLAS). Measured on the
H200 (sixth session, 36 Qwen3-8B layers without attention in one CUDA graph, weight-read floor
3.32 ms, two runs): the Triton GEMM on qkv, o and down with cuBLAS on the merged gate/up
projection (24576 rows) took 3.93-4.00 ms at M = 1 and 4.14-4.20 at M = 8, against 4.31-4.39 and
4.49-4.54 with cuBLAS everywhere. gate/up on Triton too changed that by -0.08 to +0.02 ms with
32-row tiles (64-row tiles were 0.1-0.2 ms slower, seventh session; with SwiGLU fused into its
epilogue it lost the whole gain). With every layer GEMM on Triton the decoder takes its two
RMSNorms into the qkv and gate_up GEMMs and its two residual adds into the o and down GEMMs
(``decode_gemm``'s ``norm_weight`` and ``residual``): two kernels a layer fewer.

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
MAX_N = 32768
WIDE_N = 32768  # weights wider than this (lm_head, in the benchmark) get 64-row tiles (default_config)
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
    """Tiles for a ``[n, k]`` weight: 32 weight rows a program (64 for weights wider than ``WIDE_N``,
    such as lm_head, whose grids have many waves either way);
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


@triton.jit
def _prologue(xt, g_ptr, offs_k, k, sumsq, NORM: tl.constexpr):
    """With ``NORM``: add the tile's squares to the per-row ``sumsq`` ``[BLOCK_M]`` and scale the
    ``[BLOCK_K, BLOCK_M]`` tile ``xt`` by the norm weight ``g[offs_k]`` (rounded back to x's dtype)."""
    if NORM:
        xf = xt.to(tl.float32)
        sumsq += tl.sum(xf * xf, 0)
        g = tl.load(g_ptr + offs_k, mask=offs_k < k, other=0.0).to(tl.float32)
        xt = (xf * g[:, None]).to(xt.dtype)
    return xt, sumsq


@triton.jit(do_not_specialize=["m"])
def _gemm_kernel(x_ptr, w_ptr, b_ptr, g_ptr, r_ptr, y_ptr, m, n, k, stride_xm, stride_wn, stride_rm, stride_ym, eps,
                 HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_K: tl.constexpr):
    """Program ``p``, columns ``c = p*BLOCK_N ..`` of ``n``: ``y[:, c] = x @ w[c, :]^T (+ b[c])``, float32
    accumulation; with ``NORM`` x is RMS-normalised on the way in (``decode_gemm``), with ``RESIDUAL``
    ``r[:, c]`` is added to the rounded product."""
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
    sumsq = tl.zeros([BLOCK_M], tl.float32)
    x_head, sumsq = _prologue(_load_xt(x_ptr, stride_xm, offs_m, m_ok, offs_h, k), g_ptr, offs_h, k, sumsq, NORM)
    acc = tl.dot(w_head, x_head)
    for k0 in range(HEAD_K, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt, sumsq = _prologue(_load_xt(x_ptr, stride_xm, offs_m, m_ok, offs_k, k), g_ptr, offs_k, k, sumsq, NORM)
        acc += tl.dot(_load_w(w_rows, offs_k, n_ok, k), xt)
    if NORM:
        acc *= tl.rsqrt(sumsq / k + eps)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out_ok = n_ok[:, None] & m_ok[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    if RESIDUAL:
        r = tl.load(r_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=out_ok, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], y, mask=out_ok)


def decode_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemmConfig | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """``norm(x) @ weight^T + bias (+ residual)`` for a decode batch, one launch (see the module docstring).

    With ``norm_weight`` the GEMM applies RMSNorm (Zhang & Sennrich 2019) to x's rows as it reads
    them: ``rmsnorm(x) @ w^T = rsqrt(mean(x^2) + eps) * ((x * g) @ w^T)``, the row scale factored
    out of the sum, so every program accumulates the squares of the row while it streams its
    weight rows and scales its results at the end: no pass over x before the GEMM, no norm kernel.
    The rounding differs from Hugging Face's norm, which rounds ``x * rsqrt(...)`` to x's dtype
    before the weight multiplies it; here ``x * g`` is rounded (one bf16 rounding of the MMA's
    operand either way). With ``residual`` the product is rounded to x's dtype and ``residual`` is
    added to it in float32, rounded again: the decoder's residual add (``residual + out`` in x's
    dtype, as transformers computes it) done by the GEMM's epilogue instead of the next norm.

    Args:
        x: ``[M, K]``, ``1 <= M <= MAX_M``, bfloat16 or float16, last dim contiguous (row stride free).
        weight: ``[N, K]`` in x's dtype, last dim contiguous.
        bias: ``[N]`` in x's dtype, or None.
        config: tiles and launch parameters (default ``default_config(N, K)``).
        norm_weight: ``[K]`` RMSNorm weight in x's dtype, or None (x as it is).
        eps: the norm's epsilon, added to the mean square.
        residual: ``[M, N]`` in x's dtype, last dim contiguous, or None.

    Returns:
        ``[M, N]`` in x's dtype: float32 accumulation, rounded once after the norm's scale and the
        bias, and once more after the residual add.

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
    extra = {"bias": (bias, (n,)), "norm_weight": (norm_weight, (k,)), "residual": (residual, (m, n))}
    given = {name: t for name, (t, _) in extra.items() if t is not None}
    if x.dtype not in DTYPES or weight.dtype != x.dtype or any(t.dtype != x.dtype for t in given.values()):
        raise ValueError(f"x, weight, bias, norm_weight and residual must share a dtype among {DTYPES}, got "
                         + ", ".join(f"{name} {t.dtype}" for name, t in {"x": x, "weight": weight, **given}.items()))
    for name, t in given.items():
        if t.shape != extra[name][1]:
            raise ValueError(f"{name} must be {list(extra[name][1])}, got {list(t.shape)}")
    if any(t.device != x.device for t in (weight, *given.values())):
        raise ValueError("x, weight, bias, norm_weight and residual must be on one device")
    if any(t.stride(-1) != 1 for t in (x, weight, *given.values())):
        raise ValueError("x, weight, bias, norm_weight and residual need a contiguous last dim")
    cfg = config or default_config(n, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pdl = pdl_supported(x)
    _gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, weight if bias is None else bias, weight if norm_weight is None else norm_weight,
        y if residual is None else residual, y, m, n, k, x.stride(0), weight.stride(0),
        0 if residual is None else residual.stride(0), y.stride(0), eps,
        HAS_BIAS=bias is not None, NORM=norm_weight is not None, RESIDUAL=residual is not None, PDL=pdl,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HEAD_K=cfg.head_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=pdl)
    return y
