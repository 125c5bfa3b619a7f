"""duetserve calibrate: error statistics, profile round trip, envelope, shape selection, the
procedure with a fake GPU, CLI errors; one GPU test (marker gpu) of the CUDA bench."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from duetserve.calibrate import cli as calibrate_cli
from duetserve.calibrate.__main__ import main as calibrate_main
from duetserve.calibrate.overhead import split_kernel_counts
from duetserve.calibrate.profile import (
    OVERHEAD_FIELDS,
    DeviceFacts,
    build_profile,
    curve_points,
    lower_envelope,
    write_profile,
)
from duetserve.calibrate.report import (
    error_stats,
    group,
    format_errors,
    plot_predictions,
    relative_errors,
)
from duetserve.calibrate.runner import Options, prediction_row, run_calibration
from duetserve.calibrate.workload import (
    MAX_CONTEXT,
    Capacity,
    Shape,
    make_batch,
    plan_shapes,
    rotation_sets,
    sm_levels,
)
from duetserve.engine.kv_cache import BlockManager
from duetserve.planner.cost_model import CostModel, ModelShape
from duetserve.planner.hardware import NARROW_DECODE, PIECEWISE, load_profile, roofline_only

H200 = roofline_only(load_profile("h200"))
QWEN = ModelShape.preset("qwen3-8b")
GREEN_LEVELS = tuple(range(8, 125, 8))
FACTS = DeviceFacts("NVIDIA H200", 132, 9, 149250113536, "greenctx", GREEN_LEVELS)
# docs/design.md section 5: copy and gemv GB/s on green contexts of S SMs.
COPY = {16: 1197, 24: 1724, 32: 2204, 48: 3029, 64: 3570, 96: 3867, 132: 4187}
GEMV = {16: 1721, 24: 2282, 32: 2638, 48: 3201, 64: 3714, 96: 3636, 132: 4037}
KV_TOKEN_BYTES = 36 * 2 * 8 * 128 * 2  # Qwen3-8B bf16 K and V, all layers


def row(kind, measured, predicted, base=None, sms=132, roofline=None, split=None, held=None):
    return {"kind": kind, "batch": 1, "q": 1, "c": 0, "sms": sms, "measured_s": measured, "roofline_s": roofline,
            "predicted_s": predicted, "base_predicted_s": base, "split": split, "holdout_predicted_s": held}


# --- error statistics -------------------------------------------------------------------------

def test_relative_errors_and_stats_on_hand_computed_numbers():
    assert relative_errors([1.1, 0.5], [1.0, 1.0]) == pytest.approx([0.1, 0.5])
    # decode errors 10%, 20%, 30%, 40%, 50% (order shuffled): median 30%, p90 = 40% + 0.6 * 10% = 46%
    rows = [row("decode", 1.0, p) for p in (1.3, 0.5, 1.1, 0.8, 1.4)]
    rows += [row("prefill", 2.0, 2.5, base=1.0), row("prefill", 4.0, 3.0, base=None)]
    stats = error_stats(rows, "predicted_s")
    assert (stats["decode"].count, stats["decode"].median, stats["decode"].p90) == (5, pytest.approx(0.3),
                                                                                    pytest.approx(0.46))
    assert stats["prefill"].median == pytest.approx(0.25)  # 25% and 25%
    base = error_stats(rows, "base_predicted_s")
    assert list(base) == ["prefill"] and base["prefill"].count == 1 and base["prefill"].p90 == pytest.approx(0.5)
    table = format_errors(rows)
    prefill, decode = table.splitlines()[1:3]
    assert decode.startswith("decode                  5") and " 30.0% / 46.0% ( 5)" in decode
    assert prefill.endswith(" 50.0% / 50.0% ( 1)")  # the base profile, last column


def test_error_stats_of_held_out_rows():
    # roofline 50% under on every row; the fit half's overheads predict the held-out rows within 10% and 0%
    rows = [row("decode", 1.0, 1.0, roofline=0.5, split="fit"),
            row("decode", 1.0, 1.05, roofline=0.5, split="holdout", held=1.1),
            row("decode", 2.0, 2.0, roofline=1.0, split="holdout", held=2.0)]
    assert error_stats(rows, "roofline_s", "holdout")["decode"].count == 2
    held = error_stats(rows, "holdout_predicted_s")["decode"]
    assert (held.count, held.median) == (2, pytest.approx(0.05))
    cells = format_errors(rows).splitlines()[1]
    assert cells.split()[:2] == ["decode", "3"]
    assert "50.0% / 50.0% ( 3)" in cells and "50.0% / 50.0% ( 2)" in cells and "5.0% /  9.0% ( 2)" in cells


def test_relative_errors_refuse_bad_input():
    with pytest.raises(ValueError, match="2 predictions for 1"):
        relative_errors([1, 2], [1])
    with pytest.raises(ValueError, match="positive"):
        relative_errors([1], [0])


# --- envelope, profile round trip -------------------------------------------------------------

def test_lower_envelope_of_design_table_is_the_shipped_h200_bandwidth_curve():
    env = lower_envelope({s: v * 1e9 for s, v in COPY.items()}, {s: v * 1e9 for s, v in GEMV.items()})
    assert curve_points(env, 132, "bw") == H200.bandwidth_points


def test_lower_envelope_fills_a_missing_point_from_the_other_curve():
    assert lower_envelope({16: 5.0, 132: 9.0}, {132: 8.0, 64: 7.0}) == {16: 5.0, 64: 7.0, 132: 8.0}
    with pytest.raises(ValueError, match="no measurement on all 132 SMs"):
        curve_points({16: 1.0, 64: 2.0}, 132, "gemm")


def measured_profile(bandwidth=None):
    compute = {s: float(H200.compute_rate(s)) for s in (16, 32, 64, 132)}
    bandwidth = bandwidth or {s: v * 1e9 for s, v in COPY.items()}
    return build_profile(H200, "h200-lent", FACTS, compute, bandwidth, "method.")


def test_profile_round_trip_through_load_profile(tmp_path):
    path = tmp_path / "p.json"
    written = measured_profile()
    written["calibration"] = [row("decode", 1e-3, 1.1e-3)]
    loaded = write_profile(written, path)
    assert loaded == load_profile(path)
    assert json.loads(path.read_text())["calibration"][0]["measured_s"] == 1e-3
    assert loaded.name == "h200-lent" and loaded.num_sms == 132 and loaded.num_tpcs == 66
    assert loaded.compute_points[0] == (16.0, 111e12)
    assert loaded.provenance["bandwidth_points"] == "measured" and loaded.provenance["peak_flops"] == "datasheet"
    assert loaded.decode_interference == H200.decode_interference and "method." in loaded.notes
    # between measured points BW(S) is the chord: 40 SMs halfway between 32 and 48
    assert loaded.bandwidth(40) == pytest.approx((2204e9 + 3029e9) / 2)
    link = tmp_path / "link.json"  # written in place: a link stays a link (a rename replaced it)
    link.symlink_to(path)
    write_profile(measured_profile(), link)
    assert link.is_symlink() and "calibration" not in json.loads(path.read_text())


def test_write_profile_keeps_the_old_file_when_the_new_one_does_not_load(tmp_path):
    path = tmp_path / "p.json"
    write_profile(measured_profile(), path)
    before = path.read_text()
    with pytest.raises(ValueError, match="datasheet peak"):
        write_profile(measured_profile({16: 1e12, 132: 9e12}), path)  # above the 4.8 TB/s of the base
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["p.json"]


# --- levels, rotation, shapes -----------------------------------------------------------------

def test_sm_levels_per_backend():
    assert sm_levels(GREEN_LEVELS, 132) == [16, 24, 32, 48, 64, 96, 132]
    assert sm_levels(range(2, 131, 2), 132, min_sms=48) == [48, 64, 96, 132]
    assert sm_levels((), 132) == [132]
    assert sm_levels(GREEN_LEVELS, 78) == [16, 24, 32, 48, 64, 78]  # 96 is past the device's SMs


def test_rotation_sets_exceed_l2():
    assert rotation_sets(1 << 30) == 2
    assert rotation_sets(10e6) == 12  # 12 x 10 MB >= 2 x 60 MB
    with pytest.raises(ValueError):
        rotation_sets(0)


def capacity(kv_bytes=90 << 30, **kw):
    args = {"num_sms": 132, "kv_blocks": kv_bytes // (16 * KV_TOKEN_BYTES), "block_size": 16, "max_num_seqs": 128,
                "max_num_batched_tokens": 8192, "max_model_len": MAX_CONTEXT}
    return Capacity(**{**args, **kw})


def test_plan_shapes_skips_what_does_not_fit_in_the_kv_cache():
    shapes, skipped = plan_shapes(capacity(), GREEN_LEVELS)
    labels = {s.label for s in shapes}
    assert {s.label for s, _ in skipped} == {"decode 128x8192 @132"}  # 1M tokens > 655k
    assert "decode 64x8192 @132" in labels and "prefill 8x1024 @132" in labels
    assert sum(s.kind == "decode" and s.sms == 132 for s in shapes) == 14
    assert [s.sms for s in shapes if s.sms < 132] == [16, 16, 16, 32, 32, 32, 64, 64, 64]
    assert all(s.k == 8 for s in shapes if s.kind == "decode") and all(s.k == 1 for s in shapes if s.kind != "decode")
    assert "needs 65664 KV blocks" in skipped[0][1]  # 128 x ceil((8192 + 7 look-ahead tokens) / 16)
    mixed = [s for s in shapes if s.kind == "mixed"]
    assert [s.label for s in mixed] == ["mixed 16x1024+2032/0 @132", "mixed 64x2048+1984/0 @132",
                                        "mixed 120x1024+1928/4096 @132", "mixed 120x2048+1024/0 @132"]
    assert mixed[2].reqs == [(1, 1023)] * 120 + [(1928, 4096)]


def test_a_mixed_shape_needs_room_for_its_decodes_and_its_chunk():
    shape = Shape("mixed", 120, 1, 1023, 132, chunk=1928, chunk_cached=4096)
    # 120 x ceil(1024 / 16) + ceil((1928 + 4096) / 16) = 7680 + 377 blocks; 121 sequences; 2048 tokens
    assert capacity(kv_blocks=8057).misfit(shape) is None
    assert capacity(kv_blocks=8056).misfit(shape) == "needs 8057 KV blocks, the cache has 8056"
    assert capacity(max_num_seqs=120).misfit(shape) == "batch 121 > max_num_seqs 120"
    assert capacity(max_num_batched_tokens=2047).misfit(shape) == "2048 tokens > max_num_batched_tokens 2047"
    assert capacity(max_model_len=6000).misfit(shape) == "6024 tokens > max_model_len 6000"


def test_plan_shapes_quick_none_backend_and_limits():
    shapes, _ = plan_shapes(capacity(), GREEN_LEVELS, quick=True)
    assert [(s.batch, s.sms) for s in shapes if s.sms < 132] == [(32, 16), (32, 32), (32, 64)]
    shapes, _ = plan_shapes(capacity(), ())
    assert all(s.sms == 132 for s in shapes)
    _, skipped = plan_shapes(capacity(max_num_seqs=32, max_num_batched_tokens=4096, max_model_len=4096), ())
    reasons = {s.label: why for s, why in skipped}
    assert reasons["decode 64x512 @132"] == "batch 64 > max_num_seqs 32"
    assert reasons["prefill 1x8192 @132"] == "8192 tokens > max_num_batched_tokens 4096"
    assert reasons["decode 1x8192 @132"] == "8199 tokens > max_model_len 4096"  # 7 look-ahead slots


def test_lookahead_steps_need_their_kv_slots():
    split = Shape("decode", 32, 1, 2047, 32, k=8)
    assert split.tokens_per_request == 2055
    exact = capacity(kv_blocks=32 * 128)  # 32 requests x 2048 tokens, nothing more
    assert exact.misfit(Shape("decode", 32, 1, 2047, 132)) is None
    assert exact.misfit(split) == "needs 4128 KV blocks, the cache has 4096"


@dataclass
class FakeEngine:
    block_manager: BlockManager = field(default_factory=lambda: BlockManager(100, 16))
    model: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(dims=SimpleNamespace(vocab_size=50)))


def test_make_batch_allocates_context_and_lookahead_slots():
    engine = FakeEngine()
    seqs = make_batch(engine, 2, 40, 1, extra_tokens=7)
    assert [(s.num_new_tokens, s.num_cached_tokens, len(s.seq.block_table)) for s in seqs] == [(1, 39, 3)] * 2
    assert seqs[0].seq.num_prompt_tokens == 39 and seqs[0].samples
    prefill = make_batch(engine, 1, 32, 32)[0]
    assert (prefill.num_cached_tokens, prefill.seq.num_prompt_tokens, len(prefill.seq.block_table)) == (0, 32, 2)
    assert engine.block_manager.num_free_blocks == 100 - 8
    assert [s.seq.seq_id for s in seqs + [prefill]] == [10_000_000, 10_000_001, 10_000_000]
    assert make_batch(engine, 1, 16, 16, first_id=5)[0].seq.seq_id == 5


def test_make_batch_prompts_vary_within_and_across_sequences_reproducibly():
    # One repeated id keeps every activation row equal (docs/benchmarks.md, thirty-fifth H200 session).
    a, b = (s.seq.token_ids for s in make_batch(FakeEngine(), 2, 400, 400))
    assert all(0 <= t < 50 for t in a + b)
    assert len(set(a)) > 40 and a != b  # 400 draws from 50 ids: all but a few appear
    assert make_batch(FakeEngine(), 1, 400, 400)[0].seq.token_ids == a


# --- the procedure with a fake GPU --------------------------------------------------------------

G, H = 3e-6, 15e-6
"""The fake GPU's per-kernel constants, seconds: GPU time per kernel, host time per eager launch."""


