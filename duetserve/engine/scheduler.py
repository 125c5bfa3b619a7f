"""Continuous-batching scheduler shared by the engine and the simulator.

Every iteration: running decodes first, then prefill chunks (partially prefilled sequences,
then waiting requests in arrival order) under the token budget; admission by free KV
blocks; preemption by recompute when blocks run out. The policy decides chunking and the
iteration's plan (temporal, or spatial with ``k`` look-ahead decode steps).

Layer-split prefill (``Plan.prefill_layers``, the ``pdmux`` policy): the prefill batch of such
a plan stays pinned across iterations, handed out again with the same plan every round and no
new prefill admitted, until the executor reports its last layer done
(``advance(..., prefills=True)``); until then its tokens do not advance.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from duetserve.engine.kv_cache import BlockManager
from duetserve.engine.policy import Plan, Policy
from duetserve.engine.sequence import Sequence, SequenceStatus
from duetserve.planner.optimizer import trim_prefill

MAX_LOOKAHEAD = 256  # most decode steps one iteration may reserve (seconds of decode at any split)


@dataclass
class ScheduledSeq:
    """One sequence's share of an iteration: ``q`` query tokens on top of ``c`` cached ones."""

    seq: Sequence
    num_new_tokens: int
    num_cached_tokens: int
    max_steps: int = 1  # decodes of a look-ahead plan: steps with a token still to generate

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so a token is sampled."""
        return self.num_cached_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """The batch of one iteration and how to run it.

    ``decodes`` run ``plan.k`` steps (one token each per step); ``prefills`` run once.
    """

    decodes: list[ScheduledSeq]
    prefills: list[ScheduledSeq]
    plan: Plan
    preempted: list[Sequence]

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefills)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills


class Scheduler:
    """Decides, each iteration, which sequences run and with how many tokens.

    Args:
        policy: chunking rules and plan choice (``duetserve.engine.policy``).
        block_manager: KV-cache block pool.
        max_num_seqs: most running sequences.
        max_num_batched_tokens: token budget per iteration (decode tokens + prefill tokens).
        max_model_len: longest sequence, tokens.
        watermark: share of blocks kept free when admitting a new request, to avoid
            preempting right after admission.
        decode_steps: a decode-only iteration with a temporal plan runs up to this many steps
            (``Plan.k``, KV slots reserved up front; the executor may stop earlier).
    """

    def __init__(self, policy: Policy, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, watermark: float = 0.01, decode_steps: int = 1):
        self.policy = policy
        self.decode_steps = decode_steps
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._split: tuple[list[ScheduledSeq], Plan] | None = None  # layer-split prefill in flight

    def add(self, seq: Sequence) -> None:
        """Queue a new request.

        Raises:
            ValueError: the prompt leaves no room for one output token within ``max_model_len``,
                or it can never fit in the KV cache.
        """
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {seq.num_tokens} tokens; the context limit is "
                             f"{self.max_model_len}, and one output token must fit")
        if -(-(seq.num_tokens + 1) // self.blocks.block_size) > self.blocks.num_blocks:
            raise ValueError(f"prompt of {seq.num_tokens} tokens does not fit in the KV cache")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Form the next iteration's batch (may preempt running sequences)."""
        preempted: list[Sequence] = []
        budget = self.max_num_batched_tokens
        skip_decode = self.policy.prefill_excludes_decode and self._has_prefill_work()
        decodes: list[ScheduledSeq] = []
        if not skip_decode:
            blocks, size, running = self.blocks, self.blocks.block_size, SequenceStatus.RUNNING
            for seq in [s for s in self.running if s.is_decode]:
                if budget == 0:
                    break
                if seq.status is not running:
                    continue  # preempted to make room for an earlier sequence
                n = len(seq.token_ids)
                if n > len(seq.block_table) * size:  # its next token starts a block
                    if not self._make_room(seq, n, preempted):
                        continue
                    blocks.allocate(seq, n)
                decodes.append(ScheduledSeq(seq, 1, seq.num_computed_tokens))
                budget -= 1

        max_k = 1
        remaining = self._remaining([d.seq for d in decodes])
        if self._split_in_flight():
            prefills, plan = self._split
        else:
            candidates = self._prefill_candidates(budget)
            # The policy sees only look-ahead depths whose KV fits beside these prefill chunks,
            # so the k it plans (and any wait it carries into the next plan) is the k that runs.
            free = self.blocks.num_free_blocks - sum(self.blocks.blocks_needed(s, s.num_computed_tokens + q)
                                                     for s, q in candidates)
            max_k = self._lookahead_fit(decodes, remaining, max(remaining, default=1), free)
            plan = self.policy.plan([(1, d.num_cached_tokens) for d in decodes],
                                    [(q, s.num_computed_tokens) for s, q in candidates], max_k)
            prefills = self._admit(self._trim(candidates, plan.prefill_token_limit))
            if plan.prefill_layers is not None and prefills:
                self._split = (prefills, plan)
        if plan.spatial and decodes:
            plan = dataclasses.replace(plan, k=self._reserve_lookahead(decodes, remaining, min(plan.k, max_k)))
        elif decodes and not prefills and self.decode_steps > 1:  # multi-step decode
            k = self._reserve_lookahead(decodes, remaining, min(self.decode_steps, max_k))
            # how many of the k steps run is known only afterwards: ServerMetrics predicts those
            plan = dataclasses.replace(plan, spatial=False, k=k, predicted_s=None)
        elif plan.spatial or plan.k != 1:
            plan = dataclasses.replace(plan, spatial=False, k=1)
        return SchedulerOutput(decodes, prefills, plan, preempted)

    def _split_in_flight(self) -> bool:
        """Whether a layer-split prefill batch is still running; drops its preempted sequences."""
        if self._split is None:
            return False
        prefills, plan = self._split
        prefills = [p for p in prefills if p.seq.status is SequenceStatus.RUNNING]
        self._split = (prefills, plan) if prefills else None
        return self._split is not None

    def _remaining(self, seqs: list[Sequence]) -> list[int]:
        """Tokens each of ``seqs`` may still generate (``max_tokens``, the context limit)."""
        limit = self.max_model_len
        return [min(s.params.max_tokens - n + s.num_prompt_tokens, limit - n)
                for s in seqs for n in (len(s.token_ids),)]

    def _has_prefill_work(self) -> bool:
        if any(not s.is_decode for s in self.running):
            return True
        return self.can_admit()

    def can_admit(self, ending: Iterable[Sequence] = ()) -> bool:
        """Whether the first waiting request would be admitted now: a free sequence slot
        (``max_num_seqs``) and KV blocks for its prompt above the watermark; with ``ending``
        (running sequences), as if those had finished and given their blocks back."""
        if not self.waiting:
            return False
        ending = list(ending)
        freed = sum(len(s.block_table) for s in ending)
        return len(self.running) - len(ending) < self.max_num_seqs and \
            self.blocks.can_allocate(self.waiting[0], self.waiting[0].num_tokens, self.watermark_blocks - freed)

    def _make_room(self, seq: Sequence, num_tokens: int, preempted: list[Sequence]) -> bool:
        """Preempt lower-priority (later admitted) running sequences until ``seq`` can hold ``num_tokens``.

        Returns False (and preempts ``seq`` itself) when no lower-priority sequence is left.
        """
        while not self.blocks.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _prefill_candidates(self, budget: int) -> list[tuple[Sequence, int]]:
        """Prefill chunks ``(seq, q)`` that fit the budget and (virtually) the free blocks."""
        chunked = self.policy.chunked_prefill
        free = self.blocks.num_free_blocks
        out: list[tuple[Sequence, int]] = []
        partial = [s for s in self.running if not s.is_decode]
        num_seqs = len(self.running)
        for seq in partial + list(self.waiting):
            is_new = seq.status is SequenceStatus.WAITING
            if is_new and num_seqs >= self.max_num_seqs:
                break
            q = seq.num_uncomputed_tokens
            if chunked:
                q = min(q, budget)
            elif q > budget and out:
                break
            if q <= 0:
                break
            need = self.blocks.blocks_needed(seq, seq.num_computed_tokens + q)
            if need > free - (self.watermark_blocks if is_new else 0):
                if is_new:
                    break
                continue
            free -= need
            budget = max(0, budget - q)
            num_seqs += is_new
            out.append((seq, q))
        return out

    @staticmethod
    def _trim(candidates: list[tuple[Sequence, int]], limit: int | None) -> list[tuple[Sequence, int]]:
        """The candidates cut to ``limit`` prefill tokens by ``trim_prefill``'s rule."""
        if limit is None:
            return candidates
        kept = trim_prefill([(q, seq.num_computed_tokens) for seq, q in candidates], limit)
        return [(seq, q) for (seq, _), (q, _) in zip(candidates, kept)]

    def _admit(self, candidates: list[tuple[Sequence, int]]) -> list[ScheduledSeq]:
        prefills = []
        for seq, q in candidates:
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            self.blocks.allocate(seq, seq.num_computed_tokens + q)
            prefills.append(ScheduledSeq(seq, q, seq.num_computed_tokens))
        return prefills

    def _lookahead_fit(self, decodes: list[ScheduledSeq], remaining: list[int], k: int, free_blocks: int) -> int:
        """Largest depth <= min(``k``, ``MAX_LOOKAHEAD``) (at least 1) whose KV slots for every
        decode (``remaining``: each one's tokens left, at least 1 step each) fit ``free_blocks``.

        The blocks a depth needs beyond what the decodes hold grow with the depth, so the
        common case (the largest fits) is one check and the rest a binary search. Each check
        is a few numpy operations over the decodes (the scheduler runs every iteration over up
        to ``max_num_seqs`` decodes; a loop in Python took about 1 us a decode a check)."""
        lo, hi = 1, min(k, MAX_LOOKAHEAD)
        if hi == 1:
            return hi
        size, n = self.blocks.block_size, len(decodes)
        base = np.fromiter((len(d.seq.token_ids) - 1 for d in decodes), np.int64, n)  # tokens held before the steps
        held = np.fromiter((len(d.seq.block_table) for d in decodes), np.int64, n)
        left = np.maximum(np.asarray(remaining, dtype=np.int64), 1)

        def fits(depth: int) -> bool:
            blocks = -(-(base + np.minimum(depth, left)) // size)
            return int(np.maximum(blocks - held, 0).sum()) <= free_blocks

        if fits(hi):
            return hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def _reserve_lookahead(self, decodes: list[ScheduledSeq], remaining: list[int], k: int) -> int:
        """Reserve KV slots for ``k`` decode steps (the policy was offered only depths that fit,
        see ``schedule``); returns ``k``.

        A decode with fewer tokens left (``remaining``: ``max_tokens`` or the context limit)
        gets only those steps (``ScheduledSeq.max_steps``); the executor parks its extra steps
        on a scratch slot.
        """
        for d, left in zip(decodes, remaining):
            d.max_steps = max(1, min(k, left))
            self.blocks.allocate(d.seq, d.seq.num_tokens - 1 + d.max_steps)
        return k

    # --- results ----------------------------------------------------------------------

    def postprocess(self, out: SchedulerOutput, sampled: dict[int, list[int]],
                    prefill_done: bool = True) -> list[Sequence]:
        """Advance sequences by all of the iteration's results at once (the simulator's view);
        returns those that finished.

        Args:
            out: the iteration's batch.
            sampled: seq_id -> sampled token ids: one per prefill chunk that ``samples``, and
                one per decode step run (at most ``plan.k``; tokens after a finish are dropped).
            prefill_done: False while a layer-split prefill batch has layers left: its
                sequences stay pinned and nothing of them advances (decodes still do).
        """
        finished = []
        for j in range(max((len(sampled.get(s.seq.seq_id, ())) for s in out.decodes), default=0)):
            step = {s.seq.seq_id: sampled[s.seq.seq_id][j] for s in out.decodes if len(sampled.get(s.seq.seq_id, ())) > j}
            finished += self.advance(out, step, prefills=False)
        prefill_tokens = {s.seq.seq_id: sampled[s.seq.seq_id][0] for s in out.prefills if s.seq.seq_id in sampled}
        return finished + self.advance(out, prefill_tokens, prefills=prefill_done)

    def advance(self, out: SchedulerOutput, tokens: dict[int, int], prefills: bool) -> list[Sequence]:
        """Apply one part of an iteration's results, as the executor makes them available
        (a look-ahead plan delivers each decode step on its own, then the prefill batch);
        returns the sequences that finished.

        Args:
            out: the iteration's batch.
            tokens: seq_id -> the one token sampled for it in this part; each decode present
                advances by one token (none once finished: later look-ahead tokens are dropped).
            prefills: this part completes the prefill batch: its chunks count as computed and
                those that ``samples`` take their token. False for the look-ahead steps, and
                while a layer-split prefill batch still has layers to run (it stays pinned).
        """
        finished = []
        if prefills:
            self._split = None
            for s in out.prefills:
                if s.seq.is_finished:
                    continue
                s.seq.num_computed_tokens += s.num_new_tokens
                if s.samples and self._append(s.seq, tokens[s.seq.seq_id]):
                    finished.append(s.seq)
        for s in out.decodes:
            token = tokens.get(s.seq.seq_id)
            if token is None or s.seq.is_finished:
                continue
            s.seq.num_computed_tokens += 1
            if self._append(s.seq, token):
                finished.append(s.seq)
        return finished

    def _append(self, seq: Sequence, token: int) -> bool:
        reason = seq.append_token(token, self.max_model_len)
        if reason is not None:
            self.finish(seq, reason)
        return reason is not None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` now (stop string, abort, finished): free its blocks, drop it from queues."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
