"""The calibration procedure, independent of how the GPU is driven (issue 5, part 4).

1. ``BW(S)`` and ``Pi(S)``: copy, decode gemv and GEMM rates on S SMs, for the SM levels of
   ``workload.sm_levels``; the profile is written as soon as they are in.
2. Kernel counts of one decode and one prefill iteration of the served model, split into
   per layer and per forward (``overhead.split_kernel_counts``), and of one graph-replayed
   decode of at most ``Bench.narrow_decode_batch`` sequences where the engine records those
   with fewer kernels (``hardware.NARROW_DECODE``).
3. Iteration latencies of the served model over ``workload.plan_shapes``, each noting whether
   the engine replayed it from CUDA graphs.
4. ``gemm_efficiency`` and the per-kernel overheads ``kernel_gpu_s`` and ``launch_cpu_s``
   fitted to the measured latencies (``overhead.fit_with_efficiency``): once on a fit half of the shapes, to predict the
   held-out half (``overhead.holdout_mask``), and once on every shape for the profile.
5. Predictions for each shape, kept in the profile's ``"calibration"`` list: the roofline of
   the measured curves (before the fit), the calibrated profile (after), the fit half's
   (held-out shapes only) and the base profile; the profile is written again, with the
   overheads.

Every measurement runs in its own try/except: a failure is reported and the rest goes on.
The GPU side is a ``Bench`` (``duetserve.calibrate.gpu.CudaBench`` on CUDA; tests pass fakes).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from duetserve.calibrate.overhead import (
    EFFICIENCY_GRID,
    OverheadFit,
    fit_with_efficiency,
    holdout_mask,
    split_kernel_counts,
)
from duetserve.calibrate.profile import (
    Curve,
    DeviceFacts,
    build_profile,
    lower_envelope,
    with_overheads,
    without_overheads,
    write_profile,
)
from duetserve.calibrate.report import group
from duetserve.calibrate.workload import (
    TPCMASK_SAFE_MIN_SMS,
    Capacity,
    Shape,
    plan_shapes,
    sm_levels,
)
from duetserve.planner.cost_model import CostModel, ModelShape
from duetserve.planner.hardware import ITERATION_KINDS, NARROW_DECODE, PIECEWISE, HardwareProfile

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

    def runs_graphs(self, shape: Shape) -> bool:
        """Whether the engine replays ``shape``'s iterations from CUDA graphs."""
        ...

    def kernel_names(self, shape: Shape, replay: bool = False) -> list[str]:
        """Names of the GPU activities (kernels, copies) of one iteration of ``shape`` on all
        SMs, one entry per launch: run eagerly, or with ``replay`` from the decode CUDA graphs.
        Raises on any failure."""
        ...

    def narrow_decode_batch(self) -> int:
        """Largest decode batch whose CUDA graphs record the narrow decode path (fewer kernels,
        ``hardware.NARROW_DECODE``); 0 where the engine has none."""
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
        rows: measured iteration latencies with the predictions (``report`` module's rows).
        kernel_counts: per iteration kind (``NARROW_DECODE`` included where the engine has
            it), ``(kernels per layer, per forward outside the layers)``; None when counting
            failed (then nothing is fitted).
        narrow_decode_batch: ``Bench.narrow_decode_batch`` where ``kernel_counts`` has
            ``NARROW_DECODE``, else 0.
        fit: the overheads fitted on every shape (written to the profile), or None.
        holdout_fit: the overheads fitted on the fit half, or None.
        skipped: shapes that do not fit the engine, with the reason.
        errors: failed measurements, with the exception.
    """

    profile: HardwareProfile
    curves: dict[str, Curve]
    rows: list[dict] = field(default_factory=list)
    kernel_counts: dict[str, tuple[int, int]] | None = None
    narrow_decode_batch: int = 0
    fit: OverheadFit | None = None
    holdout_fit: OverheadFit | None = None
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


T = TypeVar("T")


def _attempt(errors: list[str], what: str, fn: Callable[[], T], log: Callable[[str], None]) -> T | None:
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


def prediction_row(shape: Shape, measured_s: float, graphs: bool, kernels: int | None, roofline: CostModel,
                   base: CostModel) -> dict:
    """One ``"calibration"`` entry before the fit: the shape, whether it ran on fewer SMs than
    ``roofline``'s profile has (``spatial``: a split level's decode), whether it ran from CUDA graphs,
    its kernel count (None: not counted), measured seconds, the roofline of the measured
    curves (no overheads) and the base profile's prediction, both without serving host time
    (the engine is timed alone; the calibrated profile keeps the base's host terms for
    serving; None beyond the base GPU's SMs).
    ``predicted_s`` is the roofline until ``apply_fit`` replaces it."""
    rooflined = float(roofline.predict_total(shape.reqs, shape.sms, graphs=graphs, host=False))
    base_s = float(base.predict_total(shape.reqs, shape.sms, graphs=graphs, host=False)) \
        if shape.sms <= base.profile.num_sms else None
    return {"kind": shape.kind, "batch": shape.batch, "q": shape.q, "c": shape.c, "sms": shape.sms, "k": shape.k,
            "spatial": shape.sms < roofline.profile.num_sms, "chunk": shape.chunk, "chunk_cached": shape.chunk_cached,
            "graphs": graphs, "kernels": kernels, "measured_s": measured_s, "roofline_s": rooflined,
            "predicted_s": rooflined, "base_predicted_s": base_s}


def count_kernels(bench: Bench, shapes: list[Shape], layers: int, errors: list[str],
                  log: Callable[[str], None] = print) -> tuple[dict[str, tuple[int, int]] | None, int]:
    """Kernels of the first decode and the first prefill shape on all SMs, run eagerly, and
    where ``bench.narrow_decode_batch()`` > 0 of the first decode shape within it replayed from
    CUDA graphs (``NARROW_DECODE``), as ``{kind: (per layer, per forward outside the layers)}``,
    with the narrow batch (0 without that count). ``(None, 0)``, and an entry in ``errors``,
    when the decode or prefill count fails; a failed narrow count is only reported."""
    narrow = bench.narrow_decode_batch()
    wanted = [(kind, lambda s, kind=kind: s.kind == kind, False) for kind in ITERATION_KINDS]
    if narrow:
        wanted.append((NARROW_DECODE, lambda s: s.kind == "decode" and s.batch <= narrow, True))
    counts = {}
    for kind, fits, replay in wanted:
        shape = next((s for s in shapes if fits(s) and s.sms == bench.facts.num_sms), None)
        names = None
        if shape is None:
            errors.append(f"kernel count: no {kind} shape fits the engine")
        else:
            label = f"kernel count of {shape.label}{' (graphs)' if replay else ''}"
            names = _attempt(errors, label, partial(bench.kernel_names, shape, replay), log)
            if names == []:
                errors.append(f"{label}: the profiler saw no GPU activity")
                names = None
        if names is None:
            if kind == NARROW_DECODE:
                return counts, 0
            return None, 0
        counts[kind] = split_kernel_counts(names, layers)
        log(f"{shape.label}{' (graphs)' if replay else ''}: {len(names)} kernels, {counts[kind][0]} per layer + "
            f"{counts[kind][1]} outside")
    return counts, narrow if NARROW_DECODE in counts else 0


def with_base_piecewise(counts: dict[str, tuple[int, int]], base: HardwareProfile) -> dict[str, tuple[int, int]]:
    """``counts`` plus ``base``'s ``PIECEWISE`` count, which calibration does not measure (the host
    launches of an iteration replayed from piecewise CUDA graphs): without it a calibrated profile
    would price those iterations as eager ones."""
    if PIECEWISE in counts or PIECEWISE not in base.kernels_per_layer:
        return counts
    return {**counts, PIECEWISE: (base.kernels_per_layer[PIECEWISE], base.kernels_per_forward[PIECEWISE])}


def apply_fit(shapes: list[Shape], rows: list[dict], profile: HardwareProfile, model_shape: ModelShape,
              counts: dict[str, tuple[int, int]], narrow_decode_batch: int = 0
              ) -> tuple[HardwareProfile, OverheadFit, OverheadFit]:
    """Fit ``gemm_efficiency`` and the overheads to ``rows`` (measured ``shapes``, with their
    kernel counts; ``overhead.fit_with_efficiency``, the rooflines of ``profile``, which has
    none of them, at each efficiency) and fill in each row's ``split`` (``fit`` or ``holdout``),
    ``predicted_s`` (fitted on every row) and ``holdout_predicted_s`` (fitted on the fit rows;
    held-out rows only).

    The held-out rows are every second row of each (report group, graphs) group in
    measurement order (``holdout_mask``). Returns the profile with the terms fitted on
    every row, that fit, and the fit half's.
    """
    held = holdout_mask((group(r), r["graphs"]) for r in rows)
    provenance = {**profile.provenance, "gemm_efficiency": "measured"}
    rooflines = {e: np.array([CostModel(model_shape, replace(profile, gemm_efficiency=e, provenance=provenance))
                              .predict_total(shape.reqs, shape.sms, graphs=r["graphs"], host=False)
                              for shape, r in zip(shapes, rows)]) for e in EFFICIENCY_GRID}
    kernels, graphs, measured = (np.array([r[k] for r in rows]) for k in ("kernels", "graphs", "measured_s"))

    def fit(sel: np.ndarray) -> OverheadFit:
        return fit_with_efficiency(lambda e: rooflines[e][sel], kernels[sel], graphs[sel], measured[sel])

    full, half = fit(np.ones(len(rows), dtype=bool)), fit(~held)
    calibrated = with_overheads(profile, full, counts, narrow_decode_batch)
    full_model = CostModel(model_shape, calibrated)
    half_model = CostModel(model_shape, with_overheads(profile, half, counts, narrow_decode_batch))
    for shape, r, h in zip(shapes, rows, held):
        r["split"] = "holdout" if h else "fit"
        args = (shape.reqs, shape.sms)
        r["predicted_s"] = float(full_model.predict_total(*args, graphs=r["graphs"], host=False))
        r["holdout_predicted_s"] = float(half_model.predict_total(*args, graphs=r["graphs"], host=False)) if h else None
    return calibrated, full, half


def run_calibration(bench: Bench, opts: Options, log: Callable[[str], None] = print) -> Calibration:
    """Measure, write ``opts.out`` (twice: after the curves, then with the latencies and the
    fitted overheads) and return what was measured.

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
              "(bytes read + written) and a bf16 [32,4096]x[4096,28672] gemv (weight bytes). "
              "kernel_gpu_s, launch_cpu_s: fitted to the measured iteration latencies of the served model, "
              "kernel counts from torch.profiler (duetserve.calibrate.overhead).")
    profile_dict = build_profile(opts.base, opts.gpu_name, facts, curves["gemm"],
                                 lower_envelope(curves["copy"], curves["gemv"]), method)
    profile = write_profile(profile_dict, opts.out)
    result = Calibration(profile, curves, errors=errors)
    log(f"profile written: {opts.out}")

    capacity = bench.load_model(opts.model_folder, opts.load_format)
    split_levels = [s for s in facts.levels if s >= min_sms]
    shapes, skipped = plan_shapes(capacity, split_levels, opts.quick)
    result.skipped = [f"{shape.label}: {why}" for shape, why in skipped]
    counts, narrow = count_kernels(bench, shapes, opts.model_shape.layers, errors, log)
    counts = with_base_piecewise(counts, opts.base) if counts else counts
    result.kernel_counts, result.narrow_decode_batch = counts, narrow
    roofline, base = CostModel(opts.model_shape, profile), CostModel(opts.model_shape, opts.base)
    counted = with_overheads(profile, OverheadFit(0.0, 0.0), counts, narrow) if counts else None
    measured = []
    for shape in shapes:
        seconds = _attempt(errors, shape.label, partial(bench.iteration_seconds, shape), log)
        if seconds is not None:
            graphs = bench.runs_graphs(shape)
            kernels = int(counted.iteration_kernels(opts.model_shape.layers, shape.kind == "decode", graphs,
                                                    shape.batch)) if counted else None
            measured.append(shape)
            result.rows.append(prediction_row(shape, seconds, graphs, kernels, roofline, base))
            log(f"{shape.label}: {seconds * 1e3:.3f} ms (roofline {result.rows[-1]['roofline_s'] * 1e3:.3f} ms)")
    if counts and result.rows:
        result.profile, result.fit, result.holdout_fit = apply_fit(measured, result.rows, profile, opts.model_shape,
                                                                   counts, narrow)
    write_profile({**asdict(result.profile), "calibration": result.rows}, opts.out)
    return result