class FakeBench:
    """Rates from the shipped H200 profile (gemv 10% above copy); iteration times from the H200
    roofline with ``Pi(S)`` scaled by ``efficiency``, plus per-kernel overheads ``G`` and ``H`` (decode 28 kernels per layer + 3 outside,
    prefill 30 + 4, and with ``narrow`` > 0 graph-replayed decodes of at most ``narrow``
    sequences 26 + 3); decode replayed from CUDA graphs except on the 16-SM level; failures
    where asked."""

    def __init__(self, facts=FACTS, fail=(), layers=36, narrow=8, efficiency=1.0):
        self.facts, self.fail, self.layers, self.narrow = facts, set(fail), layers, narrow
        counts = ({"decode": 28, "prefill": 30}, {"decode": 3, "prefill": 4})
        if narrow:
            counts = ({**counts[0], NARROW_DECODE: 26}, {**counts[1], NARROW_DECODE: 3})
        self.truth = CostModel(QWEN, replace(H200, kernel_gpu_s=G, launch_cpu_s=H, kernels_per_layer=counts[0],
                                             gemm_efficiency=efficiency,
                                             kernels_per_forward=counts[1], narrow_decode_batch=narrow,
                                             provenance={**H200.provenance, **dict.fromkeys(OVERHEAD_FIELDS, "measured")}))
        self.loaded = None
        self.counted = []

    def primitive_rate(self, name, sms):
        if (name, sms) in self.fail:
            raise RuntimeError(f"{name} broke")
        bw = float(H200.bandwidth(sms))
        return {"copy": bw, "gemv": 1.1 * bw, "gemm": float(H200.compute_rate(sms))}[name]

    def load_model(self, folder, load_format):
        self.loaded = (folder, load_format)
        return capacity()

    def runs_graphs(self, shape):
        return shape.kind == "decode" and shape.sms != 16

    def narrow_decode_batch(self):
        return self.narrow

    def kernel_names(self, shape, replay=False):
        if "kernels" in self.fail or (replay and "narrow kernels" in self.fail):
            raise RuntimeError("CUPTI unavailable")
        self.counted.append((shape.label, replay))
        narrow = replay and self.runs_graphs(shape) and shape.batch <= self.narrow
        adds = 19 if narrow else 21 if shape.kind == "decode" else 23
        per_layer = ["gemm"] * 4 + ["norm"] * 2 + ["attn"] + ["add"] * adds
        return per_layer * self.layers + ["embed", "norm", "gemm"] + ([] if shape.kind == "decode" else ["index"])

    def iteration_seconds(self, shape):
        if shape.label in self.fail:
            raise RuntimeError("out of memory")
        # the engine timed alone: no serving host time (the shipped H200 profile has some)
        return float(self.truth.predict_total(shape.reqs, shape.sms, graphs=self.runs_graphs(shape), host=False))


