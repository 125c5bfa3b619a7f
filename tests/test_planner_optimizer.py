"""Partition optimizer: hand-checked plans on a stand-in cost model, then the real model.

``RoundCost`` stands in for ``CostModel`` with times that are easy to follow by hand on a
100-SM GPU: a decode step on S_d SMs takes 0.4 / S_d s (10 SMs: 40 ms, 20 SMs: 20 ms), the
prefill batch on S_p SMs 9.0 / S_p s (80 SMs: 112.5 ms), and a temporal mixed batch on all
SMs 10 ms + 0.1 ms per prefill token, with no host time before a split's first decode step
(``profile.host_per_request_s`` 0). Batches: 4 decode requests, one 1000-token prefill.
"""

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest

from duetserve.planner.cost_model import CostModel, ModelShape
from duetserve.planner.hardware import load_profile, roofline_only
from duetserve.planner.optimizer import (
    Plan,
    executed_steps,
    plan_iteration,
    trim_prefill,
)

DECODE = [(1, 500)] * 4
PREFILL = [(1000, 0)]


class RoundCost:
    def __init__(self, host_per_request_s: float = 0.0):
        self.profile = SimpleNamespace(host_per_request_s=host_per_request_s)

    def predict_total(self, reqs, sms):
        return np.asarray(0.01 + 1e-4 * sum(q for q, _ in reqs if q > 1))

    def predict_variants(self, fixed_reqs, q, c, sms):
        return 0.01 + 1e-4 * q.sum(axis=0)

    def predict_spatial(self, decode_reqs, prefill_reqs, s_decode, total_sms):
        return 0.4 / s_decode, 9.0 / (total_sms - s_decode)


def plan(tau, **kw):
    return plan_iteration(RoundCost(), DECODE, PREFILL, tau, total_sms=100, granularity=10, **kw)


def test_temporal_when_mixed_batch_meets_tau():
    # mixed: 10 ms + 1000 * 0.1 ms = 110 ms <= 120 ms
    assert plan(0.120) == Plan(False, 100, 100, 1, 0.11, 0.11, 0.11)


def test_trim_margin_also_bounds_an_untrimmed_temporal_batch():
    # tau = 120 ms fits the 110 ms mixed batch, but 0.8 tau = 96 ms does not: the batch is priced
    # as a split and as trimmed. Best split S_d = 10, k = 2 (t_d 40 ms, t_p 100 ms); the engine runs
    # 3 steps there (120 ms): (3 * 4 + 1000) / 0.120 = 8433 tok/s. Trimmed to 10 ms + 0.1 ms * m
    # <= 96 ms: m = 860, (4 + 860) / 0.096 = 9000 tok/s, so the trimmed batch runs.
    p = plan(0.120, trim_margin=0.8)
    assert (p.spatial, p.slo_risk) == (False, False) and p.prefill_token_limit in (859, 860)
    assert p.trim_rates == pytest.approx((9000, 1012 / 0.120), rel=2e-3)
    assert plan(0.120, trim_margin=0.95) == Plan(False, 100, 100, 1, 0.11, 0.11, 0.11)  # 110 <= 114 ms
    # without decodes no token waits on the batch: the margin does not apply
    assert not plan_iteration(RoundCost(), [], PREFILL, 0.120, 100, 10, trim_margin=0.8).prefill_token_limit


def test_infeasible_decode_partition_is_skipped_and_floor_k_chosen():
    # tau = 45 ms. S_d = 10: t_d = 40 ms, t_p(90) = 100 ms, k = 2 would give (8 + 1000) / 0.100 =
    #   10080 tok/s, but its tail gap 100 - 80 + 40 = 60 ms > tau; k = 3: 1012 / 0.120 = 8433.
    # S_d = 20: t_d = 20 ms, t_p(80) = 112.5 ms, floor = 5: gap 32.5 ms, 1020 / 0.1125 = 9067 (best);
    #   k = 6: 1024 / 0.120 = 8533.  S_d = 30: k = 9: 1036 / 0.12857 = 8058.
    p = plan(0.045)
    assert (p.spatial, p.s_decode, p.s_prefill, p.k) == (True, 20, 80, 5)
    assert p.predicted_s == pytest.approx(0.1125)
    assert (p.predicted_decode_s, p.predicted_prefill_s) == pytest.approx((0.020, 0.1125))
    assert not p.slo_risk and p.prefill_token_limit is None


