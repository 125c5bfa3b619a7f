"""Turns a scheduled batch into tensors, runs the model and samples."""
from __future__ import annotations

import torch

from duetserve.engine.cuda_graphs import DecodeGraphs
from duetserve.engine.sampler import Sampler
from duetserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from duetserve.model.attention import AttentionMetadata
from duetserve.model.decoder import CausalLM


def allocate_kv_cache(model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    d = model.dims
    shape = (d.num_layers, 2, num_blocks, block_size, d.num_kv_heads, d.head_dim)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(d.num_layers)]


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    d = model.dims
    return 2 * d.num_layers * block_size * d.num_kv_heads * d.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    """Runs one iteration: builds input ids, positions, slot mapping and block tables.

    A plan with ``k > 1`` decode steps runs here as the prefill batch followed by ``k`` decode
    steps in order (the spatial executor overlaps them on a GPU; the tokens are the same).
    Decode-only batches replay CUDA graphs when ``graphs`` is given and a bucket holds them.
    """

    def __init__(self, model: CausalLM, kv_caches, block_size: int, device: torch.device, sampler: Sampler,
                 graphs: DecodeGraphs | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.graphs = graphs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """Run ``out`` and return the sampled tokens per seq_id (see ``Scheduler.postprocess``)."""
        if out.plan.k == 1:
            return self._forward(out.decodes + out.prefills, len(out.decodes))
        sampled = self._forward(out.prefills, 0) if out.prefills else {}
        steps = [ScheduledSeq(d.seq, 1, d.num_cached_tokens) for d in out.decodes]
        tokens: dict[int, list[int]] = {d.seq.seq_id: [] for d in out.decodes}
        for step in range(out.plan.k):
            feed = [tokens[s.seq.seq_id][-1] if step else None for s in steps]
            result = self._forward(steps, len(steps), feed)
            for s in steps:
                tokens[s.seq.seq_id] += result[s.seq.seq_id]
                s.num_cached_tokens += 1
        sampled.update(tokens)
        return sampled

    def _forward(self, batch: list[ScheduledSeq], num_decodes: int,
                 feed: list[int | None] | None = None) -> dict[int, list[int]]:
        bs = self.block_size
        ids, positions, slots, qlens, ctxs, sample_rows = [], [], [], [], [], []
        for i, s in enumerate(batch):
            c, q, table = s.num_cached_tokens, s.num_new_tokens, s.seq.block_table
            if feed is not None and feed[i] is not None:
                ids.append(feed[i])
            else:
                ids.extend(s.seq.token_ids[c:c + q])
            positions.extend(range(c, c + q))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + q))
            qlens.append(q)
            ctxs.append(c + q)
            if feed is not None or s.samples:
                sample_rows.append((len(ids) - 1, i))
        max_blocks = max(len(s.seq.block_table) for s in batch)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in batch]
        dev = self.device
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(ctxs, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            num_decodes=num_decodes, query_lens_cpu=qlens, context_lens_cpu=ctxs)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        if self.graphs is not None and num_decodes == len(batch) and self.graphs.bucket(num_decodes):
            logits = self.graphs.run(input_ids, positions_t, meta)
        else:
            hidden = self.model(input_ids, positions_t, self.kv_caches, meta)
            if not sample_rows:
                return {}
            rows = torch.tensor([r for r, _ in sample_rows], device=dev)
            logits = self.model.compute_logits(hidden[rows])
        seqs = [batch[i].seq for _, i in sample_rows]
        tokens = self.sampler(logits, [s.seq_id for s in seqs], [s.params for s in seqs])
        return {s.seq_id: [t] for s, t in zip(seqs, tokens)}
