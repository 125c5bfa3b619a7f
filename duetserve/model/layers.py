"""Building blocks of the decoder: RMSNorm, rotary position embedding, merged linear layers, SwiGLU MLP.

The arithmetic lives in ``duetserve.model.fused_ops`` (fused Triton kernels on CUDA, torch
elsewhere); these modules hold the weights and tables.
"""
from __future__ import annotations

import torch
from torch import nn

from duetserve.model.fused_ops import apply_rope_and_cache, rms_norm, silu_and_mul


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


class MergedLinear(nn.Linear):
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
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
