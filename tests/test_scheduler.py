"""Scheduler and KV-block accounting, without a model: tokens are made up, counts are exact."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duetserve.engine.kv_cache import BlockManager
from duetserve.engine.policy import ChunkedPolicy, Plan, PrefillFirstPolicy
from duetserve.engine.scheduler import Scheduler
from duetserve.engine.sequence import Sequence, SequenceStatus
from duetserve.sampling import SamplingParams

EOS = 2


def make_seq(i: int, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(i, list(range(10, 10 + prompt_len)), prompt_len, SamplingParams(max_tokens=max_tokens),
                    eos_token_ids=frozenset({EOS}))


def fake_sample(out) -> dict[int, list[int]]:
    sampled = {s.seq.seq_id: [7] for s in out.prefills if s.samples}
    sampled.update({s.seq.seq_id: [7] * out.plan.k for s in out.decodes})
    return sampled


def check_blocks(sched: Scheduler) -> None:
    owned = [b for s in sched.running for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert len(owned) + sched.blocks.num_free_blocks == sched.blocks.num_blocks
    assert all(not s.block_table for s in sched.waiting)


def run_to_end(sched: Scheduler, seqs: list[Sequence], max_steps: int = 10_000) -> list:
    for s in seqs:
        sched.add(s)
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        outs.append(out)
        check_blocks(sched)
        sched.postprocess(out, fake_sample(out))
        check_blocks(sched)
    assert not sched.has_unfinished()
    return outs


def test_block_slots_and_counts():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(0, 9, 4)
    assert bm.blocks_needed(seq, 9) == 3          # ceil(9 / 4)
    bm.allocate(seq, 9)
    assert seq.block_table == [0, 1, 2] and bm.num_free_blocks == 7
    assert bm.blocks_needed(seq, 12) == 0 and bm.blocks_needed(seq, 13) == 1
    assert not bm.can_allocate(seq, 13, reserve=7)
    bm.free(seq)
    assert bm.num_free_blocks == 10 and seq.block_table == []
    with pytest.raises(RuntimeError):
        bm.allocate(seq, 41)


def test_block_array_mirrors_the_block_table():
    """``Sequence.block_ids`` (int32, what the runner uploads) equals ``block_table`` through
    growth (doubling), free and re-allocation with other blocks (preemption and recompute)."""
    bm = BlockManager(num_blocks=12, block_size=4)
    seq, other = make_seq(0, 9, 4), make_seq(1, 4, 4)
    for tokens in (1, 5, 9, 13, 17):
        bm.allocate(seq, tokens)
        assert seq.block_ids.tolist() == seq.block_table and seq.block_ids.dtype == np.int32
    assert seq.block_table == [0, 1, 2, 3, 4] and len(seq.block_array) == 8  # capacity 1, 2, 4, 8
    bm.allocate(other, 8)  # blocks 5, 6
    bm.free(seq)
    assert seq.block_ids.tolist() == [] and other.block_ids.tolist() == [5, 6]
    bm.allocate(seq, 12)  # recompute after preemption: the freed blocks come back in pool order
    assert seq.block_table == [7, 8, 9] and seq.block_ids.tolist() == [7, 8, 9]


def test_chunked_prefill_respects_budget_and_decode_first():
    sched = Scheduler(ChunkedPolicy(), BlockManager(200, 16), max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=4096)
    outs = run_to_end(sched, [make_seq(0, 30, 5), make_seq(1, 200, 5), make_seq(2, 10, 5)])
    for out in outs:
        assert len(out.decodes) + out.num_prefill_tokens <= 64
    # Iteration 1: all of seq 0 (30) and the first 34 tokens of seq 1.
    first = outs[0]
    assert [(s.seq.seq_id, s.num_new_tokens, s.num_cached_tokens) for s in first.prefills] == [(0, 30, 0), (1, 34, 0)]
    # Iteration 2: seq 0 decodes first, then seq 1 continues (63 tokens at offset 34).
    second = outs[1]
    assert [s.seq.seq_id for s in second.decodes] == [0]
    assert [(s.seq.seq_id, s.num_new_tokens, s.num_cached_tokens) for s in second.prefills] == [(1, 63, 34)]


def test_prefill_first_runs_whole_prompts_without_decode():
    sched = Scheduler(PrefillFirstPolicy(), BlockManager(200, 16), max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=4096)
    sched.add(make_seq(0, 20, 4))
    out = sched.schedule()
    sched.postprocess(out, fake_sample(out))
    sched.add(make_seq(1, 150, 4))                # longer than the budget: runs whole anyway
    out = sched.schedule()
    assert out.decodes == [] and [(s.seq.seq_id, s.num_new_tokens) for s in out.prefills] == [(1, 150)]
    sched.postprocess(out, fake_sample(out))
    out = sched.schedule()                        # no prefill left: both decode
    assert sorted(s.seq.seq_id for s in out.decodes) == [0, 1] and out.prefills == []


def test_preemption_frees_and_recomputes_without_leaks():
    # 12 blocks of 4 tokens = 48 token slots; four sequences of 10 + 12 tokens cannot all fit.
    sched = Scheduler(ChunkedPolicy(), BlockManager(12, 4), max_num_seqs=4, max_num_batched_tokens=32,
                      max_model_len=100, watermark=0.0)
    seqs = [make_seq(i, 10, 12) for i in range(4)]
    run_to_end(sched, seqs)
    assert sched.num_preemptions > 0
    assert sched.blocks.num_free_blocks == 12
    assert all(s.status is SequenceStatus.FINISHED and s.num_output_tokens == 12 for s in seqs)


def test_eos_and_max_model_len_finish():
    sched = Scheduler(ChunkedPolicy(), BlockManager(50, 4), max_num_seqs=4, max_num_batched_tokens=32,
                      max_model_len=14)
    a, b = make_seq(0, 6, 100), make_seq(1, 6, 100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.postprocess(out, {0: [EOS], 1: [7]})
    assert a.finish_reason == "stop" and not b.is_finished
    while sched.has_unfinished():
        out = sched.schedule()
        sched.postprocess(out, fake_sample(out))
    assert b.finish_reason == "length" and b.num_tokens == 14
    assert a.stopped_by_token and not b.stopped_by_token


@pytest.mark.parametrize("params, tokens, reason, by_token", [
    (SamplingParams(max_tokens=9, stop_token_ids=[5]), [7, 5], "stop", True),
    (SamplingParams(max_tokens=9, stop_token_ids=[5]), [7, EOS], "stop", True),
    (SamplingParams(max_tokens=2, stop_token_ids=[5]), [7, 8], "length", False),
    (SamplingParams(max_tokens=2, ignore_eos=True), [7, EOS], "length", False),  # EOS ignored: the length ends it
])
def test_stopped_by_token(params, tokens, reason, by_token):
    """Which finishes come from the last token (the API then leaves its text out, vLLM's rule)."""
    seq = Sequence(0, [1, 2], 2, params, eos_token_ids=frozenset({EOS}))
    for t in tokens:
        seq.finish_reason = seq.append_token(t, 100)
    assert (seq.finish_reason, seq.stopped_by_token) == (reason, by_token)


class _Spatial:
    """Asks for a spatial plan with k look-ahead steps whenever there is a decode."""

    name, chunked_prefill, prefill_excludes_decode = "spatial", True, False

    def __init__(self, k: int):
        self.k = k
        self.max_k_seen: list[int] = []

    def plan(self, decodes, prefills, max_k):
        self.max_k_seen.append(max_k)
        return Plan(spatial=True, s_prefill=100, s_decode=32, k=self.k) if decodes else Plan()

    def observe(self, plan, decode_step_s, prefill_s, idle_tail_s=None):
        raise AssertionError("no CUDA events on the CPU: nothing to observe")


def test_lookahead_reserves_slots_and_drops_tokens_after_finish():
    policy = _Spatial(k=5)
    sched = Scheduler(policy, BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100)
    a, b = make_seq(0, 5, 3), make_seq(1, 5, 20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.postprocess(out, fake_sample(out))     # prefill: one token each
    out = sched.schedule()
    assert out.plan.spatial and out.plan.k == 5 and policy.max_k_seen[-1] == 19
    # KV for 5 steps is reserved up front: 6 tokens -> 10 tokens of KV = 3 blocks of 4.
    assert len(b.block_table) == 3
    sched.postprocess(out, {0: [7, 7, 7, 7, 7], 1: [7, 7, 7, 7, 7]})
    assert a.is_finished and a.num_output_tokens == 3 and a.block_table == []
    assert b.num_output_tokens == 6 and b.num_computed_tokens == 10


def test_lookahead_offered_fits_beside_the_prefill_chunks():
    """The policy is offered only look-ahead depths whose KV fits after the iteration's prefill
    chunks, so the k it plans is the k that runs (DuetPolicy carries waits computed from it)."""
    policy = _Spatial(k=40)
    sched = Scheduler(policy, BlockManager(10, 4), max_num_seqs=2, max_num_batched_tokens=64,
                      max_model_len=100, watermark=0.0)
    seq = make_seq(0, 7, 50)
    sched.add(seq)
    out = sched.schedule()
    sched.postprocess(out, fake_sample(out))      # 8 tokens, 7 in the KV cache (2 blocks)
    sched.add(make_seq(1, 8, 5))                  # its prefill takes 2 blocks: 6 left for look-ahead
    out = sched.schedule()
    # 7 cached + k new tokens in 2 + 6 blocks of 4: k <= 25 (49 tokens left); 33 without the prefill.
    assert policy.max_k_seen[-1] == 25 and out.plan.k == 25
    assert len(out.prefills) == 1 and sched.blocks.num_free_blocks == 0
    sched.postprocess(out, fake_sample(out))
    assert seq.num_output_tokens == 26 and seq.num_computed_tokens == 32


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30)), min_size=1, max_size=12),
       st.integers(8, 40), st.integers(1, 6), st.integers(1, 6), st.sampled_from(["chunked", "prefill-first", "k"]))
