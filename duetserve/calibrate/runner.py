"""The calibration procedure, independent of how the GPU is driven (issue 5, part 4).

1. ``BW(S)`` and ``Pi(S)``: copy, decode gemv and GEMM rates on S SMs, for the SM levels of
   ``workload.sm_levels``; the profile is written as soon as they are in.
2. Iteration latencies of the served model over ``workload.plan_shapes``.
3. Predictions of the cost model for each shape with the calibrated and the base profile,
   kept in the profile's ``"calibration"`` list; the profile is written again.

Every measurement runs in its own try/except: a failure is reported and the rest goes on.
The GPU side is a ``Bench`` (``duetserve.calibrate.gpu.CudaBench`` on CUDA; tests pass fakes).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

from duetserve.calibrate.profile import (
    Curve,
    DeviceFacts,
    build_profile,
    lower_envelope,
    write_profile,
)
from duetserve.calibrate.workload import (
    TPCMASK_SAFE_MIN_SMS,
    Capacity,
    Shape,
    plan_shapes,
    sm_levels,
)
from duetserve.planner.cost_model import CostModel, ModelShape
from duetserve.planner.hardware import HardwareProfile

PRIMITIVES = ("copy", "gemv", "gemm")
"""``copy``: bf16 tensor copy, bytes read + written per second; ``gemv``: bf16
``[32,4096] x [4096,28672]``, weight bytes per second; ``gemm``: bf16 8192^3, FLOP/s."""


class Bench(Protocol):
    """The GPU side of calibration."""

    facts: DeviceFacts

    def primitive_rate(self, name: str, sms: int) -> float:
        """Rate of primitive ``name`` (one of ``PRIMITIVES``) on a stream of ``sms`` SMs:
        bytes/s for copy and gemv, FLOP/s for gemm. Raises on any failure."""
        ...

    def load_model(self, folder: Path, load_format: str) -> Capacity:
        """Free the primitives' buffers and build the engine for the model in ``folder``."""
        ...

    def iteration_seconds(self, shape: Shape) -> float:
        """Median seconds of one iteration (one step for ``shape.k > 1``) of ``shape``."""
        ...


@dataclass(frozen=True)
class Options:
    """What to calibrate.

    Attributes:
        gpu_name: name of the written profile.
        out: profile JSON path.
        base: profile the unmeasured fields come from; also the comparison's baseline.
        model_folder: the served model (config.json, and weights unless ``load_format`` is dummy).
        model_shape: its dimensions, for the cost model.
        load_format: ``dummy`` or ``auto``.
        quick: fewer decode shapes on split SM levels (the bench decides its repeats).
    """

    gpu_name: str
    out: Path
    base: HardwareProfile
    model_folder: Path
    model_shape: ModelShape
    load_format: str = "dummy"
    quick: bool = False


@dataclass
class Calibration:
    """What a calibration produced.

    Attributes:
        profile: the calibrated profile, as written to ``Options.out``.
        curves: measured rates by primitive and SM count (bytes/s or FLOP/s).
        rows: measured iteration latencies with both predictions (``report`` module's rows).
        skipped: shapes that do not fit the engine, with the reason.
        errors: failed measurements, with the exception.
    """

    profile: HardwareProfile
    curves: dict[str, Curve]
    rows: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _attempt(errors: list[str], what: str, fn: Callable[[], float], log: Callable[[str], None]) -> float | None:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - any failure of one measurement: report it, go on
        errors.append(f"{what}: {exc!r}")
        log(f"FAILED {what}: {exc!r}")
        return None


def measure_curves(bench: Bench, levels: list[int], log: Callable[[str], None] = print
                   ) -> tuple[dict[str, Curve], list[str]]:
    """Rates of every primitive at every SM count of ``levels``, and the failures."""
    curves: dict[str, Curve] = {name: {} for name in PRIMITIVES}
    errors: list[str] = []
    for s in levels:
        for name in PRIMITIVES:
            rate = _attempt(errors, f"{name} on {s} SMs", partial(bench.primitive_rate, name, s), log)
            if rate is not None:
                curves[name][s] = rate
                log(f"{name:>4} on {s:>3} SMs: {rate / (1e12 if name == 'gemm' else 1e9):8.1f} "
                    f"{'TFLOP/s' if name == 'gemm' else 'GB/s'}")
    return curves, errors


def prediction_row(shape: Shape, measured_s: float, calibrated: CostModel, base: CostModel) -> dict:
    """One ``"calibration"`` entry: the shape, its measured seconds and both predictions."""
    predicted = float(calibrated.predict_total(shape.reqs, shape.sms))
    base_s = float(base.predict_total(shape.reqs, shape.sms)) if shape.sms <= base.profile.num_sms else None
    return {"kind": shape.kind, "batch": shape.batch, "q": shape.q, "c": shape.c, "sms": shape.sms, "k": shape.k,
            "measured_s": measured_s, "predicted_s": predicted, "base_predicted_s": base_s}


def run_calibration(bench: Bench, opts: Options, log: Callable[[str], None] = print) -> Calibration:
    """Measure, write ``opts.out`` (twice: after the curves, then with the latencies) and
    return what was measured.

    Raises:
        ValueError: a curve lacks its all-SM point, or the profile does not load (see
            ``profile.write_profile``).
        OSError: ``opts.out`` cannot be written.
    """
    facts = bench.facts
    min_sms = TPCMASK_SAFE_MIN_SMS if facts.partition == "tpcmask" else 0
    levels = sm_levels(facts.levels, facts.num_sms, min_sms=min_sms)
    log(f"{facts.name}: {facts.num_sms} SMs, partition backend {facts.partition} {facts.note}; SM levels {levels}")
    curves, errors = measure_curves(bench, levels, log)
    method = (f"Measured on {facts.name} with {facts.partition} streams of S SMs (CUDA events, median): "
              "compute_points from a bf16 8192^3 GEMM; bandwidth_points the lower of a bf16 tensor copy "
              "(bytes read + written) and a bf16 [32,4096]x[4096,28672] gemv (weight bytes).")
    profile_dict = build_profile(opts.base, opts.gpu_name, facts, curves["gemm"],
                                 lower_envelope(curves["copy"], curves["gemv"]), method)
    profile = write_profile(profile_dict, opts.out)
    result = Calibration(profile, curves, errors=errors)
    log(f"profile written: {opts.out}")

    capacity = bench.load_model(opts.model_folder, opts.load_format)
    split_levels = [s for s in facts.levels if s >= min_sms]
    shapes, skipped = plan_shapes(capacity, split_levels, opts.quick)
    result.skipped = [f"{shape.label}: {why}" for shape, why in skipped]
    calibrated, base = CostModel(opts.model_shape, profile), CostModel(opts.model_shape, opts.base)
    for shape in shapes:
        seconds = _attempt(errors, shape.label, partial(bench.iteration_seconds, shape), log)
        if seconds is not None:
            result.rows.append(prediction_row(shape, seconds, calibrated, base))
            log(f"{shape.label}: {seconds * 1e3:.3f} ms (predicted {result.rows[-1]['predicted_s'] * 1e3:.3f} ms)")
    write_profile({**profile_dict, "calibration": result.rows}, opts.out)
    return result
