"""Hardware profiles: shipped JSON, interpolation of Pi(S) and BW(S), range errors."""

import json
from dataclasses import replace
from importlib import resources

import numpy as np
import pytest

from duetserve.planner.hardware import (
    available_profiles,
    load_profile,
    saturating_points,
)


def test_shipped_profiles_load_with_provenance():
    assert available_profiles() == ["a100", "h100", "h20", "h200"]
    for name in available_profiles():
        p = load_profile(name)
        assert p.name == name
        assert p.num_tpcs * 2 == p.num_sms
        assert p.bandwidth(p.num_sms) <= p.peak_bandwidth and p.compute_rate(p.num_sms) <= p.peak_flops
    h200 = load_profile("H200")
    assert h200.provenance["bandwidth_points"] == "measured"
    assert h200.provenance["peak_flops"] == "datasheet"
    assert set(load_profile("h100").provenance.values()) == {"datasheet"}
    assert (load_profile("a100").num_sms, load_profile("h20").num_sms) == (108, 78)


def test_h200_curves_are_the_probe_measurements():
    p = load_profile("h200")
    # GEMM TFLOP/s and the lower of copy / gemv GB/s at each measured S (h200-probe.json)
    assert p.compute_rate(16) == pytest.approx(111e12)
    assert p.compute_rate(132) == pytest.approx(797e12)
    assert p.bandwidth(32) == pytest.approx(2204e9)  # copy 2204 < gemv 2638
    assert p.bandwidth(96) == pytest.approx(3636e9)  # gemv 3636 < copy 3867
    assert p.granularity("greenctx") == 8 and p.granularity("tpcmask") == 2
    assert p.decode_interference == pytest.approx(0.124 / 0.089, rel=1e-3)


def test_linear_interpolation_between_points_and_from_zero():
    p = load_profile("h200")
    # halfway between (48, 333) and (64, 430) TFLOP/s
    assert p.compute_rate(56) == pytest.approx(381.5e12)
    # 40 SMs: 2204 + (3029 - 2204) * 8 / 16 GB/s
    assert p.bandwidth(40) == pytest.approx(2616.5e9)
    # below the first measured point: the chord from (0, 0) to (16, 1197 GB/s)
    assert p.bandwidth(8) == pytest.approx(598.5e9)
    np.testing.assert_allclose(p.compute_rate(np.array([16, 132])), [111e12, 797e12])


@pytest.mark.parametrize("sms", [0, -8, 133, 200, 132.5])
def test_out_of_range_sms_raise(sms):
    p = load_profile("h200")
    with pytest.raises(ValueError):
        p.compute_rate(sms)
    with pytest.raises(ValueError):
        p.bandwidth(sms)


def test_efficiencies_and_saturating_curve():
    p = replace(load_profile("h100"), bandwidth_points=saturating_points(3.35e12, 66, 132),
                bandwidth_efficiency=0.85, compute_efficiency=0.5,
                compute_points=saturating_points(989e12, 132, 132))
    assert p.bandwidth(33) == pytest.approx(3.35e12 * 0.85 * 0.5)
    assert p.bandwidth(100) == pytest.approx(3.35e12 * 0.85)
    assert p.compute_rate(80) == pytest.approx(989e12 * 0.5 * 80 / 132)
    assert saturating_points(1.0, 264, 132) == ((132, 0.5),)
    with pytest.raises(ValueError):
        replace(p, compute_efficiency=1.5)


