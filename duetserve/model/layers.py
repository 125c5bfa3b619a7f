"""Building blocks of the decoder: RMSNorm, rotary position embedding, linear layers, SwiGLU MLP.

The arithmetic lives in ``duetserve.model.fused_ops`` (fused Triton kernels on CUDA, torch
elsewhere); these modules hold the weights and tables.

While CUDA graphs are recorded (``graph_kernels``: the engine's decode graphs, warm-up and
capture), linear layers run the skinny Triton GEMM of ``duetserve.model.triton_gemm`` on
decode-sized inputs (at most ``triton_gemm.MAX_M`` rows, bfloat16/float16, on CUDA, or on a CPU
under ``TRITON_INTERPRET=1`` for tests) whose weight has at most ``triton_gemm.MAX_N`` rows (for
Qwen3-8B: qkv, o and down; the merged gate/up projection and lm_head stay on cuBLAS), and the
fused ops' Triton kernels are launched with programmatic dependent launch on Hopper. Both save
GPU time between kernels and cost host time at launch (on the lent H200's host a Triton GEMM
took 53 us to launch against 23 for cuBLAS), so they pay only in a graph, which launches them
once. Everything else, eager forward passes included, runs cuBLAS (``torch.nn.functional.linear``)
and plain launches. ``DUETSERVE_DECODE_GEMM=cublas`` keeps that in graphs too (the baseline of
``scripts/bench_engine.py``).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from duetserve.model.fused_ops import apply_rope_and_cache, rms_norm, silu_and_mul, triton_module

DECODE_GEMM_ENV = "DUETSERVE_DECODE_GEMM"


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32 like Hugging Face.

    ``forward(x, residual=None)`` returns ``(normed, x + residual)`` (see ``fused_ops.rms_norm``):
    ``x`` ``[..., dim]`` any float dtype; ``normed`` has its shape and dtype (the weight's dtype is the model's).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer) in the rotate-half layout.

    Frequencies come from the model config: ``rope_parameters`` (transformers >= 5) or
    ``rope_theta``/``rope_scaling``; scaled types (llama3, linear, yarn, ...) are computed by
    transformers' own ``ROPE_INIT_FUNCTIONS``. A cos/sin table covers ``max_positions``.
    """

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        params = dict(getattr(config, "rope_parameters", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq.float())
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> torch.Tensor:
        """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` by ``positions`` ``[T]`` (int64), after
        the per-head norms ``q_norm``/``k_norm`` when given (Qwen3), and store the rotated k and ``v``
        ``[T, Hkv, D]`` at ``slot_mapping`` ``[T]`` of ``kv_cache`` (each ``[blocks, block_size, Hkv, D]``),
        in one fused op. Returns the rotated q."""
        weights = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None else ()
        return apply_rope_and_cache(positions, q, k, v, self.cos, self.sin, *kv_cache, slot_mapping, *weights)


@functools.cache
def decode_gemm_mode() -> str:
    """``DUETSERVE_DECODE_GEMM``: ``triton`` (the default) or ``cublas`` (see the module docstring).

    Read once per process, on first use (``graph_kernels``, or the CLIs checking it at start);
    ``decode_gemm_mode.cache_clear()`` makes the next call read the environment again.

    Raises:
        ValueError: any other value.
    """
    mode = os.environ.get(DECODE_GEMM_ENV, "triton")
    if mode not in ("cublas", "triton"):
        raise ValueError(f"{DECODE_GEMM_ENV} must be cublas or triton, got {mode!r}")
    return mode


_recording = threading.local()  # .on: this thread is inside graph_kernels()


@contextlib.contextmanager
def graph_kernels() -> Iterator[None]:
    """Within: this thread's forward passes are being recorded into CUDA graphs (and warmed up for
    it), so ``graph_kernels_enabled`` holds, switch permitting (see the module docstring); other
    threads' passes are unaffected.

    Raises:
        ValueError: as ``decode_gemm_mode``.
    """
    decode_gemm_mode()
    outer, _recording.on = getattr(_recording, "on", False), True
    try:
        yield
    finally:
        _recording.on = outer


def graph_kernels_enabled() -> bool:
    """Whether the Triton decode GEMM and PDL launches are in use: inside ``graph_kernels`` (on this
    thread) with the switch ``triton``."""
    return getattr(_recording, "on", False) and decode_gemm_mode() == "triton"


def _gemm_kernels() -> ModuleType | None:
    """``duetserve.model.triton_gemm`` (``fused_ops.triton_module``: imported on first use, as it
    needs triton)."""
    return triton_module("duetserve.model.triton_gemm", "linear layers stay on cuBLAS")


def use_decode_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight^T`` runs the Triton decode GEMM: ``graph_kernels_enabled``, ``x`` is a
    decode batch (2-D, 1 to ``triton_gemm.MAX_M`` rows, bfloat16/float16 like ``weight``, both with a
    contiguous last dim) on CUDA, or on a CPU under ``TRITON_INTERPRET=1``, and ``weight`` has at most
    ``triton_gemm.MAX_N`` rows.

    Raises:
        ValueError: as ``decode_gemm_mode``.
    """
    if not graph_kernels_enabled() or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    gemm = _gemm_kernels()
    return (gemm is not None and x.dim() == 2 and 1 <= x.shape[0] <= gemm.MAX_M and weight.shape[0] <= gemm.MAX_N
            and x.dtype in gemm.DTYPES and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias``: the Triton decode GEMM where ``use_decode_gemm`` says so, else cuBLAS.

    Args:
        x: ``[..., K]`` float tensor.
        weight: ``[N, K]``; bias: ``[N]`` or None; both in x's dtype.

    Returns:
        ``[..., N]`` in x's dtype.
    """
    if use_decode_gemm(x, weight):
        return _gemm_kernels().decode_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` computed by ``linear``: cuBLAS, or the Triton decode GEMM (``DUETSERVE_DECODE_GEMM``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Linear layers over the same input run as one GEMM: their weight rows concatenated in order.

    Checkpoints keep the parts' Hugging Face names (``q_proj``/``k_proj``/``v_proj``,
    ``gate_proj``/``up_proj``); ``shard_views`` maps those names to row slices of the merged weight.

    Args:
        in_features: input size.
        parts: output size of each part, by its checkpoint name, in order.
        bias: whether the parts have biases.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)

    def shard_views(self, param: str) -> dict[str, torch.Tensor]:
        """Views ``[size_i, ...]`` of parameter ``param`` (``weight`` or ``bias``) by part name."""
        data, views, start = getattr(self, param).data, {}, 0
        for name, size in self.parts.items():
            views[name] = data[start:start + size]
            start += size
        return views


class SwiGLU(nn.Module):
    """Gated MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020), gate and up as one GEMM.

    ``x``: ``[T, hidden]``; ``gate_up_proj`` gives ``[T, 2 * intermediate]``.
    """

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate}, bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