def options(tmp_path, **kw):
    return Options(**{"gpu_name": "h200-lent", "out": tmp_path / "p.json", "base": H200, "model_folder": tmp_path,
                             "model_shape": QWEN, **kw})


def test_run_calibration_measures_writes_and_reports_failures(tmp_path):
    bench = FakeBench(fail={("gemv", 24), ("gemm", 16), "decode 8x2048 @132", "decode 32x2048 @16"})
    logs = []
    # serving host terms (the shipped profile's) are copied into the profile, never predicted here:
    # the engine is timed alone
    base = replace(H200, host_per_request_s=2.29e-4, host_eager_s=0.01613,
                   provenance={**H200.provenance, "host_per_request_s": "measured", "host_eager_s": "measured"})
    result = run_calibration(bench, options(tmp_path, base=base), logs.append)
    assert (result.profile.host_per_request_s, result.profile.host_eager_s) == (2.29e-4, 0.01613)
    assert bench.loaded == (tmp_path, "dummy")
    assert len(result.errors) == 4 and "gemm on 16 SMs: RuntimeError('gemm broke')" in result.errors
    assert any(line.startswith("FAILED decode 8x2048 @132") for line in logs)
    assert result.curves["gemv"].keys() == {16, 32, 48, 64, 96, 132}
    assert result.profile.compute_points[0][0] == 24  # the 16-SM GEMM failed
    assert result.profile.bandwidth_points == H200.bandwidth_points  # envelope = copy = the H200 curve
    assert result.skipped == ["decode 128x8192 @132: needs 65664 KV blocks, the cache has 40960"]
    written = json.loads((tmp_path / "p.json").read_text())
    assert written["calibration"] == result.rows and len(result.rows) == 14 + 4 + 4 + 9 - 2
    assert load_profile(tmp_path / "p.json") == result.profile
    # kernels: 28 / 30 per layer, the final norm, lm_head and embedding (+ an index for prefill) outside;
    # graphs of at most 8 decodes 26 (the first decode shape, 1 x 512, counted again from its graph)
    assert result.kernel_counts == {"decode": (28, 3), "prefill": (30, 4), NARROW_DECODE: (26, 3)}
    assert bench.counted == [("decode 1x512 @132", False), ("prefill 1x512 @132", False),
                             ("decode 1x512 @132", True)]
    assert result.narrow_decode_batch == result.profile.narrow_decode_batch == 8
    assert result.profile.kernels_per_layer == {"decode": 28, "prefill": 30, NARROW_DECODE: 26}
    assert result.profile.provenance["kernel_gpu_s"] == "measured"
    # Same curves at the measured S as the H200's (compute differs only below 24 SMs, which
    # decode on 16 SMs, bandwidth bound, barely feels), so both fits recover the constants
    for fit in (result.fit, result.holdout_fit):
        assert fit.kernel_gpu_s == pytest.approx(G) and fit.launch_cpu_s == pytest.approx(H)
        assert fit.gemm_efficiency == 1.0
    assert (result.profile.kernel_gpu_s, result.profile.launch_cpu_s) == (result.fit.kernel_gpu_s, result.fit.launch_cpu_s)
    roofline = error_stats(result.rows, "roofline_s")
    assert roofline["decode"].median > 0.2 and roofline["prefill"].p90 > 0.2  # small prefills: host bound
    for key in ("predicted_s", "holdout_predicted_s"):
        stats = error_stats(result.rows, key)
        assert max(s.p90 for s in stats.values()) < 1e-3
    assert (stats["decode"].count, stats["decode, split SMs"].count, stats["prefill"].count,
            stats["mixed"].count) == (6, 4, 2, 2)
    mixed = [r for r in result.rows if r["kind"] == "mixed"]
    assert [(r["batch"], r["c"], r["chunk"], r["chunk_cached"], r["graphs"]) for r in mixed] == [
        (16, 1023, 2032, 0, False), (64, 2047, 1984, 0, False), (120, 1023, 1928, 4096, False),
        (120, 2047, 1024, 0, False)]
    assert {r["kernels"] for r in mixed} == {36 * 30 + 4}  # eager: the prefill count
    assert {r["split"] for r in result.rows} == {"fit", "holdout"}
    split_16 = [r for r in result.rows if r["sms"] == 16]
    assert [r["graphs"] for r in split_16] == [False, False] and split_16[0]["kernels"] == 36 * 28 + 3
    kernels = {(r["batch"], r["graphs"]) for r in result.rows if r["kind"] == "decode" and r["kernels"] == 36 * 26 + 3}
    assert kernels == {(1, True), (8, True)}  # graph replays of at most 8 decodes, on 132 SMs and split levels
    base = error_stats(result.rows, "base_predicted_s")  # the shipped H200: a pure roofline
    assert base["decode"].median == pytest.approx(roofline["decode"].median)


