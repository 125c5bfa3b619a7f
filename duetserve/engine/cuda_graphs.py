"""Decode-only forward passes recorded as CUDA graphs, one per batch-size bucket.

A decode step launches hundreds of small kernels; replaying a recorded graph removes their
launch gaps. Inputs live in static buffers: a batch of ``n`` decodes is copied into the
first ``n`` rows of the smallest bucket ``>= n``; the padding rows write their K/V into a
scratch block that no sequence owns and attend to one token (context length 1) through whatever
block table an earlier batch left in their rows (reads only; their outputs are dropped).
"""
from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

import torch

from duetserve.model.attention import AttentionMetadata
from duetserve.model.decoder import CausalLM
from duetserve.model.layers import graph_kernels

log = logging.getLogger(__name__)


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Within: Python's cyclic garbage collector is off, after one full collection on entry.

    For recording CUDA graphs: a dead object found by a collection in the middle of a capture (an
    earlier engine in a reference cycle, with its own graphs) frees CUDA memory and graphs, which
    invalidates the capture ("operation failed due to a previous error during capture"), and
    ``torch.cuda.graph`` no longer collects before a capture (torch 2.11)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes to record: 1, 2, 4, 8, then every 16 up to ``max_batch`` (always included)."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch}
    sizes.update(range(16, max_batch + 1, 16))
    sizes.add(max_batch)
    return sorted(sizes)


class StaticInputs:
    """Token-level input buffers of graphs recorded per bucket: ``input_ids``, ``positions`` and
    ``slot_mapping``, each ``[largest bucket]`` int64; a batch of ``n`` rows goes in the first
    ``n`` rows of the smallest recorded bucket ``>= n``, its padding rows write their K/V to
    ``scratch_slot`` (their ids and positions are whatever an earlier batch left: valid values).

    Args:
        buckets: sorted row counts to record.
        scratch_slot: a KV slot no sequence owns.
        device: where the buffers live.
    """

    def __init__(self, buckets: list[int], scratch_slot: int, device: torch.device):
        self.buckets, self.scratch_slot = buckets, scratch_slot
        n = buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), scratch_slot, dtype=torch.int64, device=device)
        self.recorded = False  # set once the buckets are recorded

    def bucket(self, n: int) -> int | None:
        """Smallest recorded bucket holding ``n`` rows, or None (none does, or nothing is recorded)."""
        return next((b for b in self.buckets if b >= n), None) if self.recorded else None

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              what: str, unit: str) -> tuple[int, int]:
        """Copy ``n`` rows of inputs (each ``[n]`` int64) into the buffers, the padding rows' slots
        to the scratch slot; returns ``(n, bucket)``.

        Raises:
            ValueError: no recorded bucket holds ``n`` rows ("no {what} holds {n} {unit}").
        """
        n = input_ids.shape[0]
        b = self.bucket(n)
        if b is None:
            raise ValueError(f"no {what} holds {n} {unit}")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:b].fill_(self.scratch_slot)
        return n, b


def allocate_decode_logits(model: CausalLM, max_batch: int, device: torch.device) -> torch.Tensor:
    """``[max_batch, vocab]`` logits buffer in the model's dtype for ``DecodeGraphs`` (``logits``).

    Raises:
        torch.OutOfMemoryError: the device cannot hold it.
    """
    return torch.empty(max_batch, model.dims.vocab_size, dtype=model.lm_head.weight.dtype, device=device)


