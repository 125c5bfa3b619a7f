"""Greedy tokens from our engine equal Hugging Face transformers' ``generate``, token for token."""
from __future__ import annotations

import pytest
import torch

from duetserve.config import EngineConfig
from duetserve.engine.engine import LLMEngine
from duetserve.sampling import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def hf_greedy(folder, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate past EOS, like ignore_eos
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def smollm_prompts(smollm_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_folder)
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village by the sea, there lived an old fisherman who",
             "1, 2, 3, 5, 8,"]
    prompts = [tok.encode(t) for t in texts]
    chat = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about GPUs."}],
                                   add_generation_prompt=True, tokenize=True)
    prompts.append(list(chat) if isinstance(chat, list) else list(chat["input_ids"]))
    long_text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(40))
    prompts.append(tok.encode(long_text + " The colour of item 41 is"))
    return prompts


@pytest.fixture(scope="module")
def smollm_reference(smollm_folder, smollm_prompts):
    return hf_greedy(smollm_folder, smollm_prompts, GREEDY.max_tokens)


def test_smollm_batched_and_chunked_equal_hf(smollm_folder, smollm_prompts, smollm_reference):
    # A 64-token budget splits the ~400-token prompt into many prefill chunks, and prompts of
    # different lengths run batched together with decodes of the others.
    assert max(len(p) for p in smollm_prompts) > 4 * 64
    engine = LLMEngine(EngineConfig(model=str(smollm_folder), max_num_batched_tokens=64, num_kv_blocks=256))
    assert engine.generate(smollm_prompts, GREEDY) == smollm_reference


def test_smollm_with_preemption_equal_hf(smollm_folder, smollm_prompts, smollm_reference):
    # 30 blocks of 16 tokens cannot hold all six sequences at once: some are preempted and
    # recomputed, and the tokens must not change.
    engine = LLMEngine(EngineConfig(model=str(smollm_folder), max_num_batched_tokens=128, num_kv_blocks=30))
    assert engine.generate(smollm_prompts, GREEDY) == smollm_reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 30


def test_tiny_qwen3_equal_hf(tiny_qwen3_folder):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 17, 33, 70)]
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=32, num_kv_blocks=64,
                                    block_size=8))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts, params) == hf_greedy(tiny_qwen3_folder, prompts, 20)


class FakeEndEvent:
    """Stands in for a prefill's end event on a partitioned stream: ``query()`` reports the
    prefill running ``running`` times, then done."""

    def __init__(self, running: int = 2):
        self.running, self.queries = running, 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.running


def force_plan(engine: LLMEngine, plan) -> None:
    """Make ``engine`` run ``plan`` for every iteration with decodes (prefill-only ones as before)."""
    chunked = engine.scheduler.policy
    engine.scheduler.policy = type("Forced", (), {"name": "forced", "chunked_prefill": True,
                                                  "prefill_excludes_decode": False,
                                                  "plan": staticmethod(lambda d, p, k: plan if d else
                                                                       chunked.plan(d, p, k))})()


def test_tiny_qwen3_lookahead_plan_equals_single_steps(tiny_qwen3_folder):
    """A plan with k look-ahead decode steps yields the tokens of k ordinary iterations."""
    from duetserve.engine.policy import Plan

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (9, 30, 41)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=16, num_kv_blocks=64, block_size=8)
    expected = LLMEngine(config).generate(prompts, params)

    engine = LLMEngine(config)
    force_plan(engine, Plan(spatial=True, s_prefill=8, s_decode=8, k=4))
    assert engine.generate(prompts, params) == expected


def test_lookahead_never_runs_past_a_requests_end(tiny_qwen3_folder):
    """k = 8 look-ahead steps while one request has 3 tokens of context left and another has a
    small max_tokens: the extra steps are parked on the scratch slot, nothing indexes past the
    context, and the tokens equal plain iterations'."""
    from duetserve.engine.policy import Plan

    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (36, 5, 20)]
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),  # ends at the context limit (40)
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)]
    config = EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=64, num_kv_blocks=32, block_size=8,
                          max_model_len=40)
    expected = LLMEngine(config).generate(prompts, params)
    engine = LLMEngine(config)
    force_plan(engine, Plan(spatial=True, s_prefill=8, s_decode=8, k=8))
    assert engine.generate(prompts, params) == expected
    assert [len(t) for t in expected] == [3, 30, 2]
    assert engine.block_manager.num_free_blocks == 32


