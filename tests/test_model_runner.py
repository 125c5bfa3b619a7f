"""ModelRunner's host-side input packing (no model needed)."""
from __future__ import annotations

import time

import pytest
import torch

from duetserve.engine.model_runner import ModelRunner
from duetserve.engine.upload import upload


def test_upload_packs_segments_at_64_byte_offsets():
    cpu = torch.device("cpu")
    a, b, c, d = upload([[1, 2, 3], [], [4, 5], list(range(9))], torch.int64, cpu)
    assert (a.tolist(), b.tolist(), c.tolist(), d.tolist()) == ([1, 2, 3], [], [4, 5], list(range(9)))
    assert [t.storage_offset() for t in (a, b, c, d)] == [0, 8, 8, 16]  # 8 int64 = 64 bytes
    x, y = upload([[7] * 17, [1]], torch.int32, cpu)
    assert y.storage_offset() == 32 and y.tolist() == [1] and x.dtype == torch.int32
    t, p = upload([[0.5], [0.25, 1.0]], torch.float32, cpu)
    assert p.storage_offset() == 16 and p.tolist() == [0.25, 1.0] and t.dtype == torch.float32
    # numpy segments (block tables, slot mappings) go in by slice assignment, mixed with lists
    import numpy as np
    u, v, w = upload([np.arange(5, dtype=np.int32), [9, 8], np.array([], dtype=np.int64)], torch.int32, cpu)
    assert (u.tolist(), v.tolist(), w.tolist()) == ([0, 1, 2, 3, 4], [9, 8], [])
    assert (v.storage_offset(), w.storage_offset()) == (16, 32)
    with pytest.raises(OverflowError, match="do not fit torch.int32"):
        upload([np.array([1, 2**31 + 5], dtype=np.int64)], torch.int32, cpu)


class FakeStream:
    def __init__(self, name: str):
        self.name, self.waited_for = name, []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_for.append(other.name)


def test_join_leaves_an_unfinished_layer_split_prefill_running():
    """pdmux: after a round whose prefill still has layers left, the main stream waits for the
    decode stream only (the next round's decode must not queue behind the prefill layers)."""
    from duetserve.engine.model_runner import _SpatialRun, _StreamTimers
    from duetserve.engine.policy import Plan
    from duetserve.engine.scheduler import SchedulerOutput

    runner = ModelRunner.__new__(ModelRunner)
    runner._unjoined = None
    for done, expected in ((False, ["decode"]), (True, ["decode", "prefill"])):
        main = FakeStream("main")
        run = _SpatialRun(SchedulerOutput([], [], Plan(), []), FakeStream("decode"), FakeStream("prefill"), main,
                          _StreamTimers(False), None)
        runner.prefill_done = done
        assert runner._join(run) == tuple(expected)
        assert main.waited_for == expected
        assert runner._unjoined is (None if done else run.prefill_stream)  # waited for once the split is dropped


class _Forced:
    """A spatial plan with predicted step and prefill times whenever decodes meet a prefill."""

    name, chunked_prefill, prefill_excludes_decode = "forced", True, False

    def __init__(self, t_d: float, t_p: float):
        self.t_d, self.t_p = t_d, t_p

    def plan(self, decodes, prefills, max_k):
        from duetserve.engine.policy import Plan

        if decodes and prefills:
            return Plan(spatial=True, s_prefill=100, s_decode=32, k=4, predicted_decode_s=self.t_d,
                        predicted_prefill_s=self.t_p, predicted_s=self.t_p)
        return Plan()

    def observe(self, plan, decode_step_s, prefill_s, idle_tail_s=None):
        pass


@pytest.mark.parametrize("t_p, upfront", [(0.2, 2), (0.08, 2), (0.07, 1), (0.01, 1)])
def test_second_decode_step_is_queued_before_a_long_prefill(tiny_qwen3_folder, t_p, upfront):
    """Decode steps queued before the prefill's launch: two when a second step is predicted to
    start beside the prefill (at least half a 50 ms step of it left after the first; its launch
    takes the host a while), else one."""
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine
    from duetserve.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=64, num_kv_blocks=64,
                                    block_size=8, partition_backend="none"))
    engine.scheduler.policy = _Forced(0.05, t_p)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.step()  # "a" prefilled alone: temporal
    engine.add_request("b", list(range(3, 30)), params)
    order, prepare = [], engine.runner._prepare

    def spy(batch, num_decodes, *args, **kwargs):
        order.append("decode" if num_decodes else "prefill")
        return prepare(batch, num_decodes, *args, **kwargs)

    engine.runner._prepare = spy
    engine.step()  # "a" decodes beside "b"'s prefill
    assert order.index("prefill") == upfront