def test_decode_partition_over_tau_is_never_chosen():
    # tau = 25 ms: S_d = 10 (40 ms) is infeasible although its rate would be the highest.
    # S_d = 20: k = 5 leaves a 32.5 ms tail gap > tau, so k = floor + 1 = 6: 1024 / 0.120 = 8533;
    # S_d = 30: k = 9, gap 128.57 - 120 + 13.33 = 21.9 ms: 1036 / 0.12857 = 8058.
    p = plan(0.025)
    assert (p.s_decode, p.k) == (20, 6)
    assert p.predicted_s == pytest.approx(0.120)


def test_k_is_capped_by_max_k():
    # tau = 25 ms, max_k = 3: S_d = 20 runs 3 steps beside 112.5 ms of prefill (no tokens left to
    # wait, so no tail-gap check): 1012 / 0.1125 = 8996; S_d = 30: 1012 / 0.12857 = 7871.
    p = plan(0.025, max_k=3)
    assert (p.s_decode, p.k) == (20, 3)
    assert p.predicted_s == pytest.approx(0.1125)


def test_min_sms_limits_the_enumeration():
    p = plan(0.045, min_sms=30)
    assert p.s_decode == 30 and p.k == 9  # 1036 / 0.12857 beats k = 10: 1040 / 0.1333


def test_fallback_when_no_partition_meets_tau():
    # tau = 3 ms: even S_d = 90 gives 4.4 ms. Temporal fallback: 10 ms + 0.1 ms * m <= 50.5 ms -> m = 405
    p = plan_iteration(RoundCost(), DECODE, PREFILL, 0.0505, total_sms=100, granularity=10, min_sms=90)
    assert (p.spatial, p.prefill_token_limit, p.slo_risk) == (False, 405, True)
    p = plan(0.003)
    assert (p.prefill_token_limit, p.slo_risk) == (0, True)  # decode alone (10 ms) already breaks tau


def test_trim_prefill():
    assert trim_prefill([(300, 0), (500, 100), (200, 0)], 600) == [(300, 0), (300, 100)]
    assert trim_prefill([(300, 0)], 0) == []
    assert trim_prefill([(300, 0)], 1000) == [(300, 0)]


@pytest.fixture(scope="module")
def qwen_h200():
    return CostModel(ModelShape.preset("qwen3-8b"), roofline_only(load_profile("h200")))


def test_real_model_plan_matches_brute_force(qwen_h200):
    cm, tau, total = qwen_h200, 0.030, 132
    decode = [(1, 1000 + 50 * i) for i in range(64)]
    prefill = [(8192, 0)]
    assert cm.predict_total(decode + prefill, total) > tau
    p = plan_iteration(cm, decode, prefill, tau, total, granularity=8)
    assert p.spatial and p.s_decode % 8 == 0 and p.s_decode + p.s_prefill == total
    t_d, t_p = cm.predict_spatial(decode, prefill, p.s_decode, total)
    assert p.k in (max(1, math.floor(t_p / t_d)), math.floor(t_p / t_d) + 1)
    # brute force over every S_d and every k from 1 to 200 under the same constraints
    best = None
    for s_d in range(8, total - 8 + 1, 8):
        t_d, t_p = (float(x) for x in cm.predict_spatial(decode, prefill, s_d, total))
        for k in range(1, 201):
            if t_d > tau or max(t_p - k * t_d, 0) + t_d > tau:
                continue
            rate = (k * 64 + 8192) / max(k * t_d, t_p)
            if best is None or rate > best[0]:
                best = (rate, s_d, k)
    assert (p.s_decode, p.k) == best[1:]


def test_real_model_fallback_limit_fits_tau(qwen_h200):
    cm, tau = qwen_h200, 0.030
    decode = [(1, 8192)] * 64  # 64 long decodes: about 23 ms on all SMs, too slow on any partition
    prefill = [(2048, 0), (2048, 1024)]
    p = plan_iteration(cm, decode, prefill, tau, 132, granularity=8)
    assert not p.spatial and p.slo_risk
    limit = p.prefill_token_limit
    assert 0 < limit < 4096
    assert cm.predict_total(decode + trim_prefill(prefill, limit), 132) <= tau
    assert cm.predict_total(decode + trim_prefill(prefill, limit + 1), 132) > tau
    assert p.predicted_s == pytest.approx(float(cm.predict_total(decode + trim_prefill(prefill, limit), 132)))