ROW_LIMIT = 1 << 20
"""The largest batch and token count a calibration row may name (calibrate's own are far below)."""


def _is_int(value: Any, low: int, high: int = ROW_LIMIT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check_row(i: int, row: Mapping[str, Any], num_sms: int) -> None:
    """Raise ValueError naming row ``i`` and its field unless it is a measured iteration as
    ``prediction_row`` writes it, on at most ``num_sms`` SMs (a missing field: KeyError)."""
    def bad(name: str, want: str) -> ValueError:
        return ValueError(f"calibration row {i}: {name} must be {want}, got {row[name]!r}")

    if row["kind"] not in ("decode", "prefill", "mixed"):
        raise bad("kind", "decode, prefill or mixed")
    for name, low in (("batch", 1), ("q", 1), ("c", 0), ("k", 1), ("chunk", 0), ("chunk_cached", 0), ("kernels", 1)):
        if not _is_int(row[name], low):
            raise bad(name, f"an integer in {low}..{ROW_LIMIT}")
    if not _is_int(row["sms"], 1, num_sms):
        raise ValueError(f"calibration row {i}: measured on {row['sms']!r} SMs, --base has {num_sms}")
    if not isinstance(row["graphs"], bool):  # (a row's spatial is not read: prediction_row derives it from sms)
        raise bad("graphs", "true or false")
    m = row["measured_s"]
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < 3600:
        raise bad("measured_s", "seconds in (0, 3600)")


def refit_calibration(calibrated: Sequence[Mapping[str, Any]], base: HardwareProfile, model_shape: ModelShape,
                      name: str) -> Calibration:
    """Fit ``gemm_efficiency`` and the per-kernel overheads again, on ``base``'s curves, to the
    iterations calibrations measured: each of ``calibrated`` is a profile written by
    ``run_calibration`` as a JSON dict (its ``"calibration"`` rows and its kernel counts); their
    rows are pooled (e.g. two machines of one GPU model). No GPU.

    Ships measurements against another profile's ``Pi(S)`` and ``BW(S)`` (e.g. the shipped H200
    probe's). Returns a ``Calibration`` without curves whose profile is ``base`` named ``name``
    with the fitted terms and the calibrated kernel counts (``base``'s ``PIECEWISE`` count kept,
    ``with_base_piecewise``), and whose rows are re-predicted (roofline and ``base`` columns on
    ``base``).

    Raises ValueError: not JSON objects, no ``"calibration"`` rows, rows without kernel counts or
    with a field of the wrong type or range (naming the row), rows measured on more SMs than
    ``base`` has, no graph-replayed or no eager row, no kernel counts for decode and prefill, or
    profiles whose kernel counts differ (different engines); KeyError: a row without a field.
    """
    if not calibrated or not all(isinstance(c, Mapping) for c in calibrated):
        raise ValueError("not a profile (a JSON object) written by duetserve calibrate")
    rows = [r for c in calibrated for r in c.get("calibration") or []]
    if not rows or any(not isinstance(r, Mapping) or r.get("kernels") is None for r in rows):
        raise ValueError("no calibration rows with kernel counts (a profile written by duetserve calibrate on a GPU)")
    for i, r in enumerate(rows):
        _check_row(i, r, base.num_sms)
    engines = {json.dumps([c.get(k) for k in ("kernels_per_layer", "kernels_per_forward", "narrow_decode_batch")],
                          sort_keys=True) for c in calibrated}
    if len(engines) > 1:
        raise ValueError(f"the calibrations counted different kernels (kernels_per_layer, kernels_per_forward, "
                         f"narrow_decode_batch): {sorted(engines)}")
    per_layer, per_forward = calibrated[0].get("kernels_per_layer"), calibrated[0].get("kernels_per_forward")
    narrow = calibrated[0].get("narrow_decode_batch", 0)
    if not (isinstance(per_layer, Mapping) and isinstance(per_forward, Mapping)
            and set(ITERATION_KINDS) <= set(per_layer) & set(per_forward)):
        raise ValueError(f"no kernel counts for {', '.join(ITERATION_KINDS)}")
    if not _is_int(narrow, 0):
        raise ValueError(f"narrow_decode_batch must be an integer >= 0, got {narrow!r}")
    if all(r["graphs"] for r in rows) or not any(r["graphs"] for r in rows):
        raise ValueError("the rows need both graph-replayed decodes and eager iterations (the per-kernel GPU and "
                         "launch times are told apart by them)")
    counts = with_base_piecewise({kind: (per_layer[kind], per_forward[kind]) for kind in per_layer}, base)
    stripped = replace(without_overheads(base), name=name)
    shapes = [Shape(r["kind"], r["batch"], r["q"], r["c"], r["sms"], r["k"], r["chunk"], r["chunk_cached"])
              for r in rows]
    roofline, base_model = CostModel(model_shape, stripped), CostModel(model_shape, base)
    new_rows = [prediction_row(shape, r["measured_s"], r["graphs"], r["kernels"], roofline, base_model)
                for shape, r in zip(shapes, rows)]
    profile, full, half = apply_fit(shapes, new_rows, stripped, model_shape, counts, narrow)
    return Calibration(profile, {}, new_rows, counts, narrow, full, half)