def test_lookahead_tokens_come_out_one_step_at_a_time(tiny_qwen3_folder):
    """A spatial plan's k decode steps reach the caller as k parts with one token per running
    request each (a request stops in the part of its last token), then the prefill's part;
    ``last_stats`` comes with the last part only."""
    from duetserve.engine.policy import Plan

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (12, 7, 25)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),  # ends inside the look-ahead
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)]
    config = EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    expected = LLMEngine(config).generate(prompts, params)
    engine = LLMEngine(config)
    force_plan(engine, Plan(spatial=True, s_prefill=8, s_decode=8, k=4))
    for rid, prompt, p in zip("ab", prompts, params):
        engine.add_request(rid, prompt, p)
    got = {rid: out.new_token_ids for out in engine.step() for rid in [out.request_id]}  # prefill: 1 token each
    engine.add_request("c", prompts[2], params[2])
    parts = []
    for part in engine.step_parts():
        parts.append([(o.request_id, o.new_token_ids, o.finished) for o in part])
        assert (engine.last_stats is not None) == (len(parts) == 5)
    # 4 decode steps: "a" gets a token in each, "b" (2 tokens left) in the first two; then c's prefill.
    assert [[(r, len(ids), fin) for r, ids, fin in part] for part in parts] == [
        [("a", 1, False), ("b", 1, False)], [("a", 1, False), ("b", 1, True)], [("a", 1, False)], [("a", 1, False)],
        [("c", 1, False)]]
    assert engine.last_stats.plan.k == 4 and engine.last_stats.num_decodes == 2 and engine.last_stats.decode_steps == 4
    assert 0 < engine.last_stats.schedule_s < engine.last_stats.duration_s
    for part in parts:
        for rid, ids, _ in part:
            got[rid] = got.get(rid, []) + ids
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert [got[r] for r in "abc"] == expected


def test_decode_stops_starting_steps_once_the_prefill_is_done(tiny_qwen3_folder, monkeypatch):
    """On partitioned streams the executor starts no decode step after the prefill's end event
    has fired (the scheduler reserved k, fewer run), and hands out a step done while it still
    launches the prefill (between its layers); the tokens stay those of plain iterations.
    The partition and the event are faked here: after 2 queries the event reports the prefill
    done; on the CPU each step is done when it is launched."""
    from duetserve.engine import model_runner
    from duetserve.engine.policy import Plan

    launch = model_runner.ModelRunner._launch_spatial

    def launch_partitioned(self, out):
        run = launch(self, out)
        run.partitioned = bool(out.prefills)
        return run

    monkeypatch.setattr(model_runner.ModelRunner, "_launch_spatial", launch_partitioned)
    monkeypatch.setattr(model_runner.ModelRunner, "_prefill_end_event", staticmethod(FakeEndEvent))
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (12, 25)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    expected = LLMEngine(config).generate(prompts, params)
    engine = LLMEngine(config)
    force_plan(engine, Plan(spatial=True, s_prefill=8, s_decode=8, k=8))
    engine.add_request("a", prompts[0], params)
    got = {"a": [t for o in engine.step() for t in o.new_token_ids]}   # prefill of "a"
    engine.add_request("b", prompts[1], params)
    parts = list(engine.step_parts())              # "a" decodes beside b's prefill
    # step 0 is queued before the prefill; between the prefill's 2 layers it is handed out and
    # step 1 queued; after the launch steps 2 and 3 start after queries 1 and 2, none once the
    # event has fired: 4 of the 8 steps reserved.
    assert [[o.request_id for o in part] for part in parts] == [["a"]] * 4 + [["b"]]
    assert engine.last_stats.plan.k == 8 and engine.last_stats.decode_steps == 4
    stats = engine.last_stats
    assert len(stats.handout_s) == 4 and stats.handout_s == sorted(stats.handout_s)
    assert 0 < stats.handout_s[0] < stats.launch_s < stats.handout_s[1] < stats.duration_s  # step 0 came before it
    for part in parts:
        for o in part:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
    assert [got["a"], got["b"]] == expected