@pytest.mark.parametrize("narrow, fail", [(0, ()), (8, ("narrow kernels",))])
def test_without_a_narrow_count_every_decode_counts_alike(tmp_path, narrow, fail):
    """An engine without the narrow path (``narrow_decode_batch`` 0), or whose narrow count fails
    (reported): decode and prefill counts only, and the fit charges every decode 28 a layer."""
    bench = FakeBench(narrow=narrow, fail=fail)
    result = run_calibration(bench, options(tmp_path), lambda _: None)
    assert result.kernel_counts == {"decode": (28, 3), "prefill": (30, 4)}
    assert result.narrow_decode_batch == result.profile.narrow_decode_batch == 0
    assert [e for e in result.errors if "kernel count" in e] == \
        (["kernel count of decode 1x512 @132 (graphs): RuntimeError('CUPTI unavailable')"] if fail else [])
    assert {r["kernels"] for r in result.rows if r["kind"] == "decode"} == {36 * 28 + 3}
    if not narrow:  # the truth has no narrow path either: the fit recovers the constants
        assert (result.fit.kernel_gpu_s, result.fit.launch_cpu_s) == (pytest.approx(G), pytest.approx(H))


def test_failed_kernel_count_leaves_the_roofline(tmp_path):
    result = run_calibration(FakeBench(fail={"kernels"}), options(tmp_path), lambda _: None)
    assert result.fit is None and result.kernel_counts is None
    assert any("CUPTI unavailable" in e for e in result.errors)
    assert all(r["predicted_s"] == r["roofline_s"] and r["kernels"] is None for r in result.rows)
    assert load_profile(tmp_path / "p.json").kernel_gpu_s == 0
    assert "not fitted" in calibrate_cli.fit_summary(result)


