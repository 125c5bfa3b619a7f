"""The duet policy's decisions, the policy factory, and the engine's policy settings."""
from __future__ import annotations

import dataclasses

import pytest

from duetserve.config import EngineConfig
from duetserve.engine.kv_cache import BlockManager
from duetserve.engine.policy import (
    ChunkedPolicy,
    Plan,
    PrefillFirstPolicy,
    make_policy,
    policy_by_name,
)
from duetserve.engine.scheduler import Scheduler
from duetserve.engine.sequence import Sequence
from duetserve.planner import ModelShape, load_profile
from duetserve.planner.hardware import roofline_only
from duetserve.planner.policies import (
    TRIM_AUTO,
    TRIM_MIN_SAMPLES,
    TRIM_START,
    TRIM_WINDOW,
    DuetPolicy,
    PdmuxPolicy,
    PlannerConfig,
)
from duetserve.sampling import SamplingParams

DECODE = [(1, 2000)] * 16
PREFILL = [(4096, 0)]


def planner(tau: float, backend: str = "greenctx") -> PlannerConfig:
    return PlannerConfig(ModelShape.preset("qwen3-8b"), roofline_only(load_profile("h200")), tau, backend)


def test_duet_is_temporal_when_the_mixed_batch_fits():
    config = planner(0.100)
    t_mixed = float(config.cost_model.predict_total(DECODE + PREFILL, 132))
    assert 0.080 < t_mixed < 0.100  # about 83 ms: 16 decodes beside a 4096-token prefill
    plan = DuetPolicy(config).plan(DECODE, PREFILL, max_k=100)
    assert (plan.spatial, plan.k, plan.s_prefill, plan.prefill_token_limit) == (False, 1, 132, None)
    assert plan.predicted_s == pytest.approx(t_mixed)


def test_duet_splits_when_the_mixed_batch_breaks_tau():
    # tau = 50 ms < 83 ms. Hand check of the two best green-context splits (8-SM steps):
    #   S_d = 8:  t_d = 46.6 ms <= tau, t_p(124) = 93.5 ms, k = floor(93.5 / 46.6) = 2, tail gap
    #             93.5 - 93.1 + 46.6 = 47 ms <= tau: (2 * 16 + 4096) tokens / 93.5 ms = 44.1k tok/s;
    #   S_d = 16: t_d = 23.3 ms, t_p(116) = 98.1 ms, k = 4: 4160 / 98.1 ms = 42.4k tok/s.
    config = planner(0.050)
    cm = config.cost_model
    (t_d8, t_d16), (t_p124, t_p116) = cm.predict_spatial(DECODE, PREFILL, [8, 16], 132)
    assert t_d8 == pytest.approx(0.0466, abs=5e-4) and t_p124 == pytest.approx(0.0935, abs=5e-4)
    assert t_d16 == pytest.approx(0.0233, abs=5e-4) and t_p116 == pytest.approx(0.0981, abs=5e-4)
    rate8 = (2 * 16 + 4096) / max(2 * t_d8, t_p124)
    rate16 = (4 * 16 + 4096) / max(4 * t_d16, t_p116)
    assert rate8 > rate16
    plan = DuetPolicy(config).plan(DECODE, PREFILL, max_k=100)
    # KV for LOOKAHEAD_SLACK x k steps is reserved; the executor stops once the prefill is done.
    assert (plan.spatial, plan.s_prefill, plan.s_decode, plan.k) == (True, 124, 8, 2 * 2)
    assert DuetPolicy(config).plan(DECODE, PREFILL, max_k=3).k == 3
    # A third step would start at 93.2 ms with 0.3 ms of the 93.5 ms prefill left, under half a
    # step: it does not start, the iteration lasts t_p and the decodes wait the 0.3 ms (carried).
    policy = DuetPolicy(config)
    plan = policy.plan(DECODE, PREFILL, max_k=100)
    assert plan.predicted_s == pytest.approx(t_p124) and plan.predicted_decode_s == pytest.approx(t_d8)
    assert plan.predicted_prefill_s == pytest.approx(t_p124)
    assert policy.carry_s == pytest.approx(t_p124 - 2 * t_d8) and 0 < policy.carry_s < 5e-4