class _FakeEvent:
    """A prefill-end event that fires at the ``fires_after``-th query."""

    def __init__(self, fires_after: int | None):
        self.fires_after, self.queries = fires_after, 0

    def query(self) -> bool:
        self.queries += 1
        return self.fires_after is not None and self.queries >= self.fires_after


def _run_beside_prefill(t_d: float | None, left_s: float | None, event: _FakeEvent):
    from duetserve.engine.model_runner import _SpatialRun, _StreamTimers
    from duetserve.engine.policy import Plan
    from duetserve.engine.scheduler import SchedulerOutput

    plan = Plan(spatial=True, s_prefill=124, s_decode=8, k=8, predicted_decode_s=t_d, predicted_prefill_s=0.2)
    return _SpatialRun(SchedulerOutput([], [], plan, []), None, None, None, _StreamTimers(False), None,
                       prefill_end=event, prefill_due=None if left_s is None else time.perf_counter() + left_s)


def test_a_decode_step_starts_only_with_half_a_step_of_prefill_left():
    """``optimizer.executed_steps`` on the device: with t_d = 40 ms a step starts while 20 ms or more
    of the prefill are predicted to be left; with less, the decodes hold for the prefill's end
    (no step), or for 20 ms at most when the prefill outruns its prediction (then a step)."""
    leaves = ModelRunner._prefill_leaves_a_step
    assert leaves(_run_beside_prefill(0.04, 0.5, _FakeEvent(None)), wait=True)  # far from its end
    assert not leaves(_run_beside_prefill(0.04, 0.5, _FakeEvent(1)), wait=True)  # already ended
    assert leaves(_run_beside_prefill(None, None, _FakeEvent(None)), wait=False)  # no prediction: while it runs

    run = _run_beside_prefill(0.04, 0.01, _FakeEvent(None))  # 10 ms left, never ends
    start = time.perf_counter()
    assert not leaves(run, wait=False)  # undecided: answered without holding
    assert start + 0.02 <= run.hold_until <= time.perf_counter() + 0.02
    assert leaves(run, wait=True)  # held 20 ms, then a step after all
    assert time.perf_counter() >= run.hold_until

    run = _run_beside_prefill(0.04, 0.01, _FakeEvent(4))  # ends while the decodes hold: no step
    assert not leaves(run, wait=True) and run.prefill_end.queries == 4


def test_warm_up_writes_only_the_scratch_block_and_covers_the_prefill_slice_alignments(tiny_qwen3_folder):
    """``warm_up`` (run by the engine at start, again here): forwards after 0, 1 and 2 decodes,
    whose prefill metadata slices start 0, 4 and 8 bytes into ``context_lens`` (aligned, not,
    not) and 0, 8 and 16 bytes into the 2-wide int32 block tables (aligned, not, aligned); every
    cache block but the scratch one keeps its values."""
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), num_kv_blocks=16, block_size=8,
                                    partition_backend="none"))
    runner = engine.runner
    assert runner.scratch_slot == 16 * 8  # the block after the 16 the block manager hands out
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    seen, forward = [], runner.model.forward

    def spy(input_ids, positions, kv_caches, meta):
        nd = meta.num_decodes
        seen.append((nd, meta.context_lens[nd:].storage_offset() * 4 % 16 == 0,
                     meta.block_tables[nd:].storage_offset() * 4 % 16 == 0, meta.context_lens.tolist()))
        return forward(input_ids, positions, kv_caches, meta)

    runner.model.forward = spy
    runner.warm_up()
    assert seen == [(0, True, True, [2]), (1, False, False, [1, 2]), (2, False, True, [1, 1, 2])]
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        assert torch.equal(k[:16], k0[:16]) and torch.equal(v[:16], v0[:16])
        assert not torch.equal(k[16], k0[16])  # the 2-token prefill's keys went to the scratch slot


