"""The pdmux policy: SGLang's levels drive the plans, and a layer-split prefill spans rounds."""
from __future__ import annotations

import math

import pytest

from duetserve.engine.kv_cache import BlockManager
from duetserve.engine.scheduler import Scheduler
from duetserve.engine.sequence import Sequence
from duetserve.planner import ModelShape, load_profile, prefill_layers_per_round
from duetserve.planner.hardware import roofline_only
from duetserve.planner.policies import PdmuxPolicy, PlannerConfig
from duetserve.sampling import SamplingParams
from duetserve.sim.simulator import SimConfig, simulate
from duetserve.traces import TraceRequest

H200_GROUPS = [(132, 0), (112, 20), (104, 28), (96, 36), (88, 44), (80, 52), (72, 60), (0, 132)]


@pytest.fixture(scope="module")
def config() -> PlannerConfig:
    return PlannerConfig(ModelShape.preset("qwen3-8b"), roofline_only(load_profile("h200")), 0.1)


def test_levels_are_sglangs_for_132_sms(config):
    assert PdmuxPolicy(config).groups == H200_GROUPS  # same SM count and architecture as the seed's H100


@pytest.mark.parametrize("decode_bs, split", [(1, (112, 20)), (12, (104, 28)), (18, (96, 36)), (32, (80, 52)),
                                              (36, (72, 60)), (64, (72, 60))])
def test_decode_batch_size_picks_the_level(config, decode_bs, split):
    plan = PdmuxPolicy(config).plan([(1, 1000)] * decode_bs, [(8192, 0)], max_k=50)
    assert plan.spatial and plan.k == 1 and (plan.s_prefill, plan.s_decode) == split
    assert plan.prefill_layers == 8  # 65536 // 8192
    t_d, t_p = config.cost_model.predict_spatial([(1, 1000)] * decode_bs, [(8192, 0)], split[1], 132)
    assert (plan.predicted_decode_s, plan.predicted_prefill_s) == pytest.approx((float(t_d), float(t_p)))
    assert plan.predicted_s == plan.predicted_decode_s  # a round waits only for its decode step


@pytest.mark.parametrize("tokens, layers", [(512, 36), (8192, 8), (32768, 2), (131072, 1)])
def test_prefill_alone_takes_every_sm_and_is_cut_by_layers(config, tokens, layers):
    plan = PdmuxPolicy(config).plan([], [(tokens, 0)], max_k=1)
    assert not plan.spatial and plan.s_prefill == 132 and plan.prefill_layers == layers
    assert prefill_layers_per_round(tokens, 36) == layers


def test_decode_alone_runs_temporally_on_every_sm(config):
    plan = PdmuxPolicy(config).plan([(1, 500)] * 4, [], max_k=1)
    assert not plan.spatial and plan.prefill_layers is None and plan.s_decode == 132


def test_scheduler_pins_a_layer_split_prefill_until_its_last_layer(config):
    sched = Scheduler(PdmuxPolicy(config), BlockManager(2000, 16), 8, 8192, 20_000)
    a = Sequence(0, [5] * 100, 100, SamplingParams(max_tokens=50, ignore_eos=True))
    b = Sequence(1, [5] * 8192, 8192, SamplingParams(max_tokens=5, ignore_eos=True))
    sched.add(a)
    out = sched.schedule()
    sched.postprocess(out, {0: [7]}, prefill_done=True)
    sched.add(b)
    first = out = sched.schedule()
    assert first.plan.spatial and first.plan.prefill_layers == 8 and [s.seq for s in first.prefills] == [b]
    for _ in range(4):  # layers still running: b does not advance, a keeps decoding on its 20 SMs
        sched.postprocess(out, {0: [7], 1: [7]}, prefill_done=False)
        out = sched.schedule()
        assert out.prefills == first.prefills and out.plan == first.plan
        assert b.num_computed_tokens == 0 and b.num_output_tokens == 0
    assert a.num_output_tokens == 5
    sched.postprocess(out, {0: [7], 1: [7]}, prefill_done=True)
    assert b.num_computed_tokens == 8192 and b.num_output_tokens == 1
    out = sched.schedule()
    assert sorted(s.seq.seq_id for s in out.decodes) == [0, 1] and out.prefills == []


def test_simulated_rounds_follow_the_decode_step(config):
    """A decodes alone; B's 8192-token prompt arrives and runs 8 layers per round beside A."""
    trace = [TraceRequest(0.0, 100, 200), TraceRequest(0.1, 8192, 4)]
    result = simulate(trace, PdmuxPolicy(config), SimConfig(config))
    t_d, t_p = (float(x) for x in config.cost_model.predict_spatial([(1, 150)], [(8192, 0)], 20, 132))
    split = [it for it in result.iterations if it.spatial]
    assert {(it.s_decode, it.k, it.num_prefill_tokens) for it in split} == {(20, 1, 8192)}
    # the layers run back to back for t_p; the first round starting after that delivers them
    assert len(split) == math.ceil(t_p / t_d) + 1
    a, b = result.records
    assert t_p + t_d <= b.ttft_s <= t_p + 2 * t_d + 0.005  # + the wait for A's decode step under way at B's arrival
    gaps = a.itls_s
    assert sum(abs(g - t_d) < 0.2e-3 for g in gaps) >= len(split) - 1  # A's steps on 20 SMs during the prefill
    assert b.output_tokens == 4 and a.output_tokens == 200


def test_preempted_layer_split_prefill_restarts_from_its_first_layer(config):
    """B's pinned prefill loses its KV blocks to A's decode; run again later, it costs a full prefill."""
    trace = [TraceRequest(0.0, 111, 50), TraceRequest(0.001, 1000, 5)]  # B is admitted beside A's first decode
    result = simulate(trace, PdmuxPolicy(config), SimConfig(config, kv_cache_tokens=70 * 16))
    assert result.num_preemptions == 1
    a, b = result.records
    a_done = a.arrival_s + a.chunk_times_s[-1]
    alone = float(config.cost_model.predict_total([(1000, 0)], 132))
    assert b.arrival_s + b.ttft_s == pytest.approx(a_done + alone, rel=1e-9)