def test_duet_budgets_the_host_gap_after_the_last_plan():
    """With gap terms in the profile (15 ms + 1 ms a request), each plan's first-token budget is
    the 100 ms SLO less the gap after the last plan's iteration. The 83.3 ms mixed batch of 16
    decodes and a 4096-token prompt runs temporal as the first plan (nothing before it) and after
    a one-decode plan (16 ms: 84 ms left), but splits (8 decode SMs, as at a 50 ms SLO) after its
    own 17 requests (32 ms: 68 ms left). Without gap terms it stays temporal."""
    base = planner(0.100)
    t_mixed = float(base.cost_model.predict_total(DECODE + PREFILL, 132))
    gapped = dataclasses.replace(base.profile, host_gap_s=0.015, host_gap_per_request_s=0.001,
                                 provenance={**base.profile.provenance, "host_gap_s": "measured",
                                             "host_gap_per_request_s": "measured"})
    config = PlannerConfig(base.shape, gapped, 0.100, "greenctx")
    policy = DuetPolicy(config)
    first = policy.plan(DECODE, PREFILL, max_k=100)
    assert not first.spatial and first.predicted_s == pytest.approx(t_mixed)
    second = policy.plan(DECODE, PREFILL, max_k=100)
    assert (second.spatial, second.s_decode) == (True, 8)
    after_one = DuetPolicy(config)
    after_one.plan([(1, 2000)], [], max_k=8)
    assert not after_one.plan(DECODE, PREFILL, max_k=100).spatial
    plain = DuetPolicy(base)
    plain.plan(DECODE, PREFILL, max_k=100)
    assert not plain.plan(DECODE, PREFILL, max_k=100).spatial


