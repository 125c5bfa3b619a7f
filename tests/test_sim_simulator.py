"""The trace simulator against the cost model's own numbers (Qwen3-8B on the H200 profile)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from duetserve.engine.policy import policy_by_name
from duetserve.planner import ModelShape, load_profile
from duetserve.planner.hardware import roofline_only
from duetserve.planner.optimizer import executed_steps
from duetserve.planner.policies import (
    TRIM_AUTO,
    TRIM_BOUNDS,
    TRIM_MIN_SAMPLES,
    TRIM_START,
    DuetPolicy,
    PlannerConfig,
)
from duetserve.sim.simulator import SimConfig, kv_cache_tokens, simulate, weight_bytes
from duetserve.traces import (
    FixedLength,
    TraceRequest,
    TraceSpec,
    UniformLength,
    load_trace,
)

TAU = 0.100


@pytest.fixture(scope="module")
def planner() -> PlannerConfig:
    return PlannerConfig(ModelShape.preset("qwen3-8b"), roofline_only(load_profile("h200")), TAU)


def gaps(result) -> np.ndarray:
    return np.concatenate([np.diff(r.chunk_times_s) for r in result.records])


@pytest.mark.parametrize("policy", ["chunked", "prefill-first", "duet", "pdmux"])
def test_low_load_gives_single_request_latencies(planner, policy):
    # 30 requests at 0.2 req/s, each busy for about 80 ms: almost always alone on the GPU.
    trace = load_trace(None, TraceSpec(qps=0.2, num_requests=30, input_len=FixedLength(1024),
                                       output_len=FixedLength(16), seed=3))
    result = simulate(trace, policy_by_name(policy, planner), SimConfig(planner))
    cm = planner.cost_model
    prefill_s = float(cm.predict_total([(1024, 0)], 132))  # about 19.5 ms
    step_s = float(cm.predict_total([(1, 1032)], 132))  # about 3.8 ms, mid-way through the outputs
    ttft = np.array([r.ttft_s for r in result.records])
    assert np.median(ttft) == pytest.approx(prefill_s, rel=1e-9)
    # pdmux: a prompt arriving while another request decodes is delivered one round (a decode
    # step) after its layers finish (the engine checks as a round starts)
    assert prefill_s * 0.95 <= ttft.mean() <= prefill_s * 1.05 + (step_s if policy == "pdmux" else 0.0)
    assert np.median(gaps(result)) == pytest.approx(step_s, rel=0.01)
    assert all(r.output_tokens == 16 for r in result.records)
    assert result.duration_s == pytest.approx(trace[-1].arrival_s + prefill_s + 15 * step_s, rel=0.01)


def test_overload_prefill_first_stalls_decode_chunked_and_duet_do_not(planner):
    trace = load_trace(None, TraceSpec(qps=30, num_requests=300, input_len=UniformLength(2000, 6000),
                                       output_len=FixedLength(32), seed=1))
    config = SimConfig(planner, max_num_seqs=64)
    runs = {p: gaps(simulate(trace, policy_by_name(p, planner), config)) for p in ("prefill-first", "chunked", "duet")}
    # prefill-first: whole prompts run alone while prompts wait, so decodes stall for seconds
    assert runs["prefill-first"].max() > 1.0 and (runs["prefill-first"] > 0.2).sum() > 100
    # chunked: a gap is never longer than one full-budget mixed iteration (64 decodes + 8128 tokens)
    full = float(planner.cost_model.predict_total([(1, 6032)] * 64 + [(8128, 0)], 132))
    assert TAU < runs["chunked"].max() <= full
    # duet: the optimizer keeps TBT within the SLO
    assert np.percentile(runs["duet"], 99) <= TAU and runs["duet"].max() < runs["chunked"].max()


@pytest.mark.parametrize("hosted", [False, True])
def test_duet_iterations_last_what_the_policy_predicted(planner, hosted):
    """The policy and the clock share one cost model, host terms included (a split's decodes'
    host time before its streams too)."""
    if hosted:
        planner = dataclasses.replace(planner, profile=load_profile("h200"))
    trace = load_trace(None, TraceSpec(qps=20, num_requests=150, input_len=UniformLength(1000, 7000),
                                       output_len=UniformLength(10, 100), seed=2))
    result = simulate(trace, policy_by_name("duet", planner), SimConfig(planner, decode_steps=1))  # all predicted
    spatial = [it for it in result.iterations if it.spatial]
    assert spatial and any(it.k > 1 for it in spatial)
    for it in result.iterations:
        assert it.duration_s == pytest.approx(it.predicted_s, rel=1e-9)


def test_auto_trim_margin_learns_the_simulators_exact_predictions(planner):
    """The simulator reports each temporal iteration with decodes and prefill to the policy, as
    the engine does; its clock is the cost model, so measured / predicted is 1: the automatic
    trim margin rises from 0.7 to 1 and the scale stays 1."""
    trace = load_trace(None, TraceSpec(qps=20, num_requests=150, input_len=UniformLength(1000, 7000),
                                       output_len=UniformLength(10, 100), seed=2))
    policy = DuetPolicy(dataclasses.replace(planner, trim_margin=TRIM_AUTO))
    assert policy.trim_margin == TRIM_START
    result = simulate(trace, policy, SimConfig(planner))
    mixed = [it for it in result.iterations if not it.spatial and it.num_decodes and it.num_prefill_tokens]
    assert len(mixed) >= TRIM_MIN_SAMPLES
    assert policy.trim_margin == pytest.approx(1.0) and policy.temporal_scale == pytest.approx(1.0)


def test_prediction_error_spreads_iterations_lognormally_and_auto_trim_follows(planner):
    """``prediction_error`` 0.05: temporal iterations run their prediction times a lognormal factor
    (log-ratio mean 0, standard deviation 0.05; the same seed gives the same run). Duet's automatic
    margin is then 1 / p99 of the last 256 ratios it saw of iterations predicted at half the SLO or
    more (about 1 / exp(2.33 x 0.05) = 0.89), not 1, and its scale their median."""
    trace = load_trace(None, TraceSpec(qps=20, num_requests=300, input_len=UniformLength(1000, 7000),
                                       output_len=UniformLength(10, 100), seed=2))
    config = SimConfig(planner, prediction_error=0.05, seed=7, decode_steps=1)  # every iteration predicted
    policy = DuetPolicy(dataclasses.replace(planner, trim_margin=TRIM_AUTO))
    result = simulate(trace, policy, config)
    temporal = [it for it in result.iterations if not it.spatial]
    logs = np.log([it.duration_s / it.predicted_s for it in temporal])
    assert len(logs) > 300 and abs(logs.mean()) < 0.01 and logs.std() == pytest.approx(0.05, rel=0.1)
    seen = [it.duration_s / it.predicted_s for it in result.iterations  # as the policy counts them
            if not it.spatial and it.num_decodes and it.num_prefill_tokens
            and it.predicted_s >= TRIM_BOUNDS[0] * planner.tau_s][-256:]
    assert policy.trim_margin == pytest.approx(min(1.0, 1 / np.quantile(seen, 0.99)))
    assert 0.82 < policy.trim_margin < 0.95 and policy.temporal_scale == pytest.approx(np.median(seen))
    # the splits' stream times reach the policy too (observe): its scales left their start of 1
    assert any(it.spatial for it in result.iterations) and policy.cost_model.prefill_scale != 1.0
    assert policy.decode_correction >= 1.0
    again = simulate(trace, DuetPolicy(dataclasses.replace(planner, trim_margin=TRIM_AUTO)), config)
    assert [it.duration_s for it in again.iterations] == [it.duration_s for it in result.iterations]
    for bad in (-0.1, 1000.0, float("nan")):  # 1000 overflowed the clock
        with pytest.raises(ValueError, match=f"prediction_error must be a sigma in \\[0, 1\\], got {bad}"):
            SimConfig(planner, prediction_error=bad)


def test_clock_profile_runs_iterations_off_a_biased_planner(planner):
    """``clock_profile``: iterations take the clock's predictions, the policy plans with its own.
    A clock whose ``decode_interference`` is 1.5x the planner's runs every split's decode steps
    at exactly 1.5x the policy's prediction without its feedback (``Plan.decode_margin`` divided
    out), and duet's per-level corrections learn it; the planner's own profile as the clock
    changes nothing."""
    trace = load_trace(None, TraceSpec(qps=20, num_requests=200, input_len=UniformLength(1000, 7000),
                                       output_len=UniformLength(10, 100), seed=2))
    plain = simulate(trace, DuetPolicy(planner), SimConfig(planner))
    same = simulate(trace, DuetPolicy(planner), SimConfig(planner, clock_profile=planner.profile))
    assert [it.duration_s for it in same.iterations] == [it.duration_s for it in plain.iterations]

    seen = []

    class Recording(DuetPolicy):
        def observe(self, plan, decode_step_s, prefill_s, idle_tail_s=None):
            seen.append((plan.s_decode, decode_step_s / plan.predicted_decode_s * plan.decode_margin))
            super().observe(plan, decode_step_s, prefill_s, idle_tail_s)

    clock = dataclasses.replace(planner.profile, decode_interference=1.5 * planner.profile.decode_interference)
    policy = Recording(planner)
    simulate(trace, policy, SimConfig(planner, clock_profile=clock))
    assert len(seen) > 20 and [b for _, b in seen] == pytest.approx([1.5] * len(seen), rel=1e-9)
    busiest = max({s for s, _ in seen}, key=[s for s, _ in seen].count)
    assert 1.3 < policy.level_corrections[busiest] <= 1.5 and policy.decode_correction > 1.2
    with pytest.raises(ValueError, match="the clock profile 'a100' has 108 SMs, the planner's 'h200' 132"):
        SimConfig(planner, clock_profile=load_profile("a100"))


def test_spatial_iteration_emits_decode_tokens_per_step(planner):
    """A long prompt arriving beside a decoding request: duet splits, decode tokens every t_d,
    and steps start only while half a step of the prefill is left (``executed_steps``)."""
    tight = PlannerConfig(planner.shape, planner.profile, 0.030)
    trace = [TraceRequest(0.0, 200, 300), TraceRequest(0.05, 6000, 2)]
    result = simulate(trace, policy_by_name("duet", tight), SimConfig(tight))
    it = next(it for it in result.iterations if it.spatial)
    assert it.k > 1 and it.num_decodes == 1 and it.num_prefill_tokens == 6000
    a = result.records[0]
    times = np.array(a.chunk_times_s) + a.arrival_s
    before = int((times <= it.start_s + 1e-12).sum())  # tokens "a" had before the split
    inside = times[(times > it.start_s) & (times <= it.start_s + it.duration_s + 1e-12)]
    steps = np.diff(np.concatenate([[it.start_s], inside]))
    # "a" decodes with 199 + before cached tokens: t_p / t_d = 8.42, so 8 steps start (the ninth
    # would start with 0.42 of a step left; ceil would run 9) and the prefill ends the iteration.
    t_d, t_p = (float(x[0]) for x in tight.cost_model.predict_spatial([(1, 199 + before)], [(6000, 0)],
                                                                       [it.s_decode], 132))
    np.testing.assert_allclose(steps, t_d, rtol=1e-9)  # one token per decode step of t_d
    assert t_p / t_d == pytest.approx(8.415, abs=1e-3) and len(inside) == executed_steps(t_d, t_p, it.k) == 8
    assert it.duration_s == pytest.approx(t_p, rel=1e-9)


def test_spatial_iteration_starts_after_the_decodes_host_time(planner):
    """With ``host_per_request_s`` h, a split's first decode token comes h x decodes after the
    iteration's start plus a step, later ones a step apart, and the iteration lasts that host
    time plus the longer stream (the decode steps here): as the planner prices the first step."""
    profile = dataclasses.replace(planner.profile, host_per_request_s=0.002,
                                  provenance={**planner.profile.provenance, "host_per_request_s": "measured"})
    hosted = PlannerConfig(planner.shape, profile, 0.030)
    trace = [TraceRequest(0.0, 200, 300), TraceRequest(0.05, 6000, 2)]
    result = simulate(trace, policy_by_name("duet", hosted), SimConfig(hosted))
    it = next(it for it in result.iterations if it.spatial)
    a = result.records[0]
    times = np.array(a.chunk_times_s) + a.arrival_s
    before = int((times <= it.start_s + 1e-12).sum())
    inside = times[(times > it.start_s) & (times <= it.start_s + it.duration_s + 1e-12)]
    t_d, t_p = (float(x[0]) for x in hosted.cost_model.predict_spatial([(1, 199 + before)], [(6000, 0)],
                                                                        [it.s_decode], 132))
    assert inside[0] - it.start_s == pytest.approx(0.002 + t_d, rel=1e-9)  # one decode: 2 ms of host
    np.testing.assert_allclose(np.diff(inside), t_d, rtol=1e-9)
    assert len(inside) == executed_steps(t_d, t_p, it.k) == 9  # t_p / t_d = 8.53: the ninth step ends last
    assert it.duration_s == pytest.approx(0.002 + 9 * t_d, rel=1e-9) and 9 * t_d > t_p


def test_multi_step_decode_counts_the_host_time_once_and_stops_when_a_request_arrives(planner):
    """``decode_steps`` 4, 2 ms of host time a decode: a decode-only iteration's tokens come at
    h + i g (g the step's GPU time), the iteration lasts ``CostModel.predict_steps``; the iteration
    a request arrives in starts no step after the arrival (step j >= 2 starts at h + (j - 1) g)."""
    profile = dataclasses.replace(planner.profile, host_per_request_s=0.002,
                                  provenance={**planner.profile.provenance, "host_per_request_s": "measured"})
    hosted = PlannerConfig(planner.shape, profile, TAU)
    cm = hosted.cost_model
    alone = simulate([TraceRequest(0.0, 200, 9)], policy_by_name("chunked", hosted), SimConfig(hosted, decode_steps=4))
    assert [it.k for it in alone.iterations] == [1, 4, 4]  # the prefill, then 8 decode steps
    times = np.array(alone.records[0].chunk_times_s)
    for it, cached in zip(alone.iterations[1:], (200, 204)):
        g = float(cm.predict_total([(1, cached)], 132, host=False))
        inside = times[(times > it.start_s + 1e-12) & (times <= it.start_s + it.duration_s + 1e-12)]
        np.testing.assert_allclose(inside - it.start_s, 0.002 + g * np.arange(1, 5), rtol=1e-9)
        assert it.duration_s == pytest.approx(float(cm.predict_steps([(1, cached)], 132, 4)), rel=1e-9)
    # a second request arrives 1.5 steps into the first decode iteration: steps 0-2 start
    # before it (at h, h and h + g), step 3 (at h + 2 g) does not; then both are decoded
    start, g = alone.iterations[1].start_s, float(cm.predict_total([(1, 200)], 132, host=False))
    arrival = start + 0.002 + 1.5 * g
    both = simulate([TraceRequest(0.0, 200, 9), TraceRequest(arrival, 100, 2)], policy_by_name("chunked", hosted),
                    SimConfig(hosted, decode_steps=4))
    first = both.iterations[1]
    assert first.start_s == pytest.approx(start) and first.k == 4
    assert first.duration_s == pytest.approx(0.002 + 3 * g, rel=1e-9)
    assert both.iterations[2].num_prefill_tokens == 100  # the newcomer's prefill comes next
    with pytest.raises(ValueError, match="decode_steps"):
        SimConfig(hosted, decode_steps=0)


def test_host_gap_delays_each_next_iteration_by_the_requests_of_the_last(planner):
    """With ``host_gap_s`` 5 ms and ``host_gap_per_request_s`` 1 ms, each iteration after the
    first starts 5 + 1 x (requests of the one before) ms after it ends, and none follows the
    last: two prompts of 300 and 200 tokens with 3 outputs each run the same three iterations as
    without a gap, each shifted by the gaps before it (2 x 7 ms in all)."""
    gapped = dataclasses.replace(planner.profile, host_gap_s=0.005, host_gap_per_request_s=0.001,
                                 provenance={**planner.profile.provenance, "host_gap_s": "measured",
                                             "host_gap_per_request_s": "measured"})
    trace = [TraceRequest(0.0, 300, 3), TraceRequest(0.0, 200, 3)]
    runs = [simulate(trace, policy_by_name("chunked", config), SimConfig(config, decode_steps=1))
            for config in (planner, PlannerConfig(planner.shape, gapped, TAU))]
    plain, with_gap = (r.iterations for r in runs)
    assert [(it.num_decodes, it.num_prefill_tokens) for it in plain] == [(0, 500), (2, 0), (2, 0)]
    assert [it.duration_s for it in with_gap] == pytest.approx([it.duration_s for it in plain], rel=1e-12)
    shift = 0.0
    for before, ours, theirs in zip([None, *plain], with_gap, plain):
        shift += 0.0 if before is None else 0.005 + 0.001 * 2  # each iteration ran both requests
        assert ours.start_s == pytest.approx(theirs.start_s + shift, abs=1e-12)
    assert runs[1].duration_s == pytest.approx(runs[0].duration_s + 2 * 0.007, abs=1e-12)


def test_multi_step_decode_stops_once_a_finished_request_makes_room_for_a_waiting_one(planner):
    """As the engine (``LLMEngine._interrupted``): with both sequence slots taken, a decode that ends
    at step 1 of an 8-step iteration (2 steps applied) lets steps 0-3 run, not 8, and the waiting
    request's prefill comes next."""
    config = SimConfig(planner, decode_steps=8, max_num_seqs=2)
    trace = [TraceRequest(0.0, 200, 3), TraceRequest(0.0, 200, 20), TraceRequest(0.0, 100, 5)]
    result = simulate(trace, policy_by_name("chunked", planner), config)
    first, decodes, after = result.iterations[:3]
    assert (first.num_decodes, first.num_prefill_tokens) == (0, 400)
    assert (decodes.k, decodes.num_decodes, decodes.num_prefill_tokens) == (8, 2, 0)
    cm = planner.cost_model
    assert decodes.duration_s == pytest.approx(float(cm.predict_steps([(1, 200), (1, 200)], 132, 4)), rel=1e-9)
    assert len(result.records[0].chunk_times_s) == 3 and after.num_prefill_tokens == 100
    assert after.start_s == pytest.approx(decodes.start_s + decodes.duration_s)
    alone = simulate(trace[:2], policy_by_name("chunked", planner), config)  # nobody waits: all 8 steps
    assert alone.iterations[1].duration_s == pytest.approx(float(cm.predict_steps([(1, 200), (1, 200)], 132, 8)))


def test_kv_capacity_from_hbm_minus_weights():
    llama = ModelShape.preset("llama3-8b")
    assert weight_bytes(llama) == 2 * 8_030_261_248  # Llama 3 8B's published parameter count
    qwen = ModelShape.preset("qwen3-8b")
    assert weight_bytes(qwen) / 2 == pytest.approx(8_190_735_360, rel=1e-5)  # q/k norms not counted
    h200 = roofline_only(load_profile("h200"))
    per_token = 36 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x bf16 = 147456 bytes
    assert kv_cache_tokens(qwen, h200) == int((h200.hbm_bytes * 0.9 - weight_bytes(qwen)) // per_token)
    with pytest.raises(ValueError):
        kv_cache_tokens(qwen, h200, utilization=0.1)  # 14.9 GB cannot even hold the 16.4 GB of weights


def test_requests_that_never_fit_are_failed_not_stalled(planner):
    trace = [TraceRequest(0.0, 1000, 10), TraceRequest(0.0, 5000, 10)]
    result = simulate(trace, policy_by_name("chunked"), SimConfig(planner, kv_cache_tokens=4096))
    ok, too_big = result.records
    assert ok.success and ok.output_tokens == 10
    assert not too_big.success and "KV blocks" in too_big.error


def test_requests_over_the_context_limit_fail_as_serve_refuses_them(planner):
    """A prompt plus output over ``max_model_len`` fails with the server's 400 message."""
    trace = [TraceRequest(0.0, 1, 2000), TraceRequest(0.0, 100, 10)]
    result = simulate(trace, policy_by_name("chunked"), SimConfig(planner, max_model_len=1024))
    too_long, ok = result.records
    assert ok.success and not too_long.success
    assert too_long.error == ("max_tokens=2000 plus the 1-token prompt exceeds the maximum context length of "
                              "1024 tokens")


def test_small_kv_cache_preempts_and_still_finishes(planner):
    trace = load_trace(None, TraceSpec(qps=50, num_requests=40, input_len=UniformLength(500, 1500),
                                       output_len=UniformLength(50, 200), seed=4))
    for policy in ("chunked", "duet", "pdmux", "prefill-first"):
        result = simulate(trace, policy_by_name(policy, planner), SimConfig(planner, kv_cache_tokens=6000))
        assert result.num_preemptions > 0
        assert [r.output_tokens for r in result.records] == [r.output_len for r in trace]
