"""One decoder for the Llama family (Llama 2/3, SmolLM2) and Qwen3.

Parameter names follow Hugging Face (``model.layers.N.self_attn.o_proj.weight``, ...), except
that q/k/v and gate/up projections are merged into one GEMM each (``qkv_proj``, ``gate_up_proj``);
``CausalLM.checkpoint_tensors`` maps the checkpoint names onto them, so safetensors checkpoints
load by name. Qwen3 adds a per-head RMSNorm on queries and keys. Residual adds are fused into the
following norm (vLLM's layout): each layer takes and returns ``(hidden, residual)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from duetserve.model.attention import AttentionBackend, AttentionMetadata
from duetserve.model.layers import (
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "mistral")
# config.json sizes that must be integers >= 1
_POSITIVE_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                   "max_position_embeddings")


@dataclass(frozen=True)
class ModelDims:
    """Shapes read from a Hugging Face config (``config.json``)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def from_config(cls, config) -> ModelDims:
        """Read a transformers ``PretrainedConfig``.

        Raises:
            ValueError: the model type is not one of ``SUPPORTED_MODEL_TYPES``, or a size in
                ``_POSITIVE_SIZES`` is not an integer >= 1 ("config.json: KEY must be ...").
        """
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {config.model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        for key in _POSITIVE_SIZES:  # else torch fails building the layers, with a traceback
            value = getattr(config, key, None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.json: {key} must be an integer >= 1, got {value!r}")
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=config.model_type == "qwen3",
            attention_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )


class Attention(nn.Module):
    def __init__(self, dims: ModelDims, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        d, h, hkv, hd = dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, hd
        self.qkv_proj = MergedLinear(d, {"q_proj": h * hd, "k_proj": hkv * hd, "v_proj": hkv * hd},
                                     bias=dims.attention_bias)
        self.o_proj = Linear(h * hd, d, bias=dims.attention_bias)
        if dims.qk_norm:
            self.q_norm = RMSNorm(hd, dims.rms_norm_eps)
            self.k_norm = RMSNorm(hd, dims.rms_norm_eps)
        self.qk_norm = dims.qk_norm
        self.rotary = [rotary]  # shared; a list keeps it out of this module's parameters
        self.backend = backend
        self.scale = hd ** -0.5

    def queries(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                slot_mapping: torch.Tensor) -> torch.Tensor:
        """The QKV projection of ``x`` ``[T, hidden]`` at ``positions`` ``[T]`` (int64): K/V (q/k-normed and
        rotated) stored at ``slot_mapping`` ``[T]`` of ``kv_cache``; returns the rotated queries ``[T, Hq, D]``."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(list(self.qkv_proj.parts.values()), dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else ()
        return self.rotary[0](positions, q, k, v, kv_cache, slot_mapping, *norms)  # K/V land in the cache

    def attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The backend's attention of ``q`` ``[T, Hq, D]`` over ``kv_cache``, into ``out`` (same shape) when given."""
        return self.backend.forward(q, None, None, kv_cache[0], kv_cache[1], meta, self.scale, out=out)


class DecoderLayer(nn.Module):
    def __init__(self, dims: ModelDims, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.self_attn = Attention(dims, rotary, backend)
        self.mlp = SwiGLU(dims.hidden_size, dims.intermediate_size, dims.mlp_bias)
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)

    def forward(self, x, residual, positions, kv_cache, meta):
        """``x`` ``[T, hidden]``, the previous layer's output, and ``residual`` (None in layer 0): the
        stream before it. Returns this layer's ``(output, residual)``; the stream is their sum."""
        q, residual = self.pre_attention(x, residual, positions, kv_cache, meta.slot_mapping)
        return self.post_attention(self.self_attn.attend(q, kv_cache, meta), residual)

    def pre_attention(self, x, residual, positions, kv_cache, slot_mapping) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` up to attention (input norm, QKV, q/k norm, RoPE, the K/V store): ``(queries
        [T, Hq, D], residual [T, hidden])``. No attention metadata but ``slot_mapping`` ``[T]``."""
        h, residual = self.input_layernorm(x, residual)
        return self.self_attn.queries(h, positions, kv_cache, slot_mapping), residual

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` after attention: the output projection of ``o`` ``[T, Hq, D]``, the residual add and
        norm, the MLP; returns ``(output, residual)``, each ``[T, hidden]``."""
        h, residual = self.post_attention_layernorm(self.self_attn.o_proj(o.reshape(o.shape[0], -1)), residual)
        return self.mlp(h), residual


class _Body(nn.Module):
    def __init__(self, dims: ModelDims, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(dims, rotary, backend) for _ in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder-only causal LM over a flattened batch and a paged KV cache.

    Args:
        config: transformers config of the model.
        backend: attention backend (``duetserve.model.attention``).
        max_positions: longest position the RoPE table covers, tokens.
    """

    def __init__(self, config, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.dims = ModelDims.from_config(config)
        self.rotary = RotaryEmbedding(config, self.dims.head_dim, max_positions)
        self.model = _Body(self.dims, self.rotary, backend)
        self.lm_head = Linear(self.dims.hidden_size, self.dims.vocab_size, bias=False)
        if self.dims.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_backend(self) -> AttentionBackend:
        """The attention backend every layer shares."""
        return self.model.layers[0].self_attn.backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of ``input_ids`` ``[T]`` (int64) at ``positions`` ``[T]`` (int64)."""
        return self.final_norm(self.run_layers(None, input_ids, positions, kv_caches, meta, 0, self.dims.num_layers))

    def run_layers(self, state: tuple[torch.Tensor, torch.Tensor | None] | None, input_ids: torch.Tensor,
                   positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   meta: AttentionMetadata, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers ``start .. end - 1`` only (layer-split prefill, SGLang's pdmux).

        ``state`` is what the previous call returned (ignored when ``start == 0``, where the
        tokens are embedded): ``(output, residual)`` of layer ``start - 1``, each ``[T, hidden]``.
        """
        x, residual = (self.model.embed_tokens(input_ids), None) if start == 0 else state
        for layer, kv in zip(self.model.layers[start:end], kv_caches[start:end]):
            x, residual = layer(x, residual, positions, kv, meta)
        return x, residual

    def final_norm(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the last layer's ``(output, residual)``."""
        return self.model.norm(*state)[0]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a Hugging Face checkpoint fills, by its checkpoint name (views of the parameters).

        Parameters appear under their own names, merged projections as row slices under their
        parts' names (``...self_attn.q_proj.weight``, ``...mlp.up_proj.weight``); a tied
        ``lm_head.weight`` is left out (it is the embedding).
        """
        merged = {name: m for name, m in self.named_modules() if isinstance(m, MergedLinear)}
        tensors = {}
        for name, p in self.named_parameters():  # deduplicated: a tied lm_head is not listed
            module, _, param = name.rpartition(".")
            if module in merged:
                parent = module.rpartition(".")[0]
                tensors.update((f"{parent}.{part}.{param}", view)
                               for part, view in merged[module].shard_views(param).items())
            else:
                tensors[name] = p.data
        return tensors

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[n, vocab]`` in the model's dtype from hidden states ``[n, hidden]``. Not cast to
        float32: the samplers upcast what they read (a float32 copy of 128 rows took 59 us a step on
        the H200, docs/benchmarks.md, twenty-first session), and the argmax of bf16 values is the
        argmax of their float32 casts.

        ``out``: a contiguous ``[n, vocab]`` tensor in the model's dtype to write them into (cuBLAS,
        returned), e.g. the one logits buffer all decode CUDA graphs share (``DecodeGraphs``)."""
        if out is None:
            return self.lm_head(hidden)
        return torch.mm(hidden, self.lm_head.weight.t(), out=out)