def test_duet_without_partition_backend_trims_prefill_in_the_scheduler():
    config = planner(0.050, "none")
    plan = DuetPolicy(config).plan(DECODE, PREFILL, max_k=100)
    assert not plan.spatial and plan.slo_risk and 0 < plan.prefill_token_limit < 4096
    assert plan.predicted_s <= 0.050
    # The same decision inside the scheduler: 16 decodes at about 2000 tokens, then a 4096-token prompt.
    sched = Scheduler(DuetPolicy(config), BlockManager(4000, 16), 64, 8192, 10_000)
    seqs = [Sequence(i, [5] * 2000, 2000, SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(16)]
    for s in seqs:
        sched.add(s)
    while not all(s.is_decode for s in seqs):
        out = sched.schedule()
        sampled = {s.seq.seq_id: [7] for s in out.prefills if s.samples}
        sched.postprocess(out, sampled | {s.seq.seq_id: [7] for s in out.decodes})
    sched.add(Sequence(99, [5] * 4096, 4096, SamplingParams(max_tokens=5, ignore_eos=True)))
    out = sched.schedule()
    assert len(out.decodes) == 16 and out.plan.slo_risk
    assert out.num_prefill_tokens == out.plan.prefill_token_limit < 4096
    batch = [(1, d.num_cached_tokens) for d in out.decodes] + [(out.num_prefill_tokens, 0)]
    assert float(config.cost_model.predict_total(batch, 132)) <= 0.050


def test_policy_by_name():
    assert isinstance(policy_by_name("chunked"), ChunkedPolicy)
    assert isinstance(policy_by_name("prefill-first"), PrefillFirstPolicy)
    assert isinstance(policy_by_name("duet", planner(0.1)), DuetPolicy)
    assert isinstance(policy_by_name("pdmux", planner(0.1)), PdmuxPolicy)
    with pytest.raises(ValueError, match="needs the model shape"):
        policy_by_name("duet")
    with pytest.raises(ValueError, match="unknown --policy"):
        policy_by_name("fastest")


def test_planner_config_rejects_bad_settings():
    with pytest.raises(ValueError, match="positive"):
        planner(0.0)
    with pytest.raises(ValueError, match="unknown partition backend"):
        planner(0.1, "mig")


def test_engine_policy_from_the_model_config():
    """The engine (CPU: partition backend none) builds duet from the served model's config.json."""
    hf = {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
          "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "max_position_embeddings": 40960}
    policy = make_policy(EngineConfig(policy="duet", tbt_slo_s=0.05, partition_backend="none"), hf)
    assert isinstance(policy, DuetPolicy) and policy.config.granularity is None
    assert policy.config.shape == ModelShape.preset("qwen3-8b")
    assert not policy.plan(DECODE, PREFILL, 100).spatial
    assert isinstance(make_policy(EngineConfig(policy="chunked")), ChunkedPolicy)
    # --trim-margin reaches the planner: at tau 100 ms the split gives way to a temporal batch
    # trimmed to fit 0.85 tau (tests/test_planner_optimizer.py); with off (None) the split stays
    config = EngineConfig(policy="duet", tbt_slo_s=0.1, partition_backend="greenctx", trim_margin=None)
    assert make_policy(config, hf).plan(DECODE, PREFILL, 100).spatial
    trimmed = make_policy(dataclasses.replace(config, trim_margin=0.85), hf).plan(DECODE, PREFILL, 100)
    assert not trimmed.spatial and trimmed.predicted_s <= 0.85 * 0.1 and 0 < trimmed.prefill_token_limit < 4096
    # auto, the default, reaches it too (0.7 until it has measured temporal iterations)
    auto = make_policy(EngineConfig(policy="duet", tbt_slo_s=0.1, partition_backend="greenctx"), hf)
    assert auto.config.trim_margin == TRIM_AUTO and auto.trim_margin == TRIM_START
    with pytest.raises(ValueError, match="--trim-margin"):
        EngineConfig(trim_margin="sometimes")


def test_auto_trim_margin_follows_the_measured_error_of_temporal_iterations():
    """``--trim-margin auto``: 0.7 until 32 temporal iterations were measured; then 1 / p99 of
    measured / predicted (94 at 1.0, 4 at 1.1, 2 at 1.2: p99 is 1.2, p95 1.1; margin 1/1.2), within [0.5, 1];
    the trimmed batch's rate is taken at the median ratio. Spatial plans, unpredicted ones and
    untrimmed ones predicted under half the SLO (host-bound eager passes measured 1.5x and more
    on the H200) are not counted; trimmed batches are, whatever their length."""
    policy = DuetPolicy(dataclasses.replace(planner(0.1), trim_margin=TRIM_AUTO))
    temporal = Plan(predicted_s=0.05)
    for _ in range(31):
        policy.observe_iteration(temporal, 0.05)
    policy.observe_iteration(Plan(spatial=True, s_prefill=124, s_decode=8, predicted_s=0.05), 1.0)
    policy.observe_iteration(Plan(), 1.0)  # no prediction
    for _ in range(TRIM_MIN_SAMPLES):  # 28 ms predicted, 42 measured, untrimmed: not counted
        policy.observe_iteration(Plan(predicted_s=0.028), 0.042)
    assert (policy.trim_margin, policy.temporal_scale) == (TRIM_START, 1.0)
    for ratio in [1.0] * 63 + [1.1] * 4 + [1.2] * 2:
        policy.observe_iteration(temporal, 0.05 * ratio)
    assert policy.trim_margin == pytest.approx(1 / 1.2) and policy.temporal_scale == pytest.approx(1.0)
    for _ in range(TRIM_WINDOW):  # the window forgets: all slow now, the margin stops at 0.5
        policy.observe_iteration(temporal, 0.05 * 3)
    assert policy.trim_margin == 0.5 and policy.temporal_scale == pytest.approx(3.0)
    # trimmed batches count whatever their length: at margin 0.5 they are predicted just under half
    # the SLO (49.99 ms at tau 100 ms, 45 with a 10 ms carried wait), and the margin must be able to rise
    trimmed = Plan(predicted_s=0.045, trim_rates=(1.0, 0.5))
    for _ in range(TRIM_WINDOW):
        policy.observe_iteration(trimmed, 0.045)
    assert policy.trim_margin == 1.0 and policy.temporal_scale == pytest.approx(1.0)
    # a fixed margin is the configured one, and no scale
    fixed = DuetPolicy(dataclasses.replace(planner(0.1), trim_margin=0.85))
    fixed.observe_iteration(temporal, 0.1)
    assert (fixed.trim_margin, fixed.temporal_scale) == (0.85, 1.0)
    with pytest.raises(ValueError, match="auto"):
        dataclasses.replace(planner(0.1), trim_margin="sometimes")


def test_auto_trim_margin_plans_with_the_learned_margin_and_scale():
    """64 decodes at 16k beside an 8192-token chunk after 24k cached tokens, tau 100 ms (pure
    roofline, green contexts): before any measurement (margin 0.7, scale 1) the split wins.
    After 32 temporal iterations measured at 0.8x their prediction, the margin is 1 (1 / 0.8,
    capped) and the trimmed batch, 1659 prefill tokens predicted at tau, is priced at 0.8x:
    it wins (tests/test_planner_optimizer.py prices the same batch)."""
    decode, prefill = [(1, 16000)] * 64, [(8192, 24000)]
    config = dataclasses.replace(planner(0.1), trim_margin=TRIM_AUTO)
    assert DuetPolicy(config).plan(decode, prefill, 100).spatial
    policy = DuetPolicy(config)  # a fresh one: nothing carried from a split into its first-token budget
    for _ in range(TRIM_MIN_SAMPLES):
        policy.observe_iteration(Plan(predicted_s=0.05), 0.04)
    assert policy.trim_margin == 1.0 and policy.temporal_scale == pytest.approx(0.8)
    plan = policy.plan(decode, prefill, 100)
    assert (plan.spatial, plan.prefill_token_limit) == (False, 1659) and plan.predicted_s <= 0.1


def test_engine_refuses_pdmux_without_partition_backend():
    with pytest.raises(ValueError, match=r"^--policy pdmux needs an SM partition backend"):
        EngineConfig(policy="pdmux", partition_backend="none")
    with pytest.raises(ValueError, match="--partition-backend"):
        EngineConfig(partition_backend="mig")
    with pytest.raises(ValueError, match="partition backend"):
        PdmuxPolicy(planner(0.1, "none"))


def test_engine_runs_duet_on_cpu_like_chunked(tiny_qwen3_folder):
    """On the CPU (partition backend none) duet reads the model's config.json and plans
    temporal batches: greedy tokens equal chunked's."""
    from duetserve.engine.engine import LLMEngine

    prompts = [[5 + i for i in range(n)] for n in (7, 40, 90)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = {}
    for name in ("chunked", "duet"):
        engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), policy=name, max_num_batched_tokens=32,
                                        num_kv_blocks=64, block_size=8, num_decode_steps=1))  # every plan predicted
        outputs[name] = engine.generate(prompts, params)
    assert isinstance(engine.scheduler.policy, DuetPolicy)
    assert engine.scheduler.policy.config.shape.layers == 2 and engine.last_stats.plan.predicted_s is not None
    assert outputs["duet"] == outputs["chunked"]


