"""What calibration measures: SM levels, primitive sizes, iteration shapes, and how a shape
becomes a batch for the engine's model runner (docs/design.md sections 3 and 5; issue 5, part 4).

Nothing here touches a GPU: the selection rules are plain functions, so they are tested on
the CPU, and ``make_batch`` only does KV-block bookkeeping.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from duetserve.engine.scheduler import ScheduledSeq
from duetserve.engine.sequence import Sequence
from duetserve.sampling import SamplingParams

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "eos_token_id": 2}
"""Qwen3-8B's published config.json (the default served model; weights are dummy bf16)."""

L2_BYTES = 60e6
"""Inputs of one timed run are rotated so that consecutive runs never find them in L2
(H200: 50 MB of L2; 60 MB leaves a margin)."""

PRIMITIVE_SMS = (16, 24, 32, 48, 64, 96)
"""SM counts of docs/design.md section 5's table (all SMs are always added)."""

TPCMASK_SAFE_MIN_SMS = 48
"""Under TPC masks, decode-shaped cuBLAS matmuls hung at 16 SMs and none of 36 shapes hung at
48 (docs/design.md section 5): calibration uses no TPC-mask level below this."""

DECODE_BATCHES = (1, 8, 32, 64, 128)
CONTEXTS = (512, 2048, 8192)
PREFILLS = ((1, 512), (1, 2048), (1, 8192), (8, 1024))
"""Prefill iterations as (requests, prompt tokens each)."""

MIXED = ((16, 1024, 2032, 0), (64, 2048, 1984, 0), (120, 1024, 1928, 4096), (120, 2048, 1024, 0))
"""Mixed iterations as (decodes, their context tokens, prefill chunk tokens, the chunk's cached
tokens): decodes beside one chunk of a prompt under a 2048-token budget, as chunked prefill and
duet's temporal plans run them in serving (more tokens than the piecewise graphs take, so eager;
at most 120 decodes, so the chunk's sequence fits ``max(DECODE_BATCHES)``)."""

SPLIT_SMS = (16, 32, 64)
SPLIT_DECODES = ((8, 2048), (32, 2048), (128, 2048))
"""Decode batches (requests, context tokens) also measured on ``SPLIT_SMS`` SMs; ``--quick``
keeps only the middle one."""

LOOKAHEAD_K = 8
"""Decode steps per measured decode iteration, as serving runs them: spatial plans' look-ahead,
and on all SMs a multi-step decode (``serve --num-decode-steps``, default 8: each step's graph
replay queued behind the one running). The decode stream's time is divided by this. Timed one
step at a time with the host's sync between steps, the H200's decodes fitted 4.56 us a kernel
where served multi-step decodes ran at 3.52 (docs/benchmarks.md, thirty-fifth session)."""

MAX_CONTEXT = max(CONTEXTS) + LOOKAHEAD_K
"""Longest sequence any shape needs, tokens (the engine's ``max_model_len``)."""


@dataclass(frozen=True)
class Shape:
    """One measured iteration: ``batch`` requests of ``q`` new tokens on ``c`` cached ones, on
    ``sms`` SMs. Decode has ``q == 1``; prefill ``c == 0``; mixed is ``batch`` decodes (``q ==
    1``) beside one prefill chunk of ``chunk`` tokens on ``chunk_cached`` cached ones. ``k > 1``
    (decode only) runs ``k`` steps back to back, as a multi-step decode on all SMs or a spatial
    plan's look-ahead on fewer, and reports the GPU's seconds per step.
    """

    kind: Literal["decode", "prefill", "mixed"]
    batch: int
    q: int
    c: int
    sms: int
    k: int = 1
    chunk: int = 0
    chunk_cached: int = 0

    @property
    def reqs(self) -> list[tuple[int, int]]:
        """The batch as the cost model takes it: ``(q, c)`` per request, the chunk last."""
        return [(self.q, self.c)] * self.batch + ([(self.chunk, self.chunk_cached)] if self.chunk else [])

    @property
    def tokens_per_request(self) -> int:
        """KV slots one request needs, tokens (the look-ahead steps included)."""
        return self.q + self.c + self.k - 1

    @property
    def label(self) -> str:
        """``"decode 32x2048 @132"``: kind, requests x tokens each (context or prompt), SMs; a mixed
        shape adds its chunk, ``"mixed 120x1024+1928/4096 @132"`` (chunk tokens / cached)."""
        size = self.q if self.kind == "prefill" else self.q + self.c
        chunk = f"+{self.chunk}/{self.chunk_cached}" if self.chunk else ""
        return f"{self.kind} {self.batch}x{size}{chunk} @{self.sms}"