def test_warm_up_samples_once_with_the_race_kernel_on_aligned_positions(tiny_qwen3_folder):
    """Where the sampler runs the race kernel, ``warm_up`` samples one row through it with
    positions at a 16-byte aligned address, as every step's are (Triton compiles a kernel per
    pointer alignment: a slice 24 bytes into a tensor compiled a variant no step used), and
    releases the seed it drew."""
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine

    runner = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), num_kv_blocks=16, block_size=8,
                                    partition_backend="none")).runner
    calls = []

    def spy(logits, batch, positions=None):
        calls.append((logits.shape[0], batch.race is not None, positions.tolist(),
                      positions.data_ptr() % 16 == 0))
        return torch.zeros(logits.shape[0], dtype=torch.int64)

    runner.sampler.race, runner.sampler.sample = True, spy
    runner.warm_up()
    assert calls == [(1, True, [1], True)]
    assert runner.sampler._seeds == {}


def test_stream_timers_end_gap_is_the_time_between_end_marks():
    """``_StreamTimers.end_gap``: seconds from one stream's end mark to another's, from the events'
    ``elapsed_time`` (ms); None unless both streams were marked. Stand-in events at fixed
    milliseconds (CUDA events need a GPU)."""
    from duetserve.engine.model_runner import _StreamTimers

    class Event:
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, other):
            return other.ms - self.ms

        def synchronize(self):
            pass

    timers = _StreamTimers(False)
    timers.events = {"decode": [Event(1.0), Event(201.0)], "prefill": [Event(2.5), Event(236.5)]}
    assert timers.elapsed(("decode", "prefill")) == {"decode": 0.2, "prefill": 0.234}
    assert timers.end_gap("decode", "prefill") == pytest.approx(0.0355)  # not 0.234 - 0.2: prefill started later
    assert timers.end_gap("prefill", "decode") == pytest.approx(-0.0355)
    assert timers.end_gap("decode", "missing") is None


def test_largest_batch_splits_the_budget_samples_every_prompt_and_writes_only_the_scratch_block(tiny_qwen3_folder):
    """``run_largest_batch(50, 8, 512)``: 8 prompts of 7, 7, 6, 6, 6, 6, 6, 6 tokens in one eager
    forward, all 8 sampled through top-k and top-p; the cache keeps every block but the scratch
    one, the sampler its default generator and no per-request state. More prompts than tokens
    gives one-token prompts; a context limit caps each prompt (and so the total)."""
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine

    runner = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), num_kv_blocks=16, block_size=8,
                                    partition_backend="none")).runner
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    generator = runner.sampler.default_generator.get_state()
    forwards, samples = [], []
    forward, sample = runner.model.forward, runner.sampler.sample

    def spy_forward(input_ids, positions, kv_caches, meta):
        forwards.append((meta.num_decodes, meta.query_lens_cpu, meta.slot_mapping.unique().tolist()))
        return forward(input_ids, positions, kv_caches, meta)

    def spy_sample(logits, batch, positions=None):
        samples.append((logits.shape[0], batch.top_k.tolist(), batch.top_p.flatten().tolist()))
        return sample(logits, batch, positions)

    runner.model.forward, runner.sampler.sample = spy_forward, spy_sample
    assert runner.run_largest_batch(50, 8, 512) == (50, 8, 0)  # peak bytes are counted on CUDA only
    scratch = 16 * 8
    assert forwards == [(0, [7, 7, 6, 6, 6, 6, 6, 6], list(range(scratch, scratch + 7)))]
    assert samples == [(8, [50] * 8, [pytest.approx(0.9)] * 8)]
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        assert torch.equal(k[:16], k0[:16]) and torch.equal(v[:16], v0[:16])
        assert not torch.equal(k[16], k0[16])
    assert torch.equal(runner.sampler.default_generator.get_state(), generator)
    assert runner.sampler._generators == {} and runner.sampler._seeds == {}

    forwards.clear()
    assert runner.run_largest_batch(5, 8, 512) == (5, 5, 0)
    assert forwards == [(0, [1] * 5, [scratch])]
    forwards.clear()
    assert runner.run_largest_batch(50, 3, 12) == (36, 3, 0)
    assert forwards == [(0, [12, 12, 12], list(range(scratch, scratch + 8)))]