def test_edge_batches_and_bad_arguments(qwen_h200):
    only_prefill = plan_iteration(qwen_h200, [], [(16384, 0)], 0.05, 132, 8)
    assert not only_prefill.spatial and not only_prefill.slo_risk
    heavy = [(1, 32768)] * 128
    only_decode = plan_iteration(qwen_h200, heavy, [], 0.01, 132, 8)
    assert not only_decode.spatial and only_decode.slo_risk and only_decode.prefill_token_limit is None
    for kw in ({"tau": 0}, {"granularity": 0}, {"max_k": 0}, {"min_sms": 0}):
        args = {"tau": 0.05, "granularity": 8, **kw}
        with pytest.raises(ValueError):
            plan_iteration(qwen_h200, DECODE, PREFILL, total_sms=132, **args)


def test_fallback_matches_a_scan_of_trimmed_batches(qwen_h200):
    cm, rng = qwen_h200, np.random.default_rng(7)
    for _ in range(5):
        decode = [(1, int(c)) for c in rng.integers(6000, 12000, size=int(rng.integers(100, 160)))]
        prefill = [(int(q), int(c)) for q, c in zip(rng.integers(1, 3000, size=3), rng.integers(0, 4000, size=3))]
        tau = float(cm.predict_total(decode, 132)) * rng.uniform(0.9, 1.6)
        p = plan_iteration(cm, decode, prefill, tau, 132, granularity=8)
        assert not p.spatial and p.slo_risk  # long decodes: no partition keeps decode under tau
        fits = [m for m in range(sum(q for q, _ in prefill) + 1)
                if cm.predict_total(decode + trim_prefill(prefill, m), 132) <= tau]
        assert p.prefill_token_limit == (max(fits) if fits else 0)


def test_predict_variants_equals_trimmed_batches(qwen_h200):
    decode, prefill = [(1, 3000)] * 8, [(700, 0), (500, 1200)]
    limits = [0, 1, 699, 700, 701, 1200]
    q = np.array([[min(700, m), min(500, max(0, m - 700))] for m in limits]).T
    got = qwen_h200.predict_variants(decode, q, np.array([0, 1200]), 100)
    want = [float(qwen_h200.predict_total(decode + trim_prefill(prefill, m), 100)) for m in limits]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_carried_wait_tightens_the_first_token_budget(qwen_h200):
    """A previous spatial plan left decodes waiting ``carry``: this iteration's first token
    must come within tau - carry, so a batch that fits tau alone is no longer temporal."""
    decode, prefill, tau = [(1, 2047)] * 32, [(1024, 0)], 0.1
    alone = plan_iteration(qwen_h200, decode, prefill, tau, 132, 8)
    assert not alone.spatial and not alone.slo_risk and alone.predicted_s <= tau
    carry = tau - alone.predicted_s / 2  # leaves half of the mixed batch's time
    carried = plan_iteration(qwen_h200, decode, prefill, tau, 132, 8, carry_s=carry)
    if carried.spatial:
        assert carried.predicted_decode_s + carry <= tau
    else:
        assert carried.slo_risk and carried.prefill_token_limit is not None
        assert carried.predicted_s + carry <= tau or carried.prefill_token_limit == 0


def test_first_decode_step_of_a_split_pays_the_host_time():
    """The first step must fit ``t_d + R h_r`` into tau: at tau = 45 ms S_d = 20 (t_d 20 ms) wins
    with no host time (see above). With 6.5 ms per decode request (26 ms for 4) its first token
    would come at 46 ms, so only S_d >= 30 remain (13.3 + 26 ms fits); with 10 ms a request
    (40 ms) only S_d >= 80 (t_d <= 5 ms); with 12 ms (48 ms) none, and the fallback runs."""
    base = plan_iteration(RoundCost(), DECODE, PREFILL, 0.045, total_sms=100, granularity=10)
    assert base.spatial and base.s_decode == 20
    hosted = plan_iteration(RoundCost(0.0065), DECODE, PREFILL, 0.045, total_sms=100, granularity=10)
    assert hosted.spatial and hosted.s_decode >= 30
    tight = plan_iteration(RoundCost(0.010), DECODE, PREFILL, 0.045, total_sms=100, granularity=10)
    assert tight.spatial and tight.s_decode >= 80 and tight.predicted_decode_s + 0.040 <= 0.045
    none = plan_iteration(RoundCost(0.012), DECODE, PREFILL, 0.045, total_sms=100, granularity=10)
    assert not none.spatial and none.slo_risk  # 48 ms of host alone: the fallback