def test_a_base_profile_with_overheads_does_not_leak_into_the_roofline(tmp_path):
    base = FakeBench().truth.profile
    result = run_calibration(FakeBench(), options(tmp_path, base=base), lambda _: None)
    assert result.fit.kernel_gpu_s == pytest.approx(G)
    assert all(r["base_predicted_s"] == pytest.approx(r["measured_s"]) for r in result.rows)


def test_the_fit_finds_the_share_of_the_gemm_curve_the_model_reaches(tmp_path):
    # the engine at 0.85 of the measured 8192^3 GEMM rate, and a base profile already carrying 0.85:
    # the rows' roofline is the measured curves' own (efficiency 1), the fit finds 0.85
    bench = FakeBench(efficiency=0.85)
    result = run_calibration(bench, options(tmp_path, base=bench.truth.profile), lambda _: None)
    for fit in (result.fit, result.holdout_fit):
        assert (fit.kernel_gpu_s, fit.launch_cpu_s, fit.gemm_efficiency) == (pytest.approx(G), pytest.approx(H), 0.85)
    assert load_profile(tmp_path / "p.json").gemm_efficiency == result.profile.gemm_efficiency == 0.85
    prefill = next(r for r in result.rows if (r["kind"], r["batch"], r["q"]) == ("prefill", 1, 8192))
    assert prefill["measured_s"] / prefill["roofline_s"] > 1.1  # GEMM-bound: about 1 / 0.85
    assert max(s.p90 for s in error_stats(result.rows, "predicted_s").values()) < 1e-3
    assert "gemm_efficiency 0.85" in calibrate_cli.fit_summary(result)


def test_the_base_profiles_piecewise_count_is_kept(tmp_path):
    """Calibration does not count a piecewise-graph iteration's host launches; the base's count stays,
    or a calibrated profile would price those iterations eager."""
    base = replace(H200, kernels_per_layer={PIECEWISE: 3}, kernels_per_forward={PIECEWISE: 16},
                   provenance={**H200.provenance, "kernels_per_layer": "measured", "kernels_per_forward": "measured"})
    result = run_calibration(FakeBench(), options(tmp_path, base=base), lambda _: None)
    assert result.kernel_counts[PIECEWISE] == (3, 16)
    assert load_profile(tmp_path / "p.json").kernel_count(PIECEWISE, 36) == 36 * 3 + 16
    assert load_profile(tmp_path / "p.json").kernels_per_layer["decode"] == 28  # the measured ones as counted