def test_invalid_profiles_are_rejected(tmp_path):
    raw = _raw("h200")
    raw["bandwidth_points"][-1][0] = 120  # curve no longer ends at num_sms
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="num_sms"):
        load_profile(path)
    raw = _raw("h200")
    del raw["provenance"]["hbm_bytes"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="provenance"):
        load_profile(path)
    raw = _raw("h200")
    raw["compute_points"][0][1] = 2e15  # above the datasheet peak: a unit error
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="peak"):
        load_profile(path)
    raw = _raw("h200")
    raw["attention_efficiency"] = 1.5
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="attention_efficiency"):
        load_profile(path)
    raw = _raw("h100")
    raw["attention_efficiency"] = 0.5  # differs from the default: needs a provenance entry
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="provenance"):
        load_profile(path)
    for key, value in (("partition_granularity", 8), ("partition_min_sms", {"greenctx": 0, "tpcmask": 32}),
                       ("partition_min_sms", {"greenctx": 200, "tpcmask": 32}),
                       ("partition_granularity", {"greenctx": 2.5, "tpcmask": 2})):
        raw = _raw("h200")
        raw[key] = value  # a bare number, no SMs, more SMs than the GPU has, a fraction
        path.write_text(json.dumps(raw))
        with pytest.raises(ValueError, match=f"{key} maps partition backends to SM counts in \\[1, num_sms=132\\]"):
            load_profile(path)
    for key, value, message in (
            ("kernel_gpu_s", float("nan"), "kernel_gpu_s must be a number \\(finite\\), got nan"),  # hung simulate
            ("host_eager_s", float("inf"), "host_eager_s must be a number \\(finite\\), got inf"),
            ("num_sms", "132", "num_sms must be an integer \\(finite\\), got '132'"),
            ("decode_interference", None, "decode_interference must be a number \\(finite\\), got None"),
            ("narrow_decode_batch", "x", "narrow_decode_batch must be an integer \\(finite\\), got 'x'"),
            ("bandwidth_points", [[16]], "bandwidth_points must be a list of \\[SMs, rate\\] number pairs"),
            ("compute_points", [[16, 1e14], [132, float("nan")]], "compute_points must be finite numbers")):
        raw = _raw("h200")
        raw[key] = value
        path.write_text(json.dumps(raw))
        with pytest.raises(ValueError, match=message):
            load_profile(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="not a JSON object but list"):
        load_profile(path)
    path.write_text(json.dumps({"num_sms": 132}))
    with pytest.raises(ValueError, match="missing keys \\['allreduce_alpha_s', 'bandwidth_points', 'compute_capability_major'"):
        load_profile(path)
    with pytest.raises(ValueError, match="no profile"):
        load_profile("b200")
    with pytest.raises(ValueError, match="backend"):
        load_profile("h200").granularity("mig")


def test_profile_from_a_path(tmp_path):
    raw = _raw("h20")
    raw["name"] = "my-h20"
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(raw))
    assert load_profile(str(path)).name == "my-h20"


def _raw(name):
    return json.loads((resources.files("duetserve.planner") / "profiles" / f"{name}.json").read_text())


def test_shipped_h200_carries_the_measured_kernel_overheads():
    """Fitted by `duetserve calibrate` on the lent H200, 2026-11-30; decode kernels counted after the KV-write fusion (docs/benchmarks.md)."""
    from duetserve.planner.hardware import roofline_only

    h200 = load_profile("h200")
    assert h200.kernel_gpu_s == pytest.approx(3.52e-6) and h200.launch_cpu_s == pytest.approx(42.85e-6)
    # counted by calibrate's profiled forward (453 = 36 x 12 + 21), less the split-merge kernel a layer
    # that decode attention no longer launches (profile_decode.py: 350 = 36 x 9 + 26 at 8 x 512 in graphs)
    assert h200.kernel_count("decode", 36) == 36 * 11 + 21 == 417
    assert h200.kernel_count("narrow_decode", 36) == 36 * 9 + 26 == 350
    assert h200.kernel_count("prefill", 36) == 36 * 10 + 22 == 382
    # the share of Pi(S) the model's GEMMs reach, refitted from two calibrations (thirty-fifth session)
    assert h200.gemm_efficiency == 0.81 and h200.provenance["gemm_efficiency"] == "measured"
    # serving host time: per request fitted to seven served runs' iteration logs, the eager term refitted
    # to a served log re-predicted with gemm_efficiency (duetserve.calibrate.host)
    assert (h200.host_per_request_s, h200.host_eager_s) == (5.43e-5, 0.0)
    # no piecewise term of its own (five logged iterations): piecewise iterations are priced as eager ones
    assert h200.host_piecewise_s is None and h200.piecewise_host_s == h200.host_eager_s
    assert (h200.host_gap_s, h200.host_gap_per_request_s) == (7.99e-4, 1.098e-5)  # the same logs' gap_s
    assert h200.gap_s(100) == pytest.approx(7.99e-4 + 100 * 1.098e-5)
    assert h200.provenance["host_eager_s"] == "measured"
    assert h200.provenance["kernel_gpu_s"] == "measured"
    assert h200.attention_efficiency == 0.4 and h200.provenance["attention_efficiency"] == "measured"
    bare = roofline_only(h200)
    assert (bare.kernel_gpu_s, bare.launch_cpu_s, bare.kernels_per_layer, bare.attention_efficiency,
            bare.host_per_request_s, bare.host_eager_s) == (0.0, 0.0, {}, 1.0, 0.0, 0.0)