def _partitioned_run(monkeypatch, tmp_path, predicted: tuple[float, float] | None, schedule_delay_s: float = 0.0,
                     layers: int = 2):
    """Run "a"'s decodes beside b's prefill (a model of ``layers`` layers) as on partitioned
    streams (faked: the prefill's end event fires after 1 query); ``predicted``: the plan's
    (decode step, prefill) seconds. Returns (parts' request ids, stats, (steps in flight, steps
    launched, ``hold_until``) at each pause between the prefill's layers, and ``marks``: the host
    clock when the launch ended, ``"launched"``, and ``hold_until`` at the join, ``"hold_until"``)."""
    import json
    import time

    from conftest import TINY_QWEN3

    from duetserve.engine import model_runner
    from duetserve.engine.policy import Plan

    seen, marks = [], {}
    launch, launch_prefill = model_runner.ModelRunner._launch_spatial, model_runner.ModelRunner._launch_prefill
    join = model_runner.ModelRunner._join

    def launch_partitioned(self, out):
        run = launch(self, out)
        run.partitioned = bool(out.prefills)
        return run

    def watched(self, run):
        for _ in launch_prefill(self, run):
            seen.append((len(run.inflight), run.launched, run.hold_until))
            yield
        marks["launched"] = time.perf_counter()

    def watched_join(self, run):
        marks["hold_until"] = run.hold_until
        return join(self, run)

    monkeypatch.setattr(model_runner.ModelRunner, "_launch_spatial", launch_partitioned)
    monkeypatch.setattr(model_runner.ModelRunner, "_launch_prefill", watched)
    monkeypatch.setattr(model_runner.ModelRunner, "_join", watched_join)
    monkeypatch.setattr(model_runner.ModelRunner, "_prefill_end_event", staticmethod(lambda: FakeEndEvent(running=1)))
    (tmp_path / "config.json").write_text(json.dumps({**TINY_QWEN3, "num_hidden_layers": layers}))
    config = EngineConfig(model=str(tmp_path), max_num_batched_tokens=64, num_kv_blocks=64, block_size=8,
                          load_format="dummy")
    engine = LLMEngine(config)
    t_d, t_p = predicted if predicted else (None, None)
    force_plan(engine, Plan(spatial=True, s_prefill=8, s_decode=8, k=8, predicted_decode_s=t_d,
                            predicted_prefill_s=t_p))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 15)), params)
    engine.step()  # a's prefill
    engine.add_request("b", list(range(3, 28)), params)
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: time.sleep(schedule_delay_s) or schedule()
    parts = [[o.request_id for o in part] for part in engine.step_parts()]
    return parts, engine.last_stats, seen, marks


def test_steps_are_handed_out_and_queued_between_the_prefill_layers(monkeypatch, tmp_path):
    """Without predictions, between each two of the prefill's 4 layers the step done is handed
    out and the next queued, one in flight at a time (steps 1-3), none after the last layer;
    after the launch one query finds the prefill running (step 4 starts), the next finds it done."""
    parts, stats, seen, marks = _partitioned_run(monkeypatch, tmp_path, None, layers=4)
    assert seen == [(1, 1, None), (1, 2, None), (1, 3, None)]  # before each pause: step j in flight
    assert parts == [["a"]] * 5 + [["b"]] and stats.decode_steps == 5
    assert stats.handout_s[2] < stats.launch_s < stats.handout_s[3]  # steps 0-2 during the launch
    assert marks["hold_until"] is None  # without predictions the decodes never hold


def test_no_hold_begins_while_the_prefill_is_launched(monkeypatch, tmp_path):
    """With the prefill predicted to end within half a step (0.1 ms left of 1 s steps), no step
    starts beside it during its launch, and the hold (``hold_until``) begins only after the
    launch: then the faked event's second query says the prefill is done, so only step 0 ran."""
    parts, stats, seen, marks = _partitioned_run(monkeypatch, tmp_path, (1.0, 1e-4), layers=3)
    assert seen == [(1, 1, None), (0, 1, None)]  # step 0 handed out, nothing started, no hold
    assert marks["hold_until"] > marks["launched"]  # the hold began after the launch
    assert parts == [["a"], ["b"]] and stats.decode_steps == 1


