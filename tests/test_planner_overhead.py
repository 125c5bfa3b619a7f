"""Per-kernel overhead model: hand-computed predictions, the default (no overheads) leaving the
roofline unchanged, profile fields and round trip, and the calibration fit recovering known
constants from synthetic measurements.

Hand cases: the made-up GPU of test_planner_cost_model (100 SMs, Pi(S) = 1e12 S FLOP/s,
BW(S) = 2e10 S bytes/s up to 50 SMs) and a two-layer model (hidden 1024, 8/2 heads of 128,
intermediate 4096, vocab 32000), with g = kernel_gpu_s = 2 us, h = launch_cpu_s = 10 us,
50 kernels per layer + 10 outside for decode (110 in all), 60 + 12 for prefill (132).
"""

import json
from dataclasses import asdict, replace

import numpy as np
import pytest

from duetserve.calibrate.overhead import (
    OverheadFit,
    fit_overheads,
    fit_with_efficiency,
    holdout_mask,
    predict_fitted,
    split_kernel_counts,
)
from duetserve.planner.cost_model import CostModel, ModelShape
from duetserve.planner.hardware import load_profile, roofline_only, saturating_points
from duetserve.planner.policies import PlannerConfig

SHAPE = ModelShape(hidden=1024, layers=2, q_heads=8, kv_heads=2, head_dim=128, intermediate=4096, vocab=32000)
QWEN = ModelShape.preset("qwen3-8b")
OVERHEADS = {"kernel_gpu_s": 2e-6, "launch_cpu_s": 10e-6, "kernels_per_layer": {"decode": 50, "prefill": 60},
             "kernels_per_forward": {"decode": 10, "prefill": 12}}
MEASURED = dict.fromkeys(OVERHEADS, "measured")


def with_overheads(profile, **fields):
    fields = {**OVERHEADS, **fields}
    return replace(profile, **fields, provenance={**profile.provenance, **dict.fromkeys(fields, "measured")})


@pytest.fixture
def gpu():
    return replace(roofline_only(load_profile("h200")), name="round", num_sms=100, num_tpcs=50,
                   compute_points=saturating_points(1e14, 100, 100),
                   bandwidth_points=saturating_points(1e12, 50, 100), nvlink_bandwidth=1e11)


DECODE = [(1, 1023)] * 4
PREFILL = [(4096, 0)]


def test_graph_replayed_decode_adds_n_times_g(gpu):
    roof = CostModel(SHAPE, gpu).predict(DECODE, 100)
    bd = CostModel(SHAPE, with_overheads(gpu)).predict(DECODE, 100)
    assert gpu.kernel_count("decode", 2) == 0 and with_overheads(gpu).kernel_count("decode", 2) == 110
    assert bd.overhead == pytest.approx(110 * 2e-6)  # decode-only: graphs by default
    assert bd.total == pytest.approx(roof.total + 2.2e-4)
    assert (bd.linear, bd.attention, bd.lm_head) == (roof.linear, roof.attention, roof.lm_head)


def test_narrow_graph_decodes_count_their_own_kernels(gpu):
    """With ``narrow_decode_batch`` 4 and a narrow count of 40 a layer + 6 (86 kernels against
    110), graph-replayed decodes of up to 4 requests cost 86 x 2 us; 5 requests, an eager decode
    and a prefill keep their counts; a column per batch in one call agrees."""
    narrow = with_overheads(gpu, narrow_decode_batch=4,
                            kernels_per_layer={"decode": 50, "prefill": 60, "narrow_decode": 40},
                            kernels_per_forward={"decode": 10, "prefill": 12, "narrow_decode": 6})
    cm, wide, roof = CostModel(SHAPE, narrow), CostModel(SHAPE, with_overheads(gpu)), CostModel(SHAPE, gpu)
    assert narrow.kernel_count("narrow_decode", 2) == 86
    # (decode only, replayed, batch): graphs of 1, 4 and 2 decodes narrow; 5 decodes or an eager one not
    assert narrow.iteration_kernels(2, [True] * 5, [True, True, True, False, True], [1, 4, 5, 2, 2]).tolist() \
        == [86, 86, 110, 110, 86]
    assert narrow.iteration_kernels(2, False, True, 2) == 132
    assert cm.predict(DECODE, 100).overhead == pytest.approx(86 * 2e-6)
    five = DECODE + [(1, 1023)]
    assert cm.predict(five, 100).overhead == pytest.approx(110 * 2e-6)
    assert float(cm.predict_total(DECODE, 100, graphs=False)) == pytest.approx(1.1e-3)  # eager: 110 x 10 us
    assert cm.predict(PREFILL, 100).overhead == pytest.approx(132 * 2e-6)
    assert wide.predict(DECODE, 100).overhead == pytest.approx(110 * 2e-6)
    # variants of 1 fixed + 0..4 more decodes (request j joins from variant j + 1): batches 1..5
    q = (np.arange(5)[None, :] > np.arange(4)[:, None]).astype(np.int64)  # q[j, m] = 1 for m > j
    c = np.full(4, 1023)
    columns = cm.predict_variants([(1, 1023)], q, c, 100) - roof.predict_variants([(1, 1023)], q, c, 100)
    assert columns == pytest.approx([86 * 2e-6] * 4 + [110 * 2e-6])