def test_random_workloads_never_leak(reqs, num_blocks, block_size, max_seqs, kind):
    policy = {"chunked": ChunkedPolicy(), "prefill-first": PrefillFirstPolicy(), "k": _Spatial(3)}[kind]
    blocks = BlockManager(num_blocks, block_size)
    sched = Scheduler(policy, blocks, max_num_seqs=max_seqs, max_num_batched_tokens=48, max_model_len=10_000,
                      watermark=0.0)
    seqs = []
    for i, (p, m) in enumerate(reqs):
        if -(-(p + m) // block_size) <= num_blocks:   # what check_request enforces
            seqs.append(make_seq(i, p, m))
    random.Random(0).shuffle(seqs)
    run_to_end(sched, seqs)
    assert blocks.num_free_blocks == num_blocks
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)


def test_decode_only_iterations_run_several_steps_when_asked():
    sched = Scheduler(ChunkedPolicy(), BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=100, watermark=0.0, decode_steps=6)
    a = make_seq(0, 5, 4)
    sched.add(a)
    out = sched.schedule()                        # prefill: one step
    assert out.plan.k == 1 and out.prefills
    sched.postprocess(out, fake_sample(out))
    out = sched.schedule()                        # decode only: 3 tokens left, 6 steps offered -> 3
    assert (out.plan.spatial, out.plan.k, out.decodes[0].max_steps) == (False, 3, 3)
    sched.add(make_seq(1, 5, 4))
    sched.postprocess(out, {0: [7]})              # one step ran (the executor stopped early)
    out = sched.schedule()                        # a prefill joins: back to one step
    assert out.plan.k == 1 and out.prefills and out.decodes


