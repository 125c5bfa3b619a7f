"""Measured curves to a hardware profile JSON that ``load_profile`` reads (docs/design.md sections 3, 5).

``Pi(S)`` is the bf16 GEMM curve. ``BW(S)`` is, at each measured S, the lower of the copy
curve and the decode-gemv curve, as the shipped H200 profile does: the slower streaming
workload keeps decode predictions conservative (docs/design.md section 3). Fields calibration does
not measure are copied, with their provenance, from a base profile, except the per-kernel
overheads: they belong to the curves they were fitted with, so a new profile starts without
them and ``with_overheads`` adds the ones fitted here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from duetserve.calibrate.overhead import OverheadFit
from duetserve.jsonio import dumps, loads_object
from duetserve.planner.hardware import HardwareProfile, Points, profile_from_json

Curve = dict[int, float]
"""Rate by SM count: ``{S: bytes/s or FLOP/s}``."""

MEASURED_FIELDS = ("num_sms", "num_tpcs", "compute_capability_major", "compute_points", "bandwidth_points",
                   "hbm_bytes")
OVERHEAD_FIELDS = ("kernel_gpu_s", "launch_cpu_s", "kernels_per_layer", "kernels_per_forward", "narrow_decode_batch",
                   "gemm_efficiency")
"""``HardwareProfile``'s per-kernel overhead fields and GEMM efficiency, fitted by calibration
(``overhead`` module)."""


@dataclass(frozen=True)
class DeviceFacts:
    """The GPU calibration runs on.

    Attributes:
        name: the driver's device name.
        num_sms: SMs of the device.
        cc_major: compute capability major version.
        hbm_bytes: device memory, bytes.
        partition: partition backend in use (``none`` after a fallback).
        levels: decode SM counts the backend offers (empty for ``none``).
        note: why the backend fell back, if it did.
    """

    name: str
    num_sms: int
    cc_major: int
    hbm_bytes: int
    partition: str
    levels: tuple[int, ...] = ()
    note: str = ""


def lower_envelope(*curves: Mapping[int, float]) -> Curve:
    """Pointwise minimum over the SM counts present in any curve (a count missing from one
    curve, e.g. a failed measurement, takes the others' value)."""
    sms = sorted(set().union(*curves))
    return {s: min(c[s] for c in curves if s in c) for s in sms}


def curve_points(curve: Mapping[int, float], num_sms: int, label: str) -> Points:
    """``curve`` as profile points ``((S, rate), ...)``, S increasing.

    Raises ValueError when the all-SM point (``num_sms``) is missing: the profile's curves
    must end there (``HardwareProfile``).
    """
    if num_sms not in curve:
        raise ValueError(f"{label}: no measurement on all {num_sms} SMs, so no profile curve")
    return tuple((float(s), float(curve[s])) for s in sorted(curve))


def build_profile(base: HardwareProfile, name: str, facts: DeviceFacts, compute: Mapping[int, float],
                  bandwidth: Mapping[int, float], method: str) -> dict:
    """A profile dict (the JSON schema of ``duetserve/planner/profiles``) named ``name``:
    ``MEASURED_FIELDS`` from ``facts`` and the curves (FLOP/s and bytes/s by SM count), no
    per-kernel overheads and ``gemm_efficiency`` 1 (fitted later, ``with_overheads``), every other
    field copied from ``base`` with its provenance.
    ``method`` goes into ``notes``.

    Raises ValueError as ``curve_points``; ``write_profile`` checks the rest.
    """
    stripped = without_overheads(base)
    profile = dataclasses.asdict(stripped)
    profile.update(
        name=name,
        description=f"{facts.name} ({facts.num_sms} SMs), calibrated by duetserve calibrate on {date.today()}",
        num_sms=facts.num_sms,
        num_tpcs=facts.num_sms // 2,  # 2 SMs per TPC since Volta
        compute_capability_major=facts.cc_major,
        compute_points=curve_points(compute, facts.num_sms, "gemm"),
        bandwidth_points=curve_points(bandwidth, facts.num_sms, "copy/gemv"),
        hbm_bytes=facts.hbm_bytes,
        provenance={**stripped.provenance, **dict.fromkeys(MEASURED_FIELDS, "measured")},
        notes=f"{method} Fields not measured come from the base profile {base.name!r}: {base.notes}",
    )
    return profile


def without_overheads(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` with its ``OVERHEAD_FIELDS`` at ``HardwareProfile``'s defaults (no per-kernel
    overheads or counts, ``gemm_efficiency`` 1) and without their provenance: the roofline that
    calibration fits the overheads on."""
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(HardwareProfile) if f.name in OVERHEAD_FIELDS}
    provenance = {k: v for k, v in profile.provenance.items() if k not in OVERHEAD_FIELDS}
    return dataclasses.replace(profile, **defaults, provenance=provenance)


def with_overheads(profile: HardwareProfile, fit: OverheadFit, counts: Mapping[str, tuple[int, int]],
                   narrow_decode_batch: int = 0) -> HardwareProfile:
    """``profile`` with the fitted constants (``gemm_efficiency`` too) and the engine's kernel
    counts (``counts``: per iteration kind, ``(per layer, per forward outside the layers)``; a
    ``NARROW_DECODE`` count goes with ``narrow_decode_batch`` > 0), all marked measured."""
    fields = {"kernel_gpu_s": fit.kernel_gpu_s, "launch_cpu_s": fit.launch_cpu_s,
              "gemm_efficiency": fit.gemm_efficiency,
              "kernels_per_layer": {kind: c[0] for kind, c in counts.items()},
              "kernels_per_forward": {kind: c[1] for kind, c in counts.items()},
              "narrow_decode_batch": narrow_decode_batch}
    return dataclasses.replace(profile, **fields,
                               provenance={**profile.provenance, **dict.fromkeys(OVERHEAD_FIELDS, "measured")})


def write_profile(profile: dict, path: Path) -> HardwareProfile:
    """Write ``profile`` as JSON to ``path`` and return it as ``load_profile`` reads it back.

    The JSON is checked before anything is written, so a bad profile never overwrites a good
    one; the file is written in place (a link at ``path`` keeps pointing where it did).

    Raises:
        ValueError: the profile does not load (e.g. a measured rate above the base profile's
            datasheet peak: pick a ``--base`` for this GPU).
        OSError: the file cannot be written.
    """
    text = dumps(profile, indent=1) + "\n"
    loaded = profile_from_json(loads_object(text), path)
    path.write_text(text)
    return loaded