def test_eager_is_the_slower_of_gpu_and_host(gpu):
    cm = CostModel(SHAPE, with_overheads(gpu))
    roof = CostModel(SHAPE, gpu)
    # decode run eagerly: the roofline is ~0.1 ms, so the host's 110 x 10 us = 1.1 ms wins
    assert float(roof.predict_total(DECODE, 100)) < 1.1e-3 - 2.2e-4
    assert float(cm.predict_total(DECODE, 100, graphs=False)) == pytest.approx(1.1e-3)
    assert float(CostModel(SHAPE, with_overheads(gpu), cuda_graphs=False).predict_total(DECODE, 100)) \
        == pytest.approx(1.1e-3)
    # a 4096-token prefill: ~2.5 ms of GPU work beats 132 x 10 us = 1.32 ms of launches, so GPU + 132 x 2 us
    r = float(roof.predict_total(PREFILL, 100))
    assert r > 1.32e-3
    assert cm.predict(PREFILL, 100).overhead == pytest.approx(132 * 2e-6)
    # a small mixed batch runs eagerly with the prefill count: host bound, 1.32 ms
    assert float(cm.predict_total(DECODE + [(16, 0)], 100)) == pytest.approx(1.32e-3)
    # forcing graphs on a prefill prices it as replayed: roofline + 132 g
    assert float(cm.predict_total(PREFILL, 100, graphs=True)) == pytest.approx(r + 2.64e-4)


def test_piecewise_iterations_launch_their_own_count_from_the_host(gpu):
    """``piecewise_tokens`` 64 and a piecewise count of 20 a layer + 10 (50 host launches against
    132): a 20-token mixed batch (roofline 0.138 ms, GPU 0.138 + 132 x 2 us = 0.402 ms) is host
    bound at 50 x 10 us = 0.5 ms, no longer 1.32 ms; on 10 SMs its GPU time (0.691 + 0.264 ms)
    wins instead. 65 tokens, a forced-eager or spatial prefill, and a profile without the count
    stay eager; decode-only batches keep their graphs."""
    counts = with_overheads(gpu, kernels_per_layer={"decode": 50, "prefill": 60, "piecewise": 20},
                            kernels_per_forward={"decode": 10, "prefill": 12, "piecewise": 10})
    assert counts.kernel_count("piecewise", 2) == 50
    cm, roof = CostModel(SHAPE, counts, piecewise_tokens=64), CostModel(SHAPE, gpu)
    small = DECODE + [(16, 0)]  # 20 tokens
    assert float(roof.predict_total(small, 100)) == pytest.approx(1.38103296e-4)
    assert float(cm.predict_total(small, 100)) == pytest.approx(0.5e-3)
    assert float(cm.predict_total(small, 10)) == pytest.approx(6.9051648e-4 + 132 * 2e-6)
    assert float(cm.predict_total(DECODE + [(61, 0)], 100)) == pytest.approx(1.32e-3)  # 65 tokens: eager
    assert float(cm.predict_total(small, 100, graphs=False)) == pytest.approx(1.32e-3)
    assert float(CostModel(SHAPE, with_overheads(gpu), piecewise_tokens=64).predict_total(small, 100)) \
        == pytest.approx(1.32e-3)
    # an engine without CUDA graphs (--enforce-eager) records no piecewise ones either
    assert float(CostModel(SHAPE, counts, cuda_graphs=False, piecewise_tokens=64).predict_total(small, 100)) \
        == pytest.approx(1.32e-3)
    assert cm.predict(DECODE, 100).overhead == pytest.approx(110 * 2e-6)
    _, t_p = cm.predict_spatial(DECODE, [(16, 0)], [20, 50], 100)  # a split's prefill runs eagerly
    np.testing.assert_allclose(t_p, 1.32e-3 * cm.profile.prefill_interference)
    # the variants (trimming): 16 and 61 more tokens beside the 4 decodes
    t = cm.predict_variants(DECODE, np.array([[16, 61]]), np.array([0]), 100)
    np.testing.assert_allclose(t, [0.5e-3, 1.32e-3])
    with pytest.raises(ValueError, match="piecewise_tokens must be >= 0"):
        CostModel(SHAPE, counts, piecewise_tokens=-1)