def test_launch_s_counts_from_the_iteration_start(monkeypatch, tmp_path):
    """``launch_s`` and ``handout_s`` share a base, the iteration's start (scheduling included):
    with 0.2 s of scheduling, step 0 (handed out during the launch) still comes before it."""
    _, stats, _, _ = _partitioned_run(monkeypatch, tmp_path, None, schedule_delay_s=0.2)
    assert stats.schedule_s >= 0.2
    assert stats.schedule_s < stats.handout_s[0] < stats.launch_s < stats.handout_s[1] < stats.duration_s


def test_the_policy_sees_the_wall_time_of_temporal_iterations_with_decodes_and_prefill(tiny_qwen3_folder):
    """``Policy.observe_iteration`` (duet's ``--trim-margin auto`` learns from it) gets the plan
    and the iteration's measured seconds (its ``StepStats.duration_s``), and only for temporal
    iterations that hold both decodes and prefill."""
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=64, num_kv_blocks=64,
                                    block_size=8))
    seen = []
    engine.scheduler.policy.observe_iteration = lambda plan, measured_s: seen.append((plan, measured_s))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 15)), params)
    engine.step()  # a's prefill alone
    assert seen == []
    engine.add_request("b", list(range(3, 28)), params)
    engine.step()  # a decodes beside b's prefill
    stats = engine.last_stats
    assert stats.num_decodes == 1 and stats.num_prefill_tokens == 25
    assert seen == [(stats.plan, stats.duration_s)] and not stats.plan.spatial
    engine.step()  # decodes only
    assert len(seen) == 1


def test_gap_s_is_the_host_time_since_the_last_iteration_while_work_was_left(tiny_qwen3_folder):
    """``StepStats.gap_s``: None for an iteration after the engine ran out of work (or its first),
    else the wall seconds since the iteration before ended, which ``duration_s`` leaves out."""
    import time

    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=64, num_kv_blocks=64,
                                    block_size=8, num_decode_steps=1))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 15)), params)
    engine.step()
    assert engine.last_stats.gap_s is None  # the first iteration
    time.sleep(0.05)  # host time between two iterations, work left
    engine.step()
    assert 0.05 <= engine.last_stats.gap_s < 0.5
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", list(range(3, 9)), params)
    engine.step()
    assert engine.last_stats.gap_s is None  # the engine had run out of work
    engine.abort("b")  # work left after the step, then aborted: the engine idles again
    engine.add_request("c", list(range(3, 9)), params)
    engine.step()
    assert engine.last_stats.gap_s is None


def test_multi_step_decode_gives_single_step_tokens_and_stops_for_new_work(tiny_qwen3_folder):
    """``num_decode_steps=4``: decode-only iterations run 4 steps (one output per step; a request
    ends inside one), the tokens equal single steps'; an interrupt (new work waiting) stops an
    iteration after the steps already queued."""
    import dataclasses

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (7, 19, 30)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (14, 6, 9)]
    config = EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    expected = LLMEngine(config).generate(prompts, params)
    engine = LLMEngine(dataclasses.replace(config, num_decode_steps=4))
    assert engine.generate(prompts, params) == expected
    assert engine.block_manager.num_free_blocks == 64

    engine.add_request("a", prompts[0], params[0])
    engine.step()                                   # prefill
    parts = list(engine.step_parts())               # no interrupt: 4 steps
    assert [len(p) for p in parts] == [1, 1, 1, 1, 0] and engine.last_stats.plan.k == 4
    queries = []
    engine.set_interrupt(lambda: queries.append(1) or len(queries) >= 2)
    parts = list(engine.step_parts())               # step 0 queued, step 1 after query 1, stop at query 2
    assert [len(p) for p in parts] == [1, 1, 0] and engine.last_stats.plan.k == 4
    assert engine.last_stats.decode_steps == 2
    engine.set_interrupt(lambda: False)
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == 64