def test_serve_names_policy_for_pdmux_without_backend(capsys):
    from duetserve.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--policy", "pdmux", "--partition-backend", "none", "--device", "cpu", "--port", "0"])
    assert exc.value.code == 2
    assert "--policy pdmux needs an SM partition backend" in capsys.readouterr().err


def test_duet_learns_a_decode_correction_from_measured_steps():
    """``observe``: the correction moves by ratio ** 0.3 per observation, within [1, 2], and
    scales the decode side of later spatial predictions (the shared config is untouched)."""
    config = planner(0.05)
    policy = DuetPolicy(config)
    plan = policy.plan(DECODE, PREFILL, max_k=100)
    assert plan.spatial and policy.decode_correction == 1.0
    before = policy.cost_model.predict_spatial(DECODE, PREFILL, [16, 32], 132)
    policy.observe(plan, 1.5 * plan.predicted_decode_s, None)  # steps ran 1.5x their prediction
    assert policy.decode_correction == pytest.approx(1.5 ** 0.3)  # 1.129
    after = policy.cost_model.predict_spatial(DECODE, PREFILL, [16, 32], 132)
    assert after[0] == pytest.approx(before[0] * 1.5 ** 0.3) and (after[1] == before[1]).all()
    assert config.cost_model.decode_margin == 1.0  # the policy scales its own copy
    replanned = policy.plan(DECODE, PREFILL, max_k=100)  # the new prediction includes the correction
    assert plan.decode_margin == 1.0 and replanned.decode_margin == pytest.approx(1.5 ** 0.3)  # for the log
    assert replanned.predicted_decode_s == pytest.approx(
        float(policy.cost_model.predict_spatial(DECODE, PREFILL, replanned.s_decode, 132)[0]))
    policy.observe(replanned, 0.2 * replanned.predicted_decode_s, None)  # far faster: floor at 1
    assert policy.decode_correction == 1.0
    for _ in range(20):
        policy.observe(plan, 100 * plan.predicted_decode_s, None)
    assert policy.decode_correction == 2.0 and policy.cost_model.decode_margin == 2.0
    policy.observe(Plan(), 1.0, None)  # a temporal plan, or no decode prediction: ignored
    policy.observe(dataclasses.replace(plan, predicted_decode_s=None), 0.001, None)
    assert policy.decode_correction == 2.0
    # a temporal plan for decodes beside a prefill relaxes it: excess x 0.99 each time
    small = [(64, 0)]  # a prefill that fits tau beside the decodes: temporal
    assert not policy.plan(DECODE, small, max_k=100).spatial
    assert policy.decode_correction == pytest.approx(1.99)
    for _ in range(99):
        policy.plan(DECODE, small, max_k=100)
    assert policy.decode_correction == pytest.approx(1 + 0.99 ** 100) and policy.cost_model.decode_margin == \
        pytest.approx(1 + 0.99 ** 100)
    policy.plan(DECODE, [], max_k=100)  # decode alone: nothing to split, nothing changes
    assert policy.decode_correction == pytest.approx(1 + 0.99 ** 100)