def test_host_time_per_request_and_eager_iteration(gpu):
    """``R h_r + e h_e`` on top of the per-kernel model: h_r = 0.2 ms, h_e = 16 ms."""
    base = CostModel(SHAPE, with_overheads(gpu))
    cm = CostModel(SHAPE, with_overheads(gpu, host_per_request_s=2e-4, host_eager_s=0.016))
    # decode-only, replayed from graphs: 4 requests x 0.2 ms
    assert float(cm.predict_total(DECODE, 100)) == pytest.approx(float(base.predict_total(DECODE, 100)) + 8e-4)
    assert cm.predict(DECODE, 100).overhead == pytest.approx(110 * 2e-6 + 8e-4)
    # mixed (eager): 5 requests x 0.2 ms + 16 ms
    mixed = DECODE + [(16, 0)]
    assert float(cm.predict_total(mixed, 100)) == pytest.approx(float(base.predict_total(mixed, 100)) + 0.017)
    # decode forced eager pays h_e too; host=False leaves the host out
    assert float(cm.predict_total(DECODE, 100, graphs=False)) == \
        pytest.approx(float(base.predict_total(DECODE, 100, graphs=False)) + 0.0168)
    assert float(cm.predict_total(mixed, 100, host=False)) == pytest.approx(float(base.predict_total(mixed, 100)))
    # spatial: decode steps carry no host time, the prefill side does (1 request, eager)
    assert cm.predict(DECODE, 100, host=False).total == pytest.approx(base.predict(DECODE, 100).total)
    t_d, t_p = cm.predict_spatial(DECODE, PREFILL, [20, 50], 100)
    b_d, b_p = base.predict_spatial(DECODE, PREFILL, [20, 50], 100)
    assert np.allclose(t_d, b_d)
    assert np.allclose(t_p, b_p + 2e-4 + 0.016)  # host time is not scaled by the GPU's interference
    # variants (the trimming fallback): request 2 sits out of variant 0
    v = cm.predict_variants(DECODE, np.array([[0, 64]]), np.array([0]), 100)
    vb = base.predict_variants(DECODE, np.array([[0, 64]]), np.array([0]), 100)
    assert np.allclose(v, vb + [8e-4, 1e-3 + 0.016])


def test_piecewise_iterations_take_their_own_host_term(gpu):
    """``host_piecewise_s`` 3 ms in place of ``host_eager_s`` 16 ms for the piecewise 20-token batch
    above (0.5 ms host-bound launches + 5 x 0.2 ms + 3 ms); the 65-token eager batch, a split's
    prefill and a forced-eager one keep the 16 ms; without the term (None) the piecewise batch pays
    the 16 ms as before."""
    fields = {"kernels_per_layer": {"decode": 50, "prefill": 60, "piecewise": 20},
              "kernels_per_forward": {"decode": 10, "prefill": 12, "piecewise": 10},
              "host_per_request_s": 2e-4, "host_eager_s": 0.016}
    cm = CostModel(SHAPE, with_overheads(gpu, **fields, host_piecewise_s=0.003), piecewise_tokens=64)
    old = CostModel(SHAPE, with_overheads(gpu, **fields), piecewise_tokens=64)
    assert old.profile.piecewise_host_s == 0.016 and cm.profile.piecewise_host_s == 0.003
    small = DECODE + [(16, 0)]
    assert float(cm.predict_total(small, 100)) == pytest.approx(0.5e-3 + 1e-3 + 0.003)
    assert float(old.predict_total(small, 100)) == pytest.approx(0.5e-3 + 1e-3 + 0.016)
    assert float(cm.predict_total(small, 100, graphs=False)) == pytest.approx(1.32e-3 + 1e-3 + 0.016)
    assert float(cm.predict_total(DECODE + [(61, 0)], 100)) == pytest.approx(1.32e-3 + 1e-3 + 0.016)
    _, t_p = cm.predict_spatial(DECODE, [(16, 0)], [20, 50], 100)
    np.testing.assert_allclose(t_p, 1.32e-3 * cm.profile.prefill_interference + 2e-4 + 0.016)
    assert cm.predict(DECODE, 100).overhead == pytest.approx(110 * 2e-6 + 8e-4)  # decode-only: no term