def test_refit_on_another_profiles_curves(tmp_path, capsys):
    """A calibration measured where GEMMs ran at 0.85 of this H200 curve, refitted (CLI, no GPU) on a
    base whose Pi(S) is 1.0625x higher: the same iterations are 0.80 of that curve; the base's
    piecewise counts stay, the calibration's kernel counts come in."""
    bench = FakeBench(efficiency=0.85)
    run_calibration(bench, options(tmp_path), lambda _: None)
    faster = replace(H200, compute_points=tuple((sms, rate * 0.85 / 0.80) for sms, rate in H200.compute_points),
                     kernels_per_layer={PIECEWISE: 3}, kernels_per_forward={PIECEWISE: 16},
                     provenance={**H200.provenance, "kernels_per_layer": "measured", "kernels_per_forward": "measured"})
    (tmp_path / "faster.json").write_text(json.dumps(asdict(faster)))
    out = tmp_path / "refit.json"
    args = ["--gpu-name", "lab", "--out", str(out), "--base", str(tmp_path / "faster.json")]
    assert calibrate_main([*args, "--refit", str(tmp_path / "p.json"), "--plot", str(tmp_path / "r.png")]) == 0
    printed = capsys.readouterr().out
    assert "BW(S) and Pi(S) measured" not in printed and "gemm_efficiency 0.80" in printed
    refit = load_profile(out)
    assert (refit.name, refit.gemm_efficiency, refit.compute_points) == ("lab", 0.80, faster.compute_points)
    assert (refit.kernel_gpu_s, refit.launch_cpu_s) == (pytest.approx(G), pytest.approx(H))
    assert refit.kernels_per_layer == {PIECEWISE: 3, "decode": 28, "prefill": 30, NARROW_DECODE: 26}
    rows = json.loads(out.read_text())["calibration"]
    # not exact: the base's faster Pi(S) speeds up prefill attention too (Pi x attention_efficiency)
    assert 1e-3 < max(s.p90 for s in error_stats(rows, "predicted_s").values()) < 0.01
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    # two calibrations pool their rows (the same iterations twice: the same fit), unless their engines differ
    assert calibrate_main([*args, "--refit", str(tmp_path / "p.json"), str(tmp_path / "p.json")]) == 0
    assert "gemm_efficiency 0.80" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["calibration"]) == 2 * len(rows)
    other = json.loads((tmp_path / "p.json").read_text())
    other["kernels_per_layer"]["decode"] = 29
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert calibrate_main([*args, "--refit", str(tmp_path / "p.json"), str(tmp_path / "other.json")]) == 1
    assert "the calibrations counted different kernels" in capsys.readouterr().err
    # a profile without measured rows, GPU flags, and a non-profile file
    assert calibrate_main([*args, "--refit", str(tmp_path / "faster.json")]) == 1
    assert "no calibration rows with kernel counts" in capsys.readouterr().err
    assert calibrate_main([*args, "--refit", str(tmp_path / "p.json"), "--quick"]) == 2
    assert capsys.readouterr().err == "duetserve calibrate: error: --quick does not go with --refit\n"
    (tmp_path / "bad.json").write_text('{"calibration": [{"kernels": 5}], "kernels_per_layer": {"decode": 1, '
                                       '"prefill": 1}, "kernels_per_forward": {"decode": 1, "prefill": 1}}')
    assert calibrate_main([*args, "--refit", str(tmp_path / "bad.json")]) == 1
    assert "a calibration row has no 'kind'" in capsys.readouterr().err


def _edited(tmp_path, edit):
    """A calibrated profile (the fake GPU's) changed by ``edit(profile_dict)``, as a file."""
    run_calibration(FakeBench(), options(tmp_path), lambda _: None)
    profile = json.loads((tmp_path / "p.json").read_text())
    profile = edit(profile) or profile
    (tmp_path / "bad.json").write_text(json.dumps(profile))
    return tmp_path / "bad.json"


def _set_row(field, value):
    def edit(p):
        p["calibration"][3][field] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set_row("measured_s", "0.006"), "calibration row 3: measured_s must be seconds in (0, 3600), got '0.006'"),
    (_set_row("measured_s", None), "calibration row 3: measured_s must be seconds in (0, 3600), got None"),
    (_set_row("kind", None), "calibration row 3: kind must be decode, prefill or mixed, got None"),
    (_set_row("batch", 10**12), "calibration row 3: batch must be an integer in 1..1048576, got 1000000000000"),
    (_set_row("batch", 1.5), "calibration row 3: batch must be an integer in 1..1048576, got 1.5"),
    (_set_row("kernels", "939"), "calibration row 3: kernels must be an integer in 1..1048576, got '939'"),
    (_set_row("graphs", "yes"), "calibration row 3: graphs must be true or false, got 'yes'"),
    (_set_row("sms", 140), "calibration row 3: measured on 140 SMs, --base has 132"),
    (lambda p: p["calibration"], "not a profile (a JSON object) written by duetserve calibrate"),
    (lambda p: p.update(calibration=[r for r in p["calibration"] if r["graphs"]]),
     "the rows need both graph-replayed decodes and eager iterations (the per-kernel GPU and launch times are "
     "told apart by them)"),
    (lambda p: p.update(narrow_decode_batch="x"), "narrow_decode_batch must be an integer >= 0, got 'x'"),
])
def test_refit_refuses_bad_rows_naming_them(tmp_path, capsys, edit, message):
    bad = _edited(tmp_path, edit)
    out = tmp_path / "out.json"
    out.write_text("kept")
    assert calibrate_main(["--gpu-name", "x", "--out", str(out), "--refit", str(bad)]) == 1
    assert capsys.readouterr().err == f"duetserve calibrate: error: --refit {bad}: {message}\n"
    assert out.read_text() == "kept"