def test_a_multi_step_decode_plan_leaves_its_prediction_to_the_steps_that_run():
    """The plan's one-step prediction is dropped: how many steps run is known only afterwards
    (``ServerMetrics`` predicts those, host time once)."""
    class Predicting(ChunkedPolicy):
        def plan(self, decode_reqs, prefill_reqs, max_k):
            return Plan(s_prefill=132, s_decode=132, predicted_s=0.01, predicted_decode_s=0.01)

    sched = Scheduler(Predicting(), BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=100, watermark=0.0, decode_steps=6)
    sched.add(make_seq(0, 5, 4))
    out = sched.schedule()
    assert out.plan.predicted_s == 0.01 and out.prefills  # a prefill iteration keeps the policy's
    sched.postprocess(out, fake_sample(out))
    out = sched.schedule()
    assert (out.plan.k, out.plan.predicted_s, out.plan.predicted_decode_s) == (3, None, 0.01)


def test_lookahead_offered_is_capped():
    """A request with thousands of tokens left is offered at most MAX_LOOKAHEAD steps (the fit
    is a binary search up to there, not a walk down from its remaining tokens)."""
    from duetserve.engine.scheduler import MAX_LOOKAHEAD

    policy = _Spatial(k=1)
    sched = Scheduler(policy, BlockManager(4000, 4), max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=20_000, watermark=0.0)
    sched.add(make_seq(0, 7, 10_000))
    sched.postprocess(sched.schedule(), {0: [7]})
    sched.schedule()
    assert policy.max_k_seen[-1] == MAX_LOOKAHEAD == 256
    sched2 = Scheduler(_Spatial(k=1), BlockManager(10, 4), max_num_seqs=4, max_num_batched_tokens=64,
                       max_model_len=20_000, watermark=0.0)
    sched2.add(make_seq(0, 7, 10_000))
    sched2.postprocess(sched2.schedule(), {0: [7]})
    sched2.schedule()                             # 8 tokens in 2 blocks, 8 free: 7 + k <= 40 -> k = 33
    assert sched2.policy.max_k_seen[-1] == 33


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(-1, 3), st.integers(-2, 2) | st.integers(3, 400)),
                min_size=1, max_size=20), st.integers(1, 8), st.integers(1, 400), st.integers(0, 200))