def test_duet_keeps_a_decode_correction_per_decode_sm_count():
    """``observe`` also moves a correction per decode SM count: a level's first measurement starts
    from the global correction; measured levels are priced with their own, others with the
    global one (``CostModel.decode_level_scale``), and ``Plan.decode_margin`` records it."""
    config = planner(0.05)
    policy = DuetPolicy(config)
    plan = policy.plan(DECODE, PREFILL, max_k=100)
    assert plan.spatial and plan.s_decode == 8 and plan.decode_margin == 1.0
    base = config.cost_model.predict_spatial(DECODE, PREFILL, [8, 16, 32], 132)[0]
    policy.observe(plan, 1.5 * plan.predicted_decode_s, None)  # 8 SMs ran 1.5x: both move to 1.5 ** 0.3
    assert policy.level_corrections == {8: pytest.approx(1.5 ** 0.3)}
    assert policy.decode_correction == pytest.approx(1.5 ** 0.3)
    # 16 SMs, priced with the global correction, ran as predicted without the feedback (bias 1)
    on16 = dataclasses.replace(plan, s_decode=16, s_prefill=116, predicted_decode_s=float(base[1]) * 1.5 ** 0.3,
                               decode_margin=1.5 ** 0.3)
    policy.observe(on16, float(base[1]), None)
    assert policy.level_corrections[16] == pytest.approx(1.5 ** 0.21)  # 1.5 ** 0.3 x (1 / 1.5 ** 0.3) ** 0.3
    assert policy.decode_correction == pytest.approx(1.5 ** 0.21) and policy.level_corrections[8] == \
        pytest.approx(1.5 ** 0.3)
    after = policy.cost_model.predict_spatial(DECODE, PREFILL, [8, 16, 32], 132)[0]
    # 8 and 16 at their own, 32 (never measured) at the global one
    assert after == pytest.approx(base * [1.5 ** 0.3, 1.5 ** 0.21, 1.5 ** 0.21])
    assert (config.cost_model.decode_level_scale == 1.0).all()  # the shared model is untouched
    replanned = policy.plan(DECODE, PREFILL, max_k=100)
    assert replanned.decode_margin == pytest.approx(
        1.5 ** 0.3 if replanned.s_decode == 8 else 1.5 ** 0.21)  # the factor its level was priced with
    # a temporal plan for decodes beside a prefill relaxes every correction by 0.99 of its excess
    assert not policy.plan(DECODE, [(64, 0)], max_k=100).spatial
    assert policy.level_corrections[8] == pytest.approx(1 + (1.5 ** 0.3 - 1) * 0.99)
    assert policy.decode_correction == pytest.approx(1 + (1.5 ** 0.21 - 1) * 0.99)