@pytest.mark.parametrize("blocks, flag", [(16, "--num-kv-blocks 16"), (None, "--kv-cache-memory-fraction 0.5")])
def test_out_of_memory_after_the_kv_cache_names_the_flag_that_sized_it(tiny_qwen3_folder, monkeypatch, blocks, flag):
    """An out-of-memory while the graphs are recorded, the warm-up runs or the largest
    iteration runs (here the warm-up) becomes a ValueError at start-up that names the flag
    which sized the KV cache and the three that size the iteration and the graphs, with
    torch's first three sentences; so does a library's RuntimeError saying the same
    (cuBLAS' ALLOC_FAILED), while any other RuntimeError passes through."""
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine
    from duetserve.engine.model_runner import ModelRunner

    def oom(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                     "of 139.81 GiB of which 1.06 GiB is free.")

    def cublas(self):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    def other(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    config = EngineConfig(model=str(tiny_qwen3_folder), num_kv_blocks=blocks, block_size=8,
                          kv_cache_memory_fraction=0.5, cpu_kv_cache_bytes=1 << 20, max_model_len=100,
                          max_num_batched_tokens=4096, max_num_seqs=128, partition_backend="none")
    monkeypatch.setattr(ModelRunner, "warm_up", cublas)
    with pytest.raises(ValueError, match=f"^{flag}: the KV cache leaves too little memory .*: CUDA error: "
                                         "CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate"):
        LLMEngine(config)
    monkeypatch.setattr(ModelRunner, "warm_up", other)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        LLMEngine(config)
    monkeypatch.setattr(ModelRunner, "warm_up", oom)
    with pytest.raises(ValueError) as err:
        LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), num_kv_blocks=blocks, block_size=8,
                               kv_cache_memory_fraction=0.5, cpu_kv_cache_bytes=1 << 20, max_model_len=100,
                               max_num_batched_tokens=4096, max_num_seqs=128, partition_backend="none"))
    assert str(err.value) == (f"{flag}: the KV cache leaves too little memory on cpu for the CUDA graphs and the "
                              "largest iteration (--max-num-batched-tokens 4096, --max-num-seqs 128, --max-model-len "
                              "100): CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                              f"139.81 GiB of which 1.06 GiB is free. Lower {flag.split()[0]}, or one of the other "
                              "three")


@pytest.mark.parametrize("policy, bound", [("chunked", 64), ("prefill-first", 99 + 7)])
def test_largest_iteration_bounds_what_the_scheduler_runs(tiny_qwen3_folder, policy, bound):
    """The start-up pass's tokens (``_largest_iteration_tokens``): the 64-token budget where
    prompts are chunked; where they are not (prefill-first), a 99-token prompt (the longest
    a 100-token context allows) runs whole in one iteration, so the bound is 99 + 7 (beside
    up to 7 decodes), not the budget."""
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine
    from duetserve.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), num_kv_blocks=64, block_size=8, max_model_len=100,
                                    max_num_batched_tokens=64, max_num_seqs=8, policy=policy,
                                    partition_backend="none"))
    assert engine._largest_iteration_tokens(engine.scheduler.policy.chunked_prefill) == bound
    engine.add_request("long", list(range(3, 102)), SamplingParams(max_tokens=1, temperature=0.0))
    first = engine.scheduler.schedule()
    assert sum(s.num_new_tokens for s in first.prefills) == (64 if policy == "chunked" else 99) <= bound


def test_largest_iteration_log_counts_the_allocators_unused_cache_as_left(tiny_qwen3_folder, monkeypatch, caplog):
    """``_run_largest_batch`` (run at start-up on CUDA; here on the CPU with CUDA's memory
    queries stood in for): it logs the tokens and prompts the pass ran and, as left, CUDA's
    free memory plus what PyTorch's allocator holds unused (3 + 5 - 4 = 4 GiB)."""
    import logging

    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), num_kv_blocks=64, block_size=8, max_model_len=100,
                                    max_num_batched_tokens=64, max_num_seqs=8, partition_backend="none"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 << 30, 140 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 << 30)
    with caplog.at_level(logging.INFO, logger="duetserve.engine.engine"):
        engine._run_largest_batch(chunked_prefill=True)
    assert caplog.messages == ["the largest iteration (64 tokens over 8 prompts) took 0.00 GiB; 4.00 GiB left "
                               "(free, or held unused by PyTorch's allocator)"]