def test_refit_usage_errors_and_output_in_place(tmp_path, capsys):
    good = _edited(tmp_path, lambda p: None)
    (tmp_path / "model.json").write_text("{not json")
    assert calibrate_main(["--gpu-name", "x", "--out", str(tmp_path / "o.json"), "--refit", str(good),
                           "--model", str(tmp_path / "model.json")]) == 2
    assert capsys.readouterr().err.startswith(f"duetserve calibrate: error: --model {tmp_path / 'model.json'}: ")
    assert calibrate_main(["--gpu-name", "x", "--out", str(tmp_path / "o.json"), "--refit", str(good),
                           "--base", "a100"]) == 1
    assert "calibration row 0: measured on 132 SMs, --base has 108" in capsys.readouterr().err
    # --out through a link: the link stays, its target gets the profile
    (tmp_path / "target.json").write_text("old")
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    assert calibrate_main(["--gpu-name", "x", "--out", str(tmp_path / "link.json"), "--refit", str(good)]) == 0
    assert (tmp_path / "link.json").is_symlink() and load_profile(tmp_path / "target.json").name == "x"


def test_profile_is_written_before_the_iterations(tmp_path):
    class NoModel(FakeBench):
        def load_model(self, folder, load_format):
            raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        run_calibration(NoModel(), options(tmp_path), lambda _: None)
    assert load_profile(tmp_path / "p.json").provenance["compute_points"] == "measured"


def test_missing_all_sm_point_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="gemm: no measurement on all 132 SMs"):
        run_calibration(FakeBench(fail={("gemm", 132)}), options(tmp_path), lambda _: None)


def test_prediction_row_has_no_base_prediction_beyond_the_base_gpu():
    a100 = CostModel(QWEN, load_profile("a100"))  # 108 SMs
    r = prediction_row(Shape("decode", 1, 1, 511, 132), 1e-2, True, 1011, CostModel(QWEN, H200), a100)
    assert r["base_predicted_s"] is None and r["predicted_s"] == r["roofline_s"] > 0
    assert (r["batch"], r["c"], r["graphs"], r["kernels"], r["spatial"]) == (1, 511, True, 1011, False)
    split = prediction_row(Shape("decode", 1, 1, 511, 64, 8), 1e-2, True, 1011, CostModel(QWEN, H200), a100)
    assert split["spatial"] and split["base_predicted_s"] > 0


def test_report_groups_split_decodes_by_spatial_and_old_rows_by_k():
    # all-SM decodes run k = 8 steps as served multi-step decodes; rows written before ``spatial``
    # ran them one step at a time and only split levels with k = 8
    assert group({"kind": "decode", "k": 8, "spatial": False}) == "decode"
    assert group({"kind": "decode", "k": 8, "spatial": True}) == "decode, split SMs"
    assert group({"kind": "decode", "k": 8}) == "decode, split SMs" and group({"kind": "decode", "k": 1}) == "decode"
    assert group({"kind": "mixed", "k": 1, "spatial": False}) == "mixed"


def test_plot_draws_a_png(tmp_path):
    rows = [row("decode", 1e-2, 1.1e-2, 0.9e-2, roofline=0.5e-2), row("prefill", 0.3, 0.28, None)]
    plot_predictions(rows, tmp_path / "c.png", "t")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


# --- command line -------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, flag", [
    (["--base", "no-such-gpu"], "--base"),
    (["--model", "/no/such/config.json"], "--model"),
    (["--out", "/no/such/dir/p.json"], "--out"),
    (["--plot", "/no/such/dir/c.png"], "--plot"),
    (["--plot", "/tmp/c.txt"], "--plot: /tmp/c.txt: matplotlib cannot write .txt images"),
    (["--partition-backend", "mig"], "--partition-backend"),
    (["--gpu-name", " "], "--gpu-name: must not be empty"),
    (["--iteration-log", "/no/such/log.jsonl"], "--iteration-log: no such file: /no/such/log.jsonl"),
    # exit 1 after the checks: "needs a CUDA GPU" here, torch's "Invalid device string" on a GPU
    (["--device", "cpu"], "--device: must be cuda or cuda:N, got 'cpu'"),
    (["--device", "cuda:x"], "--device: must be cuda or cuda:N, got 'cuda:x'"),
])
def test_cli_argument_errors_name_the_flag(tmp_path, capsys, extra, flag):
    with pytest.raises(SystemExit) as exc:
        calibrate_main(["--gpu-name", "x", "--out", str(tmp_path / "p.json"), *extra])
    assert exc.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_cli_requires_gpu_name_and_out(capsys):
    with pytest.raises(SystemExit):
        calibrate_main([])
    assert "--gpu-name" in capsys.readouterr().err