def test_duet_auto_plans_decode_steps_with_room_for_their_spread():
    """With ``--trim-margin auto``, ``observe`` keeps measured / predicted decode steps against the
    prediction without the policy's feedback, and from 32 on scales the decode side by their p99
    over their median (numpy's linear quantile); without auto it stays 1."""
    policy = DuetPolicy(dataclasses.replace(planner(0.05), trim_margin=TRIM_AUTO))
    fixed = DuetPolicy(planner(0.05))
    plan = fixed.plan(DECODE, PREFILL, max_k=100)  # (auto would run this batch trimmed, on all SMs)
    assert plan.spatial
    (t_d,), _ = policy.cost_model.predict_spatial(DECODE, PREFILL, [16], 132)
    for i in range(31):  # faster than predicted: the correction stays at its floor, 1
        policy.observe(plan, 0.8 * plan.predicted_decode_s, None)
        fixed.observe(plan, 0.8 * plan.predicted_decode_s, None)
    assert policy.decode_spread == 1.0 and policy.cost_model.decode_margin == 1.0
    policy.observe(plan, 1.0 * plan.predicted_decode_s, None)  # the 32nd: 31 x 0.8 and one 1.0
    fixed.observe(plan, 1.0 * plan.predicted_decode_s, None)
    spread = (0.8 + 0.69 * 0.2) / 0.8  # p99 at position 0.99 x 31 = 30.69 of the sorted 32
    assert policy.decode_correction == 1.0 and policy.decode_spread == pytest.approx(spread)  # 1.1725
    assert policy.cost_model.decode_margin == pytest.approx(spread)
    assert float(policy.cost_model.predict_spatial(DECODE, PREFILL, [16], 132)[0][0]) == pytest.approx(t_d * spread)
    assert fixed.decode_spread == 1.0 and fixed.cost_model.decode_margin == 1.0
    # later predictions include the spread; steps that ran 0.8x the prediction without it count
    # as 0.8 (not 0.8 / spread, which would move the median): 71 x 0.8 and one 1.0
    for _ in range(40):
        scaled = dataclasses.replace(plan, predicted_decode_s=plan.predicted_decode_s * policy.decode_spread,
                                     decode_margin=policy.decode_spread)  # as plan() records it
        policy.observe(scaled, 0.8 * plan.predicted_decode_s, None)
    spread = (0.8 + 0.29 * 0.2) / 0.8  # position 0.99 x 71 = 70.29
    assert policy.decode_spread == pytest.approx(spread) and policy.decode_correction == 1.0
    # steps 1.2x the prediction without the feedback: the correction moves toward 1.2 (it is
    # the bias), not toward 1.2 / spread, and the spread multiplies it
    scaled = dataclasses.replace(plan, predicted_decode_s=plan.predicted_decode_s * spread, decode_margin=spread)
    policy.observe(scaled, 1.2 * plan.predicted_decode_s, None)
    assert policy.decode_correction == pytest.approx(1.2 ** 0.3)
    assert policy.cost_model.decode_margin == pytest.approx(1.2 ** 0.3 * policy.decode_spread)


