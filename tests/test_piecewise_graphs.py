"""Piecewise graphs' bookkeeping on the CPU: pieces recorded by a stand-in that replays them eagerly
into the same output tensors (what a CUDA graph does), checked against the model's own forward."""
from __future__ import annotations

import pytest
import torch

from duetserve.engine.piecewise_graphs import PiecewiseGraphs, piecewise_buckets


def test_buckets():
    assert piecewise_buckets(1024) == [16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024]
    assert piecewise_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert piecewise_buckets(100) == [16, 32, 64, 100]
    assert piecewise_buckets(10) == [10]
    assert piecewise_buckets(700) == [16, 32, 64, 128, 256, 384, 512, 640, 700]
    assert piecewise_buckets(0) == []


def eager_recorder(fn):
    """Records ``fn`` as a CUDA graph would behave: replay leaves new outputs in the first call's
    tensors. Recording must run with the cyclic garbage collector paused (``collection_paused``)."""
    import gc

    assert not gc.isenabled()
    outputs = fn()

    def replay():
        for out, new in zip(outputs, fn()):
            out.copy_(new)
    return replay, outputs


def _batch(engine, specs, seed=0):
    """ScheduledSeqs of random tokens: ``(cached, new)`` per sequence, decodes (new == 1) first."""
    from duetserve.engine.scheduler import ScheduledSeq
    from duetserve.engine.sequence import Sequence
    from duetserve.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (cached, new) in enumerate(specs):
        ctx = cached + new
        tokens = torch.randint(0, 100, (ctx,), generator=g).tolist()
        seq = Sequence(100 + i, tokens, ctx - 1 if new == 1 else ctx, SamplingParams(temperature=0.0))
        seq.num_computed_tokens = cached
        engine.block_manager.allocate(seq, ctx)
        out.append(ScheduledSeq(seq, new, cached))
    return out


@pytest.fixture(scope="module")
def engine(tiny_qwen3_folder):
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), num_kv_blocks=32, block_size=8,
                                    partition_backend="none"))
    assert engine.piecewise is None  # recorded on CUDA only
    return engine


def test_replayed_pieces_equal_the_forward_and_write_only_real_and_scratch_slots(engine):
    """A 25-token batch in the 32-token bucket, then a 20-token one (its padding rows held the
    first batch's slots, in blocks the second batch reuses), then two decodes (contexts 5, 12) and
    two prefill chunks (7 new after 3 cached, 4 new from scratch) in the 16-token bucket: the
    hidden states equal ``CausalLM.forward``'s, the caches equal its caches except the scratch
    block, which the padding tokens wrote."""
    runner, model = engine.runner, engine.model
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    graphs = PiecewiseGraphs(model, runner.kv_caches, 40, runner.scratch_slot, torch.device("cpu"))
    assert graphs.bucket(5) is None  # nothing recorded yet
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    graphs.capture(eager_recorder)
    scratch = runner.scratch_slot // runner.block_size
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):  # recording wrote the scratch block only
        assert torch.equal(k[:scratch], k0[:scratch]) and not torch.equal(k[scratch], k0[scratch])
        assert torch.equal(v[:scratch], v0[:scratch]) and not torch.equal(v[scratch], v0[scratch])
    assert [graphs.bucket(n) for n in (1, 13, 16, 17, 33, 40, 41)] == [16, 16, 16, 32, 40, 40, None]
    for specs, bucket in (([(6, 1), (0, 24)], 32), ([(4, 1), (11, 1), (3, 7), (0, 11)], 32),
                          ([(4, 1), (11, 1), (3, 7), (0, 4)], 16)):
        batch = _batch(engine, specs)
        nd = sum(new == 1 for _, new in specs)
        inputs = runner._prepare(batch, nd, [None] * len(batch))
        ref_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        with torch.inference_mode():
            want = model(inputs.input_ids, inputs.positions, ref_caches, inputs.meta)
            got = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        n = inputs.input_ids.shape[0]
        assert graphs.bucket(n) == bucket and got.shape == want.shape == (n, model.dims.hidden_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for (k, v), (k0, v0) in zip(runner.kv_caches, ref_caches):
            torch.testing.assert_close(k[:scratch], k0[:scratch], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[:scratch], v0[:scratch], rtol=1e-5, atol=1e-5)
        for s in batch:
            engine.block_manager.free(s.seq)
    with pytest.raises(ValueError, match="no piecewise graph holds 41 tokens"):
        graphs.run(torch.zeros(41, dtype=torch.int64), torch.zeros(41, dtype=torch.int64), inputs.meta)


def test_runner_samples_mixed_batches_through_the_piecewise_graphs(engine):
    """``ModelRunner._sample``: a mixed batch goes through the piecewise graphs (greedy tokens as
    eager), a decode-only one does not; a batch above the largest bucket runs eagerly."""
    runner = engine.runner
    graphs = PiecewiseGraphs(engine.model, runner.kv_caches, 16, runner.scratch_slot, torch.device("cpu"))
    graphs.capture(eager_recorder)
    calls = []
    run = graphs.run
    graphs.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    for specs, used in (([(5, 1), (2, 9)], [10]), ([(5, 1), (8, 1)], []), ([(5, 1), (0, 20)], [])):
        batch = _batch(engine, specs, seed=1)
        nd = sum(new == 1 for _, new in specs)
        inputs = runner._prepare(batch, nd, [None] * len(batch))
        runner.piecewise = None
        with torch.inference_mode():  # as ModelRunner's callers run it
            want = runner._sample(inputs, None).tolist()
            runner.piecewise, calls[:] = graphs, []
            try:
                got = runner._sample(inputs, None).tolist()
            finally:
                runner.piecewise = None
        assert got == want and len(got) == len(specs) and calls == used
        for s in batch:
            engine.block_manager.free(s.seq)


def test_collection_paused_collects_dead_cycles_first_and_none_inside():
    """Graph captures run with the cyclic collector off, after one collection: a dead earlier
    engine (a reference cycle holding graphs) must not be freed in the middle of a capture."""
    import gc
    import weakref

    from duetserve.engine.cuda_graphs import collection_paused

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    dead = cycle()
    assert gc.isenabled() and dead() is not None  # only the collector frees a cycle
    with collection_paused():
        assert dead() is None and not gc.isenabled()
        inside = cycle()
        kept = [Node() for _ in range(10_000)]  # allocations that would trigger automatic collections
        assert inside() is not None and len(kept) == 10_000
    assert gc.isenabled()