def test_lookahead_fit_is_the_deepest_depth_that_fits(decodes, block_size, k, free):
    """``_lookahead_fit`` against its definition, walked depth by depth in Python: the largest
    depth d <= min(k, MAX_LOOKAHEAD) (1 when none fits) such that every decode's KV for
    ``len(token_ids) - 1 + max(1, min(d, remaining))`` tokens needs at most ``free`` blocks beyond
    those it holds (the blocks of its tokens plus ``spare``, which may be one short)."""
    from duetserve.engine.scheduler import MAX_LOOKAHEAD, ScheduledSeq

    sched = Scheduler(ChunkedPolicy(), BlockManager(10_000, block_size), max_num_seqs=32,
                      max_num_batched_tokens=64, max_model_len=100_000)
    scheduled, remaining = [], []
    for i, (tokens, spare, left) in enumerate(decodes):
        seq = make_seq(i, tokens, 500)
        seq.block_table = list(range(max(0, -(-tokens // block_size) + spare)))
        scheduled.append(ScheduledSeq(seq, 1, tokens - 1))
        remaining.append(left)

    def need(depth: int) -> int:
        return sum(max(0, -(-(len(d.seq.token_ids) - 1 + max(1, min(depth, r))) // block_size)
                          - len(d.seq.block_table)) for d, r in zip(scheduled, remaining))

    fitting = [d for d in range(1, min(k, MAX_LOOKAHEAD) + 1) if need(d) <= free]
    assert sched._lookahead_fit(scheduled, remaining, k, free) == max(fitting, default=1)


def test_can_admit_counts_slots_blocks_and_the_watermark_as_if_ending_sequences_had_finished():
    """``can_admit``: the first waiting request needs a sequence slot and its prompt's blocks plus
    the watermark (1% of 100 blocks = 1); ``ending`` counts running sequences as finished."""
    sched = Scheduler(ChunkedPolicy(), BlockManager(num_blocks=100, block_size=4), max_num_seqs=2,
                      max_num_batched_tokens=1000, max_model_len=1000)
    a, b = make_seq(0, 100, 10), make_seq(1, 256, 10)   # 25 and 64 blocks
    for s in (a, b):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.prefills] == [0, 1] and sched.blocks.num_free_blocks == 11
    assert not sched.can_admit()                         # nobody waits
    c = make_seq(2, 40, 10)                              # 10 blocks: 10 + 1 <= 11 free
    sched.add(c)
    assert not sched.can_admit()                         # both slots taken
    assert sched.can_admit([a]) and sched.can_admit([b])
    sched.waiting[0] = d = make_seq(3, 44, 10)          # 11 blocks: 11 + 1 > 11 free
    d.status = SequenceStatus.WAITING
    sched.max_num_seqs = 3
    assert not sched.can_admit() and sched.can_admit([a])  # a's 25 blocks back: 36 free