def test_duet_policy_carries_the_idle_tail_of_a_spatial_plan(qwen_h200):
    from duetserve.planner.policies import DuetPolicy, PlannerConfig

    policy = DuetPolicy(PlannerConfig(ModelShape.preset("qwen3-8b"), roofline_only(load_profile("h200")), 0.1))
    spatial = policy.plan([(1, 2047)] * 32, [(8192, 0)], max_k=2)  # k capped below t_p / t_d: decode idles at the end
    assert spatial.spatial and spatial.predicted_prefill_s > spatial.k * spatial.predicted_decode_s
    assert policy.carry_s == pytest.approx(spatial.predicted_prefill_s - spatial.k * spatial.predicted_decode_s)
    policy.plan([(1, 2047)] * 32, [], max_k=4)  # decode only: temporal, nothing carried
    assert policy.carry_s == 0.0
    # a measured wait replaces the predicted one
    spatial = policy.plan([(1, 2047)] * 32, [(8192, 0)], max_k=2)
    policy.observe(spatial, spatial.predicted_decode_s, spatial.predicted_prefill_s, idle_tail_s=0.031)
    assert policy.carry_s == 0.031
    policy.observe(spatial, spatial.predicted_decode_s, spatial.predicted_prefill_s)  # not measured: kept
    assert policy.carry_s == 0.031


def test_trim_margin_prefers_a_smaller_temporal_chunk_only_when_it_is_faster():
    """Pure roofline, Qwen3-8B on the H200 (green contexts): 16 decodes at 2k beside a 4096-token
    prompt under tau = 50 ms split at S_d = 8, k = 2 for 44.1k tokens/s; the same batch with its
    prefill trimmed to fit 0.85 tau (2123 tokens in 42.5 ms) makes 50.3k tokens/s and wins.
    64 decodes at 16k beside a chunk after 24k cached tokens: trimming to fit leaves too little
    prefill, so the split stays."""
    cm = CostModel(ModelShape.preset("qwen3-8b"), roofline_only(load_profile("h200")))
    decode, prefill = [(1, 2047)] * 16, [(4096, 0)]
    split = plan_iteration(cm, decode, prefill, 0.05, 132, 8)
    assert (split.spatial, split.s_decode, split.k) == (True, 8, 2)
    assert (2 * 16 + 4096) / split.predicted_s == pytest.approx(44081, rel=1e-3)
    trimmed = plan_iteration(cm, decode, prefill, 0.05, 132, 8, trim_margin=0.85)
    assert (trimmed.spatial, trimmed.prefill_token_limit, trimmed.slo_risk) == (False, 2123, False)
    assert trimmed.predicted_s <= 0.85 * 0.05 and (16 + 2123) / trimmed.predicted_s == pytest.approx(50332, rel=1e-3)
    assert trimmed.trim_rates == pytest.approx((50332, 44081), rel=1e-3) and split.trim_rates is None

    decode, prefill = [(1, 16000)] * 64, [(8192, 24000)]
    split = plan_iteration(cm, decode, prefill, 0.1, 132, 8)
    kept = plan_iteration(cm, decode, prefill, 0.1, 132, 8, trim_margin=0.85)
    assert split.spatial and dataclasses.replace(kept, trim_rates=None) == split
    assert kept.trim_rates[0] < kept.trim_rates[1]
    # temporal iterations measured at 0.8x their prediction (DuetPolicy.temporal_scale): the
    # trimmed batch (1256 tokens in 85 ms predicted, 68 ms at that scale) now beats the split
    trimmed = plan_iteration(cm, decode, prefill, 0.1, 132, 8, trim_margin=0.85, temporal_scale=0.8)
    assert (trimmed.spatial, trimmed.prefill_token_limit) == (False, 1256)
    steps = executed_steps(split.predicted_decode_s, split.predicted_prefill_s)
    split_rate = (steps * 64 + 8192) / max(steps * split.predicted_decode_s, split.predicted_prefill_s)
    assert (64 + 1256) / trimmed.predicted_s < split_rate < (64 + 1256) / (0.8 * trimmed.predicted_s)
    assert trimmed.trim_rates == pytest.approx(((64 + 1256) / (0.8 * trimmed.predicted_s), split_rate))
    with pytest.raises(ValueError):
        plan_iteration(cm, decode, prefill, 0.1, 132, 8, trim_margin=1.5)
    with pytest.raises(ValueError):
        plan_iteration(cm, decode, prefill, 0.1, 132, 8, trim_margin=0.85, temporal_scale=0)