def test_cli_config_file_needs_dummy_weights(tmp_path, capsys):
    """A usage error (exit 2, as argparse's), checked before the GPU: it exited 1, as a failed run does."""
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    code = calibrate_main(["--gpu-name", "x", "--out", str(tmp_path / "p.json"), "--model",
                           str(tmp_path / "config.json"), "--load-format", "auto"])
    assert code == 2
    assert capsys.readouterr().err == "duetserve calibrate: error: --load-format auto needs --model FOLDER with weights\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cli_without_cuda_fails_cleanly(tmp_path, capsys):
    assert calibrate_main(["--gpu-name", "x", "--out", str(tmp_path / "p.json")]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_cli_checks_the_kernel_switches_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DUETSERVE_FUSED", "2")
    assert calibrate_main(["--gpu-name", "x", "--out", str(tmp_path / "p.json")]) == 1
    err = capsys.readouterr().err
    assert "DUETSERVE_FUSED must be 0, 1 or auto, got '2'" in err and "needs a CUDA GPU" not in err


def test_cli_end_to_end_with_a_fake_gpu(tmp_path, capsys, monkeypatch):
    from duetserve import cli as main_cli
    from duetserve.calibrate import gpu

    made = {}

    def fake_bench(partition, device, repeats, attention_backend):
        made.update(partition=partition, repeats=repeats)
        return FakeBench(layers=2)

    monkeypatch.setattr(gpu, "CudaBench", fake_bench)
    tiny = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
            "vocab_size": 320}
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    code = main_cli.main(["calibrate", "--gpu-name", "lent", "--out", str(tmp_path / "p.json"), "--model",
                          str(tmp_path / "config.json"), "--plot", str(tmp_path / "c.png"), "--quick",
                          "--partition-backend", "none"])
    out = capsys.readouterr().out
    assert code == 0 and made == {"partition": "none", "repeats": 8}
    assert "relative error |pred - meas| / meas" in out and "held out (every second shape of each group): " in out
    assert "kernels per iteration: decode 28 per layer + 3, prefill 30 per layer + 4" in out
    assert (tmp_path / "c.png").exists() and load_profile(tmp_path / "p.json").name == "lent"


def test_model_folder_default_is_qwen3_8b(tmp_path):
    args = argparse.Namespace(model=None, load_format="dummy")
    folder, shape = calibrate_cli.model_folder(args, tmp_path)
    assert folder == tmp_path and shape == QWEN
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3"


# --- on a GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bench_rates_and_iterations(tiny_qwen3_folder):
    from duetserve.calibrate.gpu import CudaBench

    bench = CudaBench("greenctx", repeats=4)
    n = bench.facts.num_sms
    copy = bench.primitive_rate("copy", n)
    assert 1e11 < copy < 2 * 8e12 and bench.primitive_rate("gemm", n) > 1e12
    if bench.facts.levels:
        assert bench.primitive_rate("copy", 16) < copy
    cap = bench.load_model(tiny_qwen3_folder, "auto")
    assert cap.num_sms == n and cap.kv_blocks > 0
    shapes = [Shape("decode", 8, 1, 63, n), Shape("prefill", 2, 100, 0, n),
              Shape("mixed", 4, 1, 63, n, chunk=100, chunk_cached=32)]
    if bench.facts.levels:
        shapes.append(Shape("decode", 8, 1, 63, bench.facts.levels[1], k=4))
    shapes.append(Shape("decode", 8, 1, 63, n, k=4))  # multi-step, as served: the GPU's time a step
    times = [bench.iteration_seconds(s) for s in shapes]
    assert all(0 < t < 1 for t in times) and bench.engine.block_manager.num_free_blocks == cap.kv_blocks
    assert times[-1] < times[0]  # the single step's wall time has its launch and sync too
    assert np.isfinite(times).all()
    assert bench.runs_graphs(shapes[0]) and not bench.runs_graphs(shapes[1]) and not bench.runs_graphs(shapes[2])
    with bench._temporal(shapes[2]) as out:  # the mixed shape: 4 decodes of 64 tokens and a chunk of 100 on 32
        assert [(s.num_new_tokens, s.num_cached_tokens) for s in out.decodes + out.prefills] == [(1, 63)] * 4 + [(100, 32)]
        assert len({s.seq.seq_id for s in out.decodes + out.prefills}) == 5
    for shape in shapes[:2]:
        names = bench.kernel_names(shape)
        per_layer, _ = split_kernel_counts(names, 2)  # the tiny model's 2 layers
        assert per_layer >= 5 and bench.engine.runner.graphs is not None
    assert bench.narrow_decode_batch() == 16  # triton_gemm.MAX_M, within the 128-sequence graphs
    # the replay is the graph's: the Triton decode GEMM, which eager passes never launch
    assert any(name.startswith("_gemm_kernel") for name in bench.kernel_names(shapes[0], replay=True))
    assert not any(name.startswith("_gemm_kernel") for name in bench.kernel_names(shapes[0]))
    assert bench.engine.block_manager.num_free_blocks == cap.kv_blocks
