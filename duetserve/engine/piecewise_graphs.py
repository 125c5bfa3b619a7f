"""Forward passes with prefill tokens replayed from piecewise CUDA graphs (vLLM's and SGLang's
piecewise graphs), attention launched eagerly between the pieces.

An eager pass launches about a dozen kernels a layer, each costing the host 10-63 us on the lent
H200's hosts (57 us on average over a pass), so passes of up to about a thousand tokens took the
host longer than the GPU
(docs/benchmarks.md, twenty-fourth session: a 539-token prefill beside 5 decodes took 29 ms).
Attention cannot be recorded once for every batch of ``T`` tokens: its grid and what it reads
depend on how the tokens split into sequences. Everything else depends on ``T`` alone, so each
bucket of ``T`` records ``L + 1`` graphs for an ``L``-layer model:

* piece 0: the embedding and layer 0 up to attention (input norm, QKV, q/k norm, RoPE, K/V store);
* piece ``i`` (1 .. L-1): layer ``i - 1`` after attention (output projection, residual add and
  norm, MLP), then layer ``i`` up to attention;
* piece ``L``: the last layer after attention and the final norm.

Between pieces the attention backend runs eagerly on the batch's own metadata, reading the queries
a piece left in a static buffer and writing its output into another that the next piece reads. A
batch of ``T`` tokens replays the smallest bucket ``>= T``: its padding tokens (whatever ids and
positions an earlier batch left, or zeros) write their K/V to a scratch slot no sequence owns, and no real
token attends to them.

A graph keeps the SM restriction of the stream it was recorded on (docs/design.md section 5), so
these, recorded on all SMs, serve temporal iterations only; a spatial plan's prefill runs eagerly.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from duetserve.engine.cuda_graphs import StaticInputs, collection_paused
from duetserve.model.attention import AttentionMetadata
from duetserve.model.decoder import CausalLM

log = logging.getLogger(__name__)

SMALL_BUCKETS = (16, 32, 64, 128, 256)  # the smallest buckets, tokens
BUCKET_STEP = 128  # tokens between buckets above the last small one

# Records one piece: runs ``fn`` (which returns the piece's output tensors) into a graph and returns
# ``(replay, outputs)``; replaying leaves the piece's new outputs in those same tensors.
Recorder = Callable[[Callable[[], tuple[torch.Tensor, ...]]], tuple[Callable[[], None], tuple[torch.Tensor, ...]]]


def piecewise_buckets(max_tokens: int) -> list[int]:
    """Token counts to record: 16, 32, 64, 128, 256, then every 128 up to ``max_tokens`` (always
    included); ``[]`` for ``max_tokens < 1``."""
    if max_tokens < 1:
        return []
    sizes = {b for b in SMALL_BUCKETS if b <= max_tokens}
    sizes.update(range(SMALL_BUCKETS[-1] + BUCKET_STEP, max_tokens + 1, BUCKET_STEP))
    sizes.add(max_tokens)
    return sorted(sizes)


def cuda_recorder(pool) -> Recorder:
    """A ``Recorder`` of CUDA graphs in the memory pool ``pool``."""
    def record(fn):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = fn()
        return graph.replay, outputs
    return record


class PiecewiseGraphs(StaticInputs):
    """Records and replays forward passes of up to ``max_tokens`` tokens (module docstring).

    Args:
        model: the model; any attention backend (attention runs eagerly).
        kv_caches: per-layer ``(k_cache, v_cache)``, each ``[blocks, block_size, Hkv, D]``.
        max_tokens: the largest bucket, tokens (``piecewise_buckets``).
        scratch_slot: a KV slot no sequence owns (padding tokens write there).
        device: the model's device.
    """

    def __init__(self, model: CausalLM, kv_caches, max_tokens: int, scratch_slot: int, device: torch.device):
        self.model, self.kv_caches = model, kv_caches
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        super().__init__(piecewise_buckets(max_tokens), scratch_slot, device)
        n, dims = self.buckets[-1], model.dims
        dtype = model.lm_head.weight.dtype
        self.queries = torch.zeros(n, dims.num_heads, dims.head_dim, dtype=dtype, device=device)
        self.attention = torch.zeros_like(self.queries)
        self.replays: dict[int, list[Callable[[], None]]] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0

    def _pieces(self, b: int) -> list[Callable]:
        """The ``L + 1`` piece functions of bucket ``b``; each takes the previous piece's residual
        (None for piece 0) and returns its outputs: ``(residual,)``, the last one ``(hidden,)``.
        Queries go to ``self.queries``; pieces after the first read ``self.attention``."""
        layers, kv = self.model.model.layers, self.kv_caches
        # every buffer bound now, as a graph binds addresses when it records
        ids, pos, slots = self.input_ids[:b], self.positions[:b], self.slot_mapping[:b]
        queries, attention = self.queries[:b], self.attention[:b]

        def first(_):
            q, res = layers[0].pre_attention(self.model.model.embed_tokens(ids), None, pos, kv[0], slots)
            queries.copy_(q)
            return (res,)

        def middle(i):
            def piece(res):
                x, res = layers[i - 1].post_attention(attention, res)
                q, res = layers[i].pre_attention(x, res, pos, kv[i], slots)
                queries.copy_(q)
                return (res,)
            return piece

        def last(res):
            return (self.model.final_norm(layers[-1].post_attention(attention, res)),)

        return [first] + [middle(i) for i in range(1, len(layers))] + [last]

    @torch.inference_mode()
    def capture(self, record: Recorder | None = None) -> None:
        """Record every bucket (largest first). ``record``: how a piece is recorded (default: CUDA
        graphs in a new memory pool of their own, after one warm-up pass a bucket on a side stream).
        """
        cuda = record is None
        before = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            record = cuda_recorder(torch.cuda.graph_pool_handle())
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compiles kernels, sizes cuBLAS workspaces
                for b in reversed(self.buckets):
                    res = None
                    for piece in self._pieces(b):
                        res = piece(res)[0]
            torch.cuda.current_stream().wait_stream(side)
        with collection_paused():
            for b in reversed(self.buckets):
                replays, res = [], None
                for piece in self._pieces(b):
                    replay, (res,) = record(lambda piece=piece, res=res: piece(res))
                    replays.append(replay)
                self.replays[b], self.hidden[b] = replays, res
        self.recorded = True
        if cuda:
            torch.cuda.synchronize()
            self.memory_bytes = torch.cuda.memory_allocated() - before
        log.info("recorded piecewise CUDA graphs for %d token buckets (%s), %d pieces each, %.1f MiB",
                 len(self.buckets), self.buckets, len(self.model.model.layers) + 1, self.memory_bytes / 2**20)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward pass of ``input_ids`` ``[T]`` (int64) at ``positions`` ``[T]`` (int64): hidden
        states ``[T, hidden]`` after the final norm (a view of a static buffer, valid until the next
        call), the K/V written at ``meta.slot_mapping``, as ``CausalLM.forward``.

        Raises:
            ValueError: ``T`` is larger than the largest bucket, or nothing is recorded yet.
        """
        n, b = self.stage(input_ids, positions, meta.slot_mapping, "piecewise graph", "tokens")
        replays, layers = self.replays[b], self.model.model.layers
        for i, layer in enumerate(layers):
            replays[i]()
            layer.self_attn.attend(self.queries[:n], self.kv_caches[i], meta, out=self.attention[:n])
        replays[-1]()
        return self.hidden[b][:n]