@dataclass(frozen=True)
class Capacity:
    """What the engine built for calibration can hold.

    Attributes:
        num_sms: SMs of the device.
        kv_blocks: KV-cache blocks; ``block_size`` tokens each.
        max_num_seqs: most requests in one batch.
        max_num_batched_tokens: most new tokens in one iteration.
        max_model_len: longest sequence, tokens.
    """

    num_sms: int
    kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def misfit(self, shape: Shape) -> str | None:
        """Why ``shape`` cannot run on this engine (None when it fits)."""
        chunk_len = shape.chunk + shape.chunk_cached
        blocks = shape.batch * math.ceil(shape.tokens_per_request / self.block_size) \
            + math.ceil(chunk_len / self.block_size)
        if blocks > self.kv_blocks:
            return f"needs {blocks} KV blocks, the cache has {self.kv_blocks}"
        if (seqs := shape.batch + (shape.chunk > 0)) > self.max_num_seqs:
            return f"batch {seqs} > max_num_seqs {self.max_num_seqs}"
        if (tokens := shape.batch * shape.q + shape.chunk) > self.max_num_batched_tokens:
            return f"{tokens} tokens > max_num_batched_tokens {self.max_num_batched_tokens}"
        if (longest := max(shape.tokens_per_request, chunk_len)) > self.max_model_len:
            return f"{longest} tokens > max_model_len {self.max_model_len}"
        return None


def sm_levels(offered: Iterable[int], num_sms: int, wanted: Iterable[int] = PRIMITIVE_SMS,
              min_sms: int = 0) -> list[int]:
    """SM counts to measure: those of ``wanted`` that the partition backend ``offered`` and
    that are at least ``min_sms``, then ``num_sms`` (all SMs, the device's own stream)."""
    offered = set(offered)
    return sorted(s for s in set(wanted) if s in offered and min_sms <= s < num_sms) + [num_sms]


def rotation_sets(set_bytes: float, l2_bytes: float = L2_BYTES) -> int:
    """How many input sets of ``set_bytes`` bytes to rotate between timed runs: at least 2,
    and together at least twice ``l2_bytes``, so no run finds its inputs in L2.

    Raises ValueError for a non-positive size.
    """
    if set_bytes <= 0:
        raise ValueError("set_bytes must be positive")
    return max(2, math.ceil(2 * l2_bytes / set_bytes))


def plan_shapes(capacity: Capacity, split_levels: Iterable[int], quick: bool = False
                ) -> tuple[list[Shape], list[tuple[Shape, str]]]:
    """The iteration shapes to measure and the ones skipped, each with its reason.

    All SMs: decode ``DECODE_BATCHES x CONTEXTS`` (``LOOKAHEAD_K`` steps), then ``PREFILLS``, then
    ``MIXED`` (one temporal iteration each). Then decode ``SPLIT_DECODES`` on each SM count of
    ``SPLIT_SMS`` found in ``split_levels`` (the levels the partition backend offers; empty for
    ``none``), with ``LOOKAHEAD_K`` steps.
    """
    n = capacity.num_sms
    shapes = [Shape("decode", b, 1, ctx - 1, n, LOOKAHEAD_K) for b in DECODE_BATCHES for ctx in CONTEXTS]
    shapes += [Shape("prefill", b, length, 0, n) for b, length in PREFILLS]
    shapes += [Shape("mixed", d, 1, ctx - 1, n, chunk=p, chunk_cached=pc) for d, ctx, p, pc in MIXED]
    split_decodes = SPLIT_DECODES[1:2] if quick else SPLIT_DECODES
    levels = set(split_levels)
    shapes += [Shape("decode", b, 1, ctx - 1, s, LOOKAHEAD_K)
               for s in SPLIT_SMS if s in levels for b, ctx in split_decodes]
    reasons = [(shape, capacity.misfit(shape)) for shape in shapes]
    return [s for s, why in reasons if why is None], [(s, why) for s, why in reasons if why is not None]


def make_batch(engine, batch: int, ctx: int, q: int, extra_tokens: int = 0,
               first_id: int = 10_000_000) -> list[ScheduledSeq]:
    """``batch`` sequences of ``ctx`` tokens, ``ctx - q`` of them cached and ``q`` new, with KV
    blocks allocated in ``engine.block_manager`` for ``ctx + extra_tokens`` tokens (look-ahead
    steps write past ``ctx``), numbered from ``first_id`` (two batches in one iteration need
    distinct numbers). Free them with ``engine.block_manager.free(s.seq)``.

    Token ids are drawn uniformly from ``engine.model.dims.vocab_size``, seeded by the sequence
    number (reproducible). They must differ: with one repeated id every row of a prompt's
    activations stays equal through every layer (attention averages equal value rows), the
    GEMMs' inputs barely toggle, and a power-capped H200 ran such prefills 1.09-1.19x faster
    than prompts of varied ids (docs/benchmarks.md, thirty-fifth H200 session).

    Raises RuntimeError when the cache runs out of blocks (``Capacity.misfit`` says beforehand).
    """
    vocab = engine.model.dims.vocab_size
    out = []
    for i in range(batch):
        # A decode holds one generated token (the one it feeds); a prefill holds only prompt tokens.
        prompt_len = ctx - 1 if q == 1 else ctx
        tokens = np.random.default_rng(first_id + i).integers(0, vocab, ctx).tolist()
        seq = Sequence(first_id + i, tokens, prompt_len, SamplingParams(max_tokens=1 << 20, ignore_eos=True))
        seq.num_computed_tokens = ctx - q
        engine.block_manager.allocate(seq, ctx + extra_tokens)
        out.append(ScheduledSeq(seq, q, ctx - q, max_steps=1 + extra_tokens))
    return out