class DecodeGraphs(StaticInputs):
    """Records and replays decode steps.

    Args:
        model: the model; its attention backend must be graph-safe (no host syncs, no
            value-dependent shapes), e.g. the Triton backend.
        kv_caches: per-layer ``(k_cache, v_cache)``.
        max_batch: largest decode batch to record, sequences.
        max_blocks: block-table width, blocks (``ceil(max_model_len / block_size)``).
        scratch_slot: a KV slot no sequence owns (padding rows write there).
        stream: stream to record on; a graph keeps the SM restriction of the (green-context)
            stream it was recorded on (docs/design.md section 5), so each split level records its own.
            None: a side stream on all SMs.
        split_counters: ``[>= max_batch * num_kv_heads]`` int32 zeros, decode attention's split
            counters, recorded into every graph (``allocate_split_counters``; zero again after
            each replay, so the engine's graphs and eager steps share one buffer). None: each
            attention call allocates its own, a memset recorded per layer.
        decode_stream: records buckets of up to ``decode_stream.MAX_ROWS`` sequences through it
            (``duetserve.model.decode_stream``); None: the model's own layers everywhere.
        logits: ``[>= max_batch, vocab]`` tensor in the model's dtype that every bucket's graph
            writes its logits into (``allocate_decode_logits``), so a set of graphs holds one
            bucket's worth, not the sum over its buckets: at 256 sequences 20 buckets of Qwen3-8B
            held 0.65 GB of logits a set, 10.6 GB over the 16 sets of a duet server, and the
            H200 ran out of memory while serving (docs/benchmarks.md, twenty-eighth session).
            Sets may share one, as they share ``split_counters``: no two decode steps run at
            once. None: a buffer of its own.

    Raises:
        ValueError: ``logits`` is not contiguous or has fewer than ``max_batch`` rows.
    """

    def __init__(self, model: CausalLM, kv_caches, max_batch: int, max_blocks: int, scratch_slot: int,
                 device: torch.device, stream: torch.cuda.Stream | None = None,
                 split_counters: torch.Tensor | None = None, decode_stream=None, logits: torch.Tensor | None = None):
        self.stream = stream
        self.decode_stream = decode_stream
        self.split_counters = split_counters
        self.model, self.kv_caches = model, kv_caches
        super().__init__(graph_buckets(max_batch), scratch_slot, device)
        self.max_blocks = max_blocks
        n = self.buckets[-1]
        i32 = {"dtype": torch.int32, "device": device}
        self.context_lens = torch.ones(n, **i32)
        self.block_tables = torch.zeros(n, max_blocks, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if logits is None:
            logits = allocate_decode_logits(model, n, device)
        elif logits.dim() != 2 or logits.shape[0] < n or not logits.is_contiguous():
            raise ValueError(f"logits must be a contiguous [>= {n}, vocab] tensor, got {tuple(logits.shape)}")
        self.logits_out = logits
        self.memory_bytes = 0

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
                                 context_lens=self.context_lens[:b], block_tables=self.block_tables[:b],
                                 num_decodes=b, query_lens_cpu=[1] * b, context_lens_cpu=[],
                                 split_counters=self.split_counters)

    def _step(self, b: int) -> torch.Tensor:
        if self.decode_stream is not None and b <= self.decode_stream.MAX_ROWS:
            hidden = self.decode_stream.forward(self.input_ids[:b], self.positions[:b], self._meta(b))
        else:
            hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b))
        return self.model.compute_logits(hidden, out=self.logits_out[:b])

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Record one graph per bucket (largest first) in the memory pool ``pool`` (None: a new one)."""
        before = torch.cuda.memory_allocated()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        side = self.stream or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(self.buckets[0])  # compiles the eager passes' kernel variants (no PDL) too
        with graph_kernels():  # the graph-only kernels (Triton decode GEMM, PDL), warm-up included
            with torch.cuda.stream(side):
                for b in reversed(self.buckets):
                    self._step(b)  # warm-up: compiles kernels, sizes workspaces
            torch.cuda.current_stream().wait_stream(side)
            with collection_paused():
                for b in reversed(self.buckets):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                        self._step(b)
                    self.graphs[b] = graph
        self.recorded = True
        torch.cuda.synchronize()
        self.memory_bytes = torch.cuda.memory_allocated() - before
        log.info("recorded %d decode CUDA graphs (batch %s)%s, %.1f MiB", len(self.graphs), self.buckets,
                 "" if self.stream is None else " on a partitioned stream", self.memory_bytes / 2**20)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the decode step for ``n`` rows; returns logits ``[n, vocab]`` (the model's dtype, a view of a static buffer).

        Raises:
            ValueError: ``n`` is larger than the largest bucket.
        """
        n, b = self.stage(input_ids, positions, meta.slot_mapping, "decode graph", "sequences")
        self.context_lens[:n].copy_(meta.context_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.context_lens[n:b].fill_(1)  # padding rows: one token of context
        self.graphs[b].replay()
        return self.logits_out[:n]