def test_executed_steps_start_while_half_a_step_of_prefill_is_left():
    assert executed_steps(0.04, 0.10) == 3  # step 3 starts at 80 ms with 20 ms (half a step) left
    assert executed_steps(0.04, 0.099) == 2  # 19 ms left at 80 ms: the decodes wait for the prefill
    assert executed_steps(0.04, 0.10, k=2) == 2 and executed_steps(0.04, 0.01) == 1
    assert executed_steps(0.04, 0.059) == 1 and executed_steps(0.04, 0.06) == 2


def test_trim_margin_prices_the_split_at_the_steps_the_engine_runs():
    """Pure roofline, Qwen3-8B on the H200. 32 decodes at 16k beside an 8192-token prompt, tau = 50 ms:
    the split (S_d = 40, t_d = 48.4 ms, t_p = 250.1 ms) reserves k = 6 steps, 290 ms at
    (6 x 32 + 8192) tokens = 28.9k tokens/s, below the trimmed batch's 29.4k (1215 tokens in 42.5 ms);
    but the engine runs 5 steps, the prefill's 250.1 ms for 33.4k tokens/s: the split stays.
    64 decodes at 2k beside a 3072-token prompt, tau = 30 ms, margin 0.6: k = 4 prices the split at
    38.9k tokens/s, over the trimmed 38.5k, but 5 steps run (the fifth starts with 0.7 of a
    step left) and take 93.4 ms for 36.3k tokens/s: the trimmed batch wins."""
    cm = CostModel(ModelShape.preset("qwen3-8b"), roofline_only(load_profile("h200")))
    decode, prefill = [(1, 16000)] * 32, [(8192, 0)]
    split = plan_iteration(cm, decode, prefill, 0.05, 132, 8)
    t_d, t_p = split.predicted_decode_s, split.predicted_prefill_s
    assert (split.s_decode, split.k, executed_steps(t_d, t_p)) == (40, 6, 5)
    assert (t_d, t_p) == (pytest.approx(0.04841, abs=1e-5), pytest.approx(0.25006, abs=1e-5))
    assert (6 * 32 + 8192) / split.predicted_s == pytest.approx(28862, rel=1e-3)
    assert (5 * 32 + 8192) / t_p == pytest.approx(33401, rel=1e-3)
    kept = plan_iteration(cm, decode, prefill, 0.05, 132, 8, trim_margin=0.85)
    assert dataclasses.replace(kept, trim_rates=None) == split
    assert kept.trim_rates == pytest.approx(((32 + 1215) / 0.0425, 33401), rel=2e-3)  # 29.3k against 33.4k

    decode, prefill = [(1, 2047)] * 64, [(3072, 0)]
    split = plan_iteration(cm, decode, prefill, 0.03, 132, 8)
    t_d, t_p = split.predicted_decode_s, split.predicted_prefill_s
    assert (split.k, executed_steps(t_d, t_p)) == (4, 5) and t_p / t_d == pytest.approx(4.587, abs=1e-3)
    assert (4 * 64 + 3072) / split.predicted_s == pytest.approx(38862, rel=1e-3)
    assert (5 * 64 + 3072) / (5 * t_d) == pytest.approx(36345, rel=1e-3)
    trimmed = plan_iteration(cm, decode, prefill, 0.03, 132, 8, trim_margin=0.6)
    assert (trimmed.spatial, trimmed.prefill_token_limit) == (False, 629)
    assert (64 + 629) / trimmed.predicted_s == pytest.approx(38512, rel=1e-3)