def test_multi_step_decode_stops_when_a_finished_request_makes_room_for_a_waiting_one(tiny_qwen3_folder):
    """With every sequence slot taken, a waiting request is admitted once a running one ends: a
    multi-step decode iteration starts no step after that (``Scheduler.can_admit``), so the
    request does not wait for the iteration's last step. On a CPU a step starts after the engine
    has applied the one before (on CUDA two run ahead, as the simulator's ``_room_steps`` counts)."""
    config = EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=64, num_kv_blocks=64, block_size=8,
                          max_num_seqs=2, num_decode_steps=8)
    engine = LLMEngine(config)
    short, long = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 30))
    engine.add_request("a", list(range(3, 10)), short)
    engine.add_request("c", list(range(3, 12)), long)
    engine.step()                                   # both prefills (one token each)
    engine.add_request("b", list(range(3, 14)), long)
    assert not engine.scheduler.can_admit()         # two running, two slots
    outputs = engine.step()                         # a ends at step 1: no step 2
    assert engine.last_stats.plan.k == 8 and engine.last_stats.decode_steps == 2
    assert [o.request_id for o in outputs if o.finished] == ["a"]
    assert engine.scheduler.can_admit()
    engine.step()
    assert engine.last_stats.num_prefill_tokens == 11  # b admitted next
    engine.set_interrupt(lambda: False)
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == 64


def test_a_cpu_multi_step_decode_hands_out_each_step_before_running_the_next(tiny_qwen3_folder, monkeypatch):
    """On a CPU a launch runs the step at once: queued one step ahead (as on CUDA), a step's tokens
    waited for the next one to run, and clients got them in bursts. Each part now comes out with
    exactly the steps run so far."""
    from duetserve.engine import model_runner

    runs = []
    sample = model_runner.ModelRunner._sample
    monkeypatch.setattr(model_runner.ModelRunner, "_sample", lambda self, *a: runs.append(1) or sample(self, *a))
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=64, num_kv_blocks=64,
                                    block_size=8))
    engine.add_request("a", list(range(3, 15)), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    engine.step()                                   # prefill
    runs.clear()
    seen = [len(runs) for part in engine.step_parts() if part]
    assert seen == [1, 2, 3, 4, 5, 6, 7, 8] and engine.last_stats.decode_steps == 8


def test_a_seeded_request_aborted_inside_a_lookahead_keeps_no_generator(tiny_qwen3_folder):
    """The decodes' sampling parameters are uploaded once per iteration: a seeded request that
    ends between two look-ahead steps is not given a new generator by the later steps."""
    from duetserve.engine.policy import Plan

    config = EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    engine = LLMEngine(config)
    force_plan(engine, Plan(spatial=True, s_prefill=8, s_decode=8, k=4))
    engine.add_request("a", list(range(5, 20)), SamplingParams(max_tokens=30, temperature=0.8, seed=3))
    engine.step()                                   # prefill
    parts = engine.step_parts()
    next(parts)                                     # step 0 delivered
    engine.abort("a")
    assert engine.sampler._generators == {}
    for _ in parts:                                 # the other steps run and are dropped
        pass
    assert engine.sampler._generators == {} and not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == 64


def test_abort_returns_the_text_held_back_for_stop_strings(smollm_folder):
    """An aborted request's last output carries the text the detokenizer held back for a stop
    string, so the texts streamed before it and it add up to the decoded tokens."""
    engine = LLMEngine(EngineConfig(model=str(smollm_folder), max_num_batched_tokens=64, num_kv_blocks=64,
                                    num_decode_steps=1))  # a token a step
    stop = "\x01" * 40  # never generated: up to 39 characters are held back
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop])
    engine.add_request("a", engine.tokenizer.encode("The sea is"), params)
    ids, text = [], ""
    for _ in range(6):
        for out in engine.step():
            ids += out.new_token_ids
            text += out.new_text
    last = engine.abort("a")
    assert (last.finished, last.finish_reason, last.new_token_ids) == (True, "abort", [])
    assert last.num_output_tokens == len(ids) == 6
    assert len(last.new_text) > 0 and text + last.new_text == engine.tokenizer.decode(ids)
    assert engine.abort("a") is None and not engine.has_unfinished()
