"""Attention over a paged KV cache, behind a small backend interface.

The batch is flattened: decode tokens first (one per sequence), then prefill chunks. Each
layer's cache is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to.

    Attributes:
        slot_mapping: ``[T]`` int64, cache slot (block * block_size + offset) of each token.
        query_start_loc: ``[B + 1]`` int32, start of each sequence's tokens in the batch.
        context_lens: ``[B]`` int32, cached + new tokens of each sequence after this step.
        block_tables: ``[B, max_blocks]`` int32, KV blocks of each sequence (padded with 0).
        num_decodes: the first ``num_decodes`` sequences are decodes (one token each).
        query_lens_cpu / context_lens_cpu: the same lengths as Python lists (no device sync).
        split_counters: ``[>= num_decodes * num_kv_heads]`` int32 zeros, the Triton decode
            attention's split counters (``paged_decode_attention``'s ``counters``: zero again
            after each call, never shared by two calls that may run at once); None: allocated
            per call. Other backends ignore it.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    split_counters: torch.Tensor | None = None


class AttentionBackend(Protocol):
    """Writes the new K/V into the paged cache (unless the caller did) and computes causal attention."""

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """``q``: ``[T, Hq, D]``; ``k``/``v``: ``[T, Hkv, D]``, written at ``meta.slot_mapping`` first, or
        both None when they are already in the caches (the decoder stores them fused with RoPE).
        Returns ``[T, Hq, D]`` (q's dtype): ``out`` when given (shaped and typed like q), filled."""
        ...


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` ``[T, Hkv, D]`` at ``slot_mapping`` ``[T]`` of the paged caches."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TorchAttention:
    """Reference backend on ``scaled_dot_product_attention``; runs on CPU and GPU.

    Decodes are batched (keys gathered from their block tables, padded, masked); each prefill
    chunk runs on its own with a causal mask offset by its cached tokens.
    """

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out=None):
        if k is not None:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q) if out is None else out
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        start = nd
        for i in range(nd, len(meta.query_lens_cpu)):
            qlen, ctx = meta.query_lens_cpu[i], meta.context_lens_cpu[i]
            keys, values = _gather(k_cache, v_cache, meta.block_tables[i], ctx)
            out[start:start + qlen] = _attend(q[start:start + qlen], keys, values, ctx - qlen, scale)
            start += qlen
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd = meta.num_decodes
        max_ctx = max(meta.context_lens_cpu[:nd])
        block_size = k_cache.shape[1]
        nblocks = -(-max_ctx // block_size)
        tables = meta.block_tables[:nd, :nblocks]
        keys = k_cache[tables].flatten(1, 2)[:, :max_ctx]      # [nd, L, Hkv, D]
        values = v_cache[tables].flatten(1, 2)[:, :max_ctx]
        mask = torch.arange(max_ctx, device=q.device)[None, :] < meta.context_lens[:nd, None]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
        return o.squeeze(2)


def _gather(k_cache, v_cache, block_table: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[ctx, Hkv, D]`` of one sequence from its block table."""
    block_size = k_cache.shape[1]
    blocks = block_table[: -(-ctx // block_size)]
    return k_cache[blocks].flatten(0, 1)[:ctx], v_cache[blocks].flatten(0, 1)[:ctx]


def _attend(q, keys, values, num_cached: int, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` ``[n, Hq, D]`` at positions ``num_cached..`` over ``keys`` ``[ctx, Hkv, D]``."""
    n, ctx = q.shape[0], keys.shape[0]
    if num_cached == 0:
        mask, causal = None, True
    else:
        pos_q = torch.arange(num_cached, num_cached + n, device=q.device)
        mask, causal = torch.arange(ctx, device=q.device)[None, :] <= pos_q[:, None], False
    # 4-D (a batch of one): with 3-D inputs torch 2.13's CPU SDPA took its unfused path, 3.6-6x
    # slower (a 2048-token causal chunk of SmolLM2's 9/3 heads: 0.21 against 0.035 s)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