def test_multi_step_decode_pays_the_host_time_once(gpu):
    """``predict_steps``: every step's GPU time, the 4 x 0.2 ms of host time once."""
    base = CostModel(SHAPE, with_overheads(gpu))
    cm = CostModel(SHAPE, with_overheads(gpu, host_per_request_s=2e-4, host_eager_s=0.016))
    step = float(base.predict_total(DECODE, 100))
    assert cm.predict_steps(DECODE, 100, 1) == pytest.approx(float(cm.predict_total(DECODE, 100)))
    assert cm.predict_steps(DECODE, 100, 4) == pytest.approx(4 * step + 8e-4)
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        cm.predict_steps(DECODE, 100, 0)
    # an empty batch costs nothing; roofline_only drops the host terms
    assert float(cm.predict_total(np.zeros((0, 2), dtype=int), 100)) == 0.0
    assert roofline_only(cm.profile).host_per_request_s == roofline_only(cm.profile).host_eager_s == 0.0


def test_spatial_and_variants_use_the_default_rule(gpu):
    cm, roof = CostModel(SHAPE, with_overheads(gpu)), CostModel(SHAPE, gpu)
    p = cm.profile
    t_d, t_p = cm.predict_spatial(DECODE, [(16, 0)], [20, 50], 100)
    r_d = roof.predict_total(DECODE, [20, 50])
    np.testing.assert_allclose(t_d, (r_d + 2.2e-4) * p.decode_interference)  # graphs on the split level
    np.testing.assert_allclose(t_p, 1.32e-3 * p.prefill_interference)  # eager, host bound
    # variants: prefill request out (decode only: graphs), 16 tokens (eager), 4096 tokens
    t = cm.predict_variants(DECODE, np.array([[0, 16, 4096]]), np.array([0]), 100)
    expected = [cm.predict_total(DECODE, 100), cm.predict_total(DECODE + [(16, 0)], 100),
                cm.predict_total(DECODE + PREFILL, 100)]
    np.testing.assert_allclose(t, np.ravel(expected))
    assert cm.predict_variants([], np.array([[0, 16]]), np.array([0]), 100)[0] == 0  # nothing runs


def test_zero_overheads_leave_every_number_unchanged(gpu):
    shipped = roofline_only(load_profile("h200"))
    assert (shipped.kernel_gpu_s, shipped.launch_cpu_s, dict(shipped.kernels_per_layer)) == (0, 0, {})
    counted = with_overheads(gpu, kernel_gpu_s=0.0, launch_cpu_s=0.0)
    batches = [DECODE, PREFILL, DECODE + [(512, 100)], [(1, 0)]]
    for a, b in ((CostModel(SHAPE, gpu), CostModel(SHAPE, counted)), (CostModel(QWEN, shipped),) * 2):
        for reqs in batches:
            assert a.predict(reqs, 100).overhead == 0.0
            for graphs in (None, True, False):
                np.testing.assert_array_equal(a.predict_total(reqs, [16, 100], graphs=graphs),
                                              b.predict_total(reqs, [16, 100]))


def test_planner_tbt_predictions_include_the_overheads():
    h200 = roofline_only(load_profile("h200"))
    plain = PlannerConfig(QWEN, h200, 0.1)
    fitted = PlannerConfig(QWEN, with_overheads(h200), 0.1)
    eager = PlannerConfig(QWEN, with_overheads(h200), 0.1, cuda_graphs=False)
    decode = [(1, 2047)] * 32
    n = 36 * 50 + 10
    base = float(plain.cost_model.predict_total(decode, 132))
    assert float(fitted.cost_model.predict_total(decode, 132)) == pytest.approx(base + n * 2e-6)
    assert float(eager.cost_model.predict_total(decode, 132)) == pytest.approx(max(base + n * 2e-6, n * 10e-6))


# --- profile fields ---------------------------------------------------------------------------

def test_profile_round_trip_with_overheads(tmp_path):
    raw = {**asdict(roofline_only(load_profile("h200"))), **OVERHEADS}
    raw["provenance"] = {**raw["provenance"], **MEASURED}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    loaded = load_profile(path)
    assert loaded == with_overheads(roofline_only(load_profile("h200")))
    assert loaded.kernel_count("prefill", 36) == 36 * 60 + 12 and loaded.provenance["launch_cpu_s"] == "measured"