def test_decode_spread_counts_what_the_level_corrections_leave():
    """Levels with different but steady biases (8 SMs 1.0x the profile, 16 SMs 1.5x, no noise): once
    each level's correction has converged the spread is 1, as no level varies; pooling the raw
    ratios would have given p99 / median of {1.0, 1.5}, 1.2, and priced both levels 20% high."""
    policy = DuetPolicy(dataclasses.replace(planner(0.05), trim_margin=TRIM_AUTO))
    cm = policy.cost_model
    base = dict(zip((8, 16), planner(0.05).cost_model.predict_spatial(DECODE, PREFILL, [8, 16], 132)[0]))
    plan = Plan(True, 124, 8, 4, 0.1, 0.03, 0.1)
    for _ in range(300):  # the last 256 of 600 ratios come long after convergence
        for sms, bias in ((8, 1.0), (16, 1.5)):
            (t_d,), _ = cm.predict_spatial(DECODE, PREFILL, [sms], 132)  # as plan() prices and records it
            priced = dataclasses.replace(plan, s_decode=sms, s_prefill=132 - sms, predicted_decode_s=float(t_d),
                                         decode_margin=cm.decode_margin * float(cm.decode_level_scale[sms]))
            policy.observe(priced, bias * float(base[sms]), None)
    assert policy.level_corrections == {8: pytest.approx(1.0), 16: pytest.approx(1.5)}
    assert policy.decode_spread == pytest.approx(1.0, abs=1e-4)
    after = cm.predict_spatial(DECODE, PREFILL, [8, 16], 132)[0]
    assert after == pytest.approx([base[8] * 1.0, base[16] * 1.5], rel=1e-4)


def test_duet_learns_the_prefill_scale_both_ways_within_bounds():
    """``observe``'s prefill side: ratio ** 0.3 per observation, within [0.8, 1.5], scaling the GPU
    part of spatial prefill predictions (its host time is not scaled); decode is untouched."""
    config = planner(0.05)
    policy = DuetPolicy(config)
    plan = policy.plan(DECODE, PREFILL, max_k=100)
    cm, profile = policy.cost_model, config.profile
    host = profile.host_per_request_s + profile.host_eager_s  # one prefill request, eager
    (t_d0,), (t_p0,) = cm.predict_spatial(DECODE, PREFILL, [8], 132)
    policy.observe(plan, plan.predicted_decode_s, 1.07 * plan.predicted_prefill_s)
    assert cm.prefill_scale == pytest.approx(1.07 ** 0.3) and policy.decode_correction == 1.0
    (t_d1,), (t_p1,) = cm.predict_spatial(DECODE, PREFILL, [8], 132)
    assert t_d1 == t_d0 and t_p1 - host == pytest.approx((t_p0 - host) * 1.07 ** 0.3)
    policy.observe(plan, plan.predicted_decode_s, 0.5 * plan.predicted_prefill_s)  # faster: it may fall below 1
    assert cm.prefill_scale == pytest.approx(1.07 ** 0.3 * 0.5 ** 0.3)
    for _ in range(30):
        policy.observe(plan, plan.predicted_decode_s, 0.01 * plan.predicted_prefill_s)
    assert cm.prefill_scale == 0.8
    for _ in range(30):
        policy.observe(plan, plan.predicted_decode_s, 100 * plan.predicted_prefill_s)
    assert cm.prefill_scale == 1.5
    policy.observe(plan, plan.predicted_decode_s, None)  # no prefill: unchanged
    policy.observe(Plan(), 1.0, 0.001)  # a temporal plan: ignored
    assert cm.prefill_scale == 1.5 and config.cost_model.prefill_scale == 1.0