@pytest.mark.parametrize("change, message", [
    ({"kernel_gpu_s": -1e-6}, ">= 0"),
    ({"host_per_request_s": -1e-4}, "host_per_request_s, host_eager_s, host_gap_s and host_gap_per_request_s "
                                    "must be >= 0"),
    ({"host_eager_s": -0.01}, "must be >= 0 seconds"),
    ({"host_gap_s": -1e-3}, "host_gap_s and host_gap_per_request_s must be >= 0 seconds"),
    ({"host_gap_per_request_s": -1e-6}, "host_gap_per_request_s must be >= 0 seconds"),
    ({"kernels_per_layer": {"decode": 50}}, "need kernels_per_layer for"),
    ({"kernels_per_forward": {"decode": 1, "prefill": 2, "mixed": 3}}, "kernels_per_forward maps"),
    ({"kernels_per_layer": {"decode": 1.5, "prefill": 2}}, "kernel counts >= 0"),
    ({"narrow_decode_batch": 16}, "'narrow_decode' count exactly when narrow_decode_batch > 0"),
    ({"kernels_per_layer": {"decode": 50, "prefill": 60, "piecewise": 3}},
     "'piecewise' count goes in both kernels_per_layer and kernels_per_forward"),
    ({"narrow_decode_batch": -1}, "narrow_decode_batch must be an integer >= 0"),
    ({"host_piecewise_s": -1e-3}, "host_piecewise_s must be a finite number of seconds >= 0 or null"),
    ({"host_piecewise_s": float("nan")}, "host_piecewise_s must be a finite number"),
    ({"host_piecewise_s": True}, "host_piecewise_s must be a finite number"),
    ({"kernels_per_layer": {"decode": 50, "prefill": 60, "narrow_decode": 40}},
     "'narrow_decode' count exactly when narrow_decode_batch > 0 \\(it is 0\\)"),
])
def test_invalid_overheads_are_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        with_overheads(roofline_only(load_profile("h200")), **change)


def test_overhead_provenance_is_required_once_set_and_allowed_at_default():
    h200 = roofline_only(load_profile("h200"))
    with pytest.raises(ValueError, match=r"missing \['kernel_gpu_s'\]"):
        replace(h200, kernel_gpu_s=1e-6, kernels_per_layer={"decode": 1, "prefill": 1},
                kernels_per_forward={"decode": 0, "prefill": 0},
                provenance={**h200.provenance, "kernels_per_layer": "measured", "kernels_per_forward": "measured"})
    zeros = replace(h200, provenance={**h200.provenance, "launch_cpu_s": "measured"})
    assert zeros.launch_cpu_s == 0


# --- the fit ---------------------------------------------------------------------------------

def test_split_kernel_counts_and_holdout_mask():
    names = ["gemm"] * (4 * 3 + 1) + ["norm"] * (2 * 3 + 1) + ["rope"] * 3 + ["embed", "argmax"]
    assert split_kernel_counts(names, 3) == (7, 4)  # 4 gemm + 2 norm + 1 rope; lm_head, final norm, embed, argmax
    with pytest.raises(ValueError):
        split_kernel_counts(names, 0)
    groups = ["d", "d", "p", "d", "p", "d", "s"]
    assert holdout_mask(groups).tolist() == [False, True, False, False, True, True, False]


CASES = [([(1, ctx - 1)] * b, 132, True) for b in (1, 8, 32, 64, 128) for ctx in (512, 2048, 8192)]
CASES += [([(1, 2047)] * b, s, graphs) for b in (8, 32) for s in (16, 32, 64) for graphs in (True, False)]
CASES += [([(n, 0)] * b, 132, False) for b, n in ((1, 512), (1, 2048), (1, 8192), (8, 1024), (4, 256))]
"""Calibration-like iterations of Qwen3-8B on the H200: (requests, SMs, replayed from graphs):
decode from graphs (all SMs and split levels), eager prefills and eager split decodes."""


def h200_at(efficiency):
    """The H200's pure roofline with ``gemm_efficiency`` ``efficiency``."""
    h200 = roofline_only(load_profile("h200"))
    return replace(h200, gemm_efficiency=efficiency, provenance={**h200.provenance, "gemm_efficiency": "measured"})


def rooflines(efficiency=1.0):
    """The H200 roofline of each of ``CASES`` with ``gemm_efficiency`` ``efficiency``, seconds."""
    roof = CostModel(QWEN, h200_at(efficiency))
    return [float(roof.predict_total(reqs, sms)) for reqs, sms, _ in CASES]


def synthetic(g, h, noise=0.0, seed=0, efficiency=1.0):
    """``CASES`` as (roofline, kernels, graphs, measured) columns, timed by the overhead model with
    ``g``, ``h`` (~1000 kernels a forward) and ``gemm_efficiency`` ``efficiency``, times
    (1 + noise * N(0, 1)); the roofline column at efficiency 1."""
    truth = CostModel(QWEN, with_overheads(h200_at(efficiency), kernel_gpu_s=g, launch_cpu_s=h,
                                           kernels_per_layer={"decode": 28, "prefill": 30}))
    rng = np.random.default_rng(seed)
    rows = []
    for (reqs, sms, graphs), roof in zip(CASES, rooflines()):
        kind = "decode" if reqs[0][0] == 1 else "prefill"
        measured = float(truth.predict_total(reqs, sms, graphs=graphs)) * (1 + noise * rng.standard_normal())
        rows.append((roof, truth.profile.kernel_count(kind, 36), graphs, measured))
    return [list(col) for col in zip(*rows)]


def test_fit_recovers_exact_constants():
    fit = fit_overheads(*synthetic(3e-6, 15e-6))
    assert fit.kernel_gpu_s == pytest.approx(3e-6) and fit.launch_cpu_s == pytest.approx(15e-6)


def test_fit_recovers_constants_under_noise():
    for seed in range(5):
        fit = fit_overheads(*synthetic(3e-6, 15e-6, noise=0.02, seed=seed))
        assert fit.kernel_gpu_s == pytest.approx(3e-6, rel=0.1)
        assert fit.launch_cpu_s == pytest.approx(15e-6, rel=0.05)


def test_fit_of_a_pure_roofline_is_zero_and_bad_input_raises():
    fit = fit_overheads(*synthetic(0.0, 0.0))
    assert (fit.kernel_gpu_s, fit.launch_cpu_s) == (0.0, 0.0)
    # measured below the roofline never gives negative constants
    assert fit_overheads([2.0], [10], [True], [1.0]).kernel_gpu_s == 0.0
    with pytest.raises(ValueError):
        fit_overheads([], [], [], [])
    with pytest.raises(ValueError):
        fit_overheads([1.0], [0], [True], [1.0])


def test_predict_fitted_by_hand():
    fit = OverheadFit(kernel_gpu_s=2e-6, launch_cpu_s=10e-6)
    # replayed: 1 ms + 100 x 2 us; eager: max(1 ms + 200 us, 100 x 10 us = 1 ms); eager, host bound:
    # max(0.1 ms + 200 x 2 us, 200 x 10 us = 2 ms)
    got = predict_fitted([1e-3, 1e-3, 1e-4], [100, 100, 200], [True, False, False], fit)
    assert got == pytest.approx([1.2e-3, 1.2e-3, 2e-3])


def test_fit_with_efficiency_recovers_the_compute_share_and_constants():
    for e in (0.85, 0.62):
        _, kernels, graphs, measured = synthetic(3e-6, 15e-6, efficiency=e)
        fit = fit_with_efficiency(rooflines, kernels, graphs, measured)
        assert fit.gemm_efficiency == e
        assert fit.kernel_gpu_s == pytest.approx(3e-6) and fit.launch_cpu_s == pytest.approx(15e-6)
    # the plain stages on the efficiency-1 roofline misfit what the prefills lose
    roof, kernels, graphs, measured = synthetic(3e-6, 15e-6, efficiency=0.85)
    plain = fit_overheads(roof, kernels, graphs, measured)
    assert np.median(np.abs(predict_fitted(roof, kernels, graphs, plain) / measured - 1)[-5:]) > 0.05


def test_fit_with_efficiency_ties_keep_the_larger_share_and_bad_grids_raise():
    _, kernels, graphs, measured = synthetic(3e-6, 15e-6)
    flat = rooflines()  # rooflines that do not depend on e: every e fits equally well
    fit = fit_with_efficiency(lambda e: flat, kernels, graphs, measured, grid=(0.7, 0.9, 0.8))
    assert fit.gemm_efficiency == 0.9
    for grid in ((), (0.0, 0.5), (0.9, 1.1)):
        with pytest.raises(ValueError):
            fit_with_efficiency(rooflines, kernels, graphs, measured, grid=grid)
