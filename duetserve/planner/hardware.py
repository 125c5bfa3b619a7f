"""GPU hardware profiles: SM-dependent compute rate Pi(S) and memory bandwidth BW(S).

A profile is a JSON file (shipped ones live in ``duetserve/planner/profiles/``) holding the
facts the cost model needs (docs/design.md sections 3 and 5): the SM count, measured or estimated
points of ``Pi(S)`` (FLOP/s reachable with S SMs) and ``BW(S)`` (bytes/s reachable with S
SMs), memory and interconnect figures, the partition granularity of each SM-partitioning
backend, the slowdown measured when decode and prefill share the GPU, and for every number
whether it was measured or taken from a datasheet.

Which curve means what:

* ``compute_points`` come from a large bf16 GEMM (8192^3 on the H200); every FLOP in the
  cost model (linear layers, attention, norms) is priced at this rate.
* ``bandwidth_points`` price every byte. On the H200 they are the pointwise minimum of
  the tensor-copy curve and the decode-gemv curve: the slower of two streaming workloads,
  which keeps decode predictions conservative as docs/design.md section 3 asks.

Per-kernel overheads (optional, fitted by ``duetserve calibrate``; beyond the DuetServe paper,
whose roofline prices only FLOPs and bytes): ``kernel_gpu_s`` is the GPU time each kernel costs
beyond its roofline (launch gaps, ramp-up and tail of a small grid), ``launch_cpu_s`` the host
time to launch one kernel eagerly (Python, the dispatcher and the driver), and
``kernels_per_layer`` / ``kernels_per_forward`` how many kernels the engine launches per decoder
layer and per forward outside the layers (embedding, final norm, lm_head, sampling, input
copies), for a decode-only iteration (``"decode"``) and for one with prefill tokens
(``"prefill"``). The counts belong to the engine's implementation of the Llama/Qwen3 layer,
not to the GPU; they sit in the profile because the constants were fitted with them (a
profile carries one consistent set). ``host_per_request_s`` and ``host_eager_s`` are the
serving engine's host time per temporal iteration that overlaps no GPU work (scheduling,
building inputs, reading the tokens, detokenizing and streaming them): seconds per request in
the batch, and seconds more when the iteration runs eagerly (it has prefill tokens); fitted by
``duetserve calibrate --iteration-log`` from a server's iteration log. ``host_gap_s`` and
``host_gap_per_request_s`` are the host time between two iterations while work is left (handing
out the last iteration's tokens, metrics, new requests, the HTTP thread's hold on the GIL:
``StepStats.gap_s``), fixed and per request of the iteration before; the cost model's iteration
predictions leave it out (it is no iteration's time), duet's first-token budget takes it off
(``DuetPolicy.plan``), and the simulator waits it between iterations. All default to 0: a pure
roofline.
``duetserve.planner.cost_model`` says how they enter a prediction.

Between points both curves are interpolated linearly, starting from ``(0, 0)``: below the
first measured point the rate is the straight line from the origin. Bandwidth is concave in
S (docs/design.md section 5), so that chord lies under the true curve and over-predicts decode time
at very small S, the safe direction. S <= 0 or S > num_sms raises ``ValueError``; there is
no extrapolation and no clamping.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from importlib import resources
from itertools import pairwise
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from duetserve.jsonio import loads_object

Points = tuple[tuple[float, float], ...]
"""Curve points ``((S, rate), ...)`` with S in SMs, strictly increasing, the last at num_sms."""

PROVENANCE_VALUES = ("measured", "datasheet")

ITERATION_KINDS = ("decode", "prefill")
"""Keys of ``kernels_per_layer`` and ``kernels_per_forward``: a decode-only iteration (replayed
from CUDA graphs when the engine has them) and one with prefill tokens (always eager)."""
NARROW_DECODE = "narrow_decode"
"""Optional third key: a decode-only iteration of at most ``narrow_decode_batch`` sequences
replayed from CUDA graphs. Such graphs take the Triton decode GEMM (``layers.graph_kernels``),
which needs no split-K reduce kernels: on the H200, Qwen3-8B, 10 kernels a layer against 12."""
PIECEWISE = "piecewise"
"""Optional fourth key: the host launches (graph replays, attention launched between them, input
copies, sampling) of an iteration with prefill tokens replayed from piecewise CUDA graphs
(``duetserve.engine.piecewise_graphs``); its GPU still runs the ``"prefill"`` count of kernels.
Without it such iterations are priced as eager ones."""


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU model as the cost model sees it.

    Units: SMs for S, FLOP/s for compute, bytes/s for bandwidth, bytes for memory,
    seconds for latency. ``compute_efficiency`` and ``bandwidth_efficiency`` (both in
    (0, 1], default 1) scale the whole curve; they express assumptions such as "50% MFU"
    without editing the points (the "PD multiplexing" notebook's estimate uses 0.5 and 0.85).

    ``decode_interference`` and ``prefill_interference`` (>= 1) multiply the predicted
    time of the decode and prefill side of a spatial plan, for the memory bandwidth and L2
    the two sides still share (docs/design.md section 5 measured decode +39%, GEMM +9%).

    ``kernel_gpu_s`` and ``launch_cpu_s`` (seconds per kernel, >= 0) and ``kernels_per_layer``
    and ``kernels_per_forward`` (kernel counts by ``ITERATION_KINDS``) are the optional
    per-kernel overhead model (module docstring); nonzero constants need counts for both kinds.
    ``narrow_decode_batch`` (sequences, >= 0; 0: none) goes with counts for ``NARROW_DECODE`` in
    both maps: graph-replayed decodes of at most that many sequences count those instead of
    ``"decode"``'s (``iteration_kernels``); counts for ``PIECEWISE`` (optional, in both maps) are the
    host launches of iterations replayed from piecewise CUDA graphs.
    ``host_per_request_s`` and ``host_eager_s`` (seconds, >= 0): the serving host time of a
    temporal iteration (module docstring); ``host_piecewise_s`` (seconds, >= 0, or None: the
    ``host_eager_s`` term) replaces ``host_eager_s`` for an iteration replayed from piecewise CUDA
    graphs (``piecewise_host_s``). ``host_gap_s`` and ``host_gap_per_request_s`` (seconds, >= 0):
    the host time between iterations (module docstring; ``gap_s``).

    ``attention_efficiency`` (in (0, 1], default 1): the share of ``Pi(S)`` that the engine's
    prefill attention kernel reaches on attention FLOPs (a GEMM-rate roofline is optimistic for
    flash-style attention: the Triton kernel measured 311-342 TFLOP/s against 797 on the H200).
    ``gemm_efficiency`` (in (0, 1], default 1): the share of ``Pi(S)`` that the served model's
    token-level operators (its weight GEMMs, norms and lm_head) reach on their FLOPs, fitted by
    ``duetserve calibrate`` (``calibrate.overhead``): ``Pi(S)`` is measured on one square 8192^3
    product, and two H200 calibrations of Qwen3-8B's iterations fitted 0.80-0.85 of it
    (docs/benchmarks.md, thirty-fifth H200 session).

    ``provenance`` maps every number field to ``"measured"`` or ``"datasheet"``; the overhead
    fields, ``attention_efficiency`` and ``gemm_efficiency`` need an entry only when they differ
    from their default.

    Raises:
        ValueError: on inconsistent fields (unsorted or out-of-range points, a curve
            above the datasheet peak, negative overheads, kernel counts of unknown kinds,
            missing or unknown provenance entries).
    """

    name: str
    description: str
    num_sms: int
    num_tpcs: int
    compute_capability_major: int
    peak_flops: float
    peak_bandwidth: float
    compute_points: Points
    bandwidth_points: Points
    hbm_bytes: float
    nvlink_bandwidth: float
    allreduce_alpha_s: float
    partition_granularity: Mapping[str, int]
    partition_min_sms: Mapping[str, int]
    decode_interference: float
    prefill_interference: float
    provenance: Mapping[str, str]
    notes: str = ""
    compute_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    kernel_gpu_s: float = 0.0
    launch_cpu_s: float = 0.0
    kernels_per_layer: Mapping[str, int] = field(default_factory=dict)
    kernels_per_forward: Mapping[str, int] = field(default_factory=dict)
    attention_efficiency: float = 1.0
    gemm_efficiency: float = 1.0
    host_per_request_s: float = 0.0
    host_eager_s: float = 0.0
    narrow_decode_batch: int = 0
    host_piecewise_s: float | None = None
    host_gap_s: float = 0.0
    host_gap_per_request_s: float = 0.0

    def gap_s(self, requests: int) -> float:
        """Seconds of host time between an iteration of ``requests`` requests and the next one."""
        return self.host_gap_s + requests * self.host_gap_per_request_s

    def __post_init__(self) -> None:
        for f in fields(self):  # numbers first: NaN passes every comparison below (and hung simulate)
            value = getattr(self, f.name)
            if f.type in ("int", "float") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                               or not math.isfinite(value) or (f.type == "int" and value != int(value))):
                kind = "an integer" if f.type == "int" else "a number"
                raise ValueError(f"{self.name}: {f.name} must be {kind} (finite), got {value!r}")
        self._check_points("compute_points", self.compute_points, self.peak_flops)
        self._check_points("bandwidth_points", self.bandwidth_points, self.peak_bandwidth)
        for eff in ("compute_efficiency", "bandwidth_efficiency", "attention_efficiency", "gemm_efficiency"):
            if not 0.0 < getattr(self, eff) <= 1.0:
                raise ValueError(f"{self.name}: {eff} must be in (0, 1]")
        if min(self.decode_interference, self.prefill_interference) < 1.0:
            raise ValueError(f"{self.name}: interference factors must be >= 1")
        for label in ("partition_granularity", "partition_min_sms"):
            per_backend = getattr(self, label)
            if not isinstance(per_backend, Mapping) or any(
                    not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.num_sms
                    for n in per_backend.values()):
                raise ValueError(f"{self.name}: {label} maps partition backends to SM counts in [1, num_sms="
                                 f"{self.num_sms}], got {per_backend!r}")
        if set(self.partition_granularity) != set(self.partition_min_sms):
            raise ValueError(f"{self.name}: granularity and min SMs name different backends")
        self._check_overheads()
        defaults = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(self)
                    if f.name in _OPTIONAL_PROVENANCE_FIELDS}
        expected = set(_PROVENANCE_FIELDS) | {f for f in _OPTIONAL_PROVENANCE_FIELDS if getattr(self, f) != defaults[f]}
        allowed = set(_PROVENANCE_FIELDS) | set(_OPTIONAL_PROVENANCE_FIELDS)
        if not expected <= set(self.provenance) <= allowed:
            raise ValueError(
                f"{self.name}: provenance must cover {sorted(expected)} and may add {_OPTIONAL_PROVENANCE_FIELDS}; "
                f"missing {sorted(expected - set(self.provenance))}, "
                f"unknown {sorted(set(self.provenance) - allowed)}"
            )
        bad = {k: v for k, v in self.provenance.items() if v not in PROVENANCE_VALUES}
        if bad:
            raise ValueError(f"{self.name}: provenance values must be in {PROVENANCE_VALUES}: {bad}")

    def _check_overheads(self) -> None:
        if min(self.kernel_gpu_s, self.launch_cpu_s, self.host_per_request_s, self.host_eager_s, self.host_gap_s,
               self.host_gap_per_request_s) < 0:
            raise ValueError(f"{self.name}: kernel_gpu_s, launch_cpu_s, host_per_request_s, host_eager_s, host_gap_s "
                             f"and host_gap_per_request_s must be >= 0 seconds")
        pw = self.host_piecewise_s
        if pw is not None and (isinstance(pw, bool) or not isinstance(pw, (int, float)) or not 0 <= pw < math.inf):
            raise ValueError(f"{self.name}: host_piecewise_s must be a finite number of seconds >= 0 or null, "
                             f"got {pw!r}")
        kinds = (*ITERATION_KINDS, NARROW_DECODE, PIECEWISE)
        if int(self.narrow_decode_batch) != self.narrow_decode_batch or self.narrow_decode_batch < 0:
            raise ValueError(f"{self.name}: narrow_decode_batch must be an integer >= 0, got {self.narrow_decode_batch}")
        for label in ("kernels_per_layer", "kernels_per_forward"):
            counts = getattr(self, label)
            if not isinstance(counts, Mapping) or not set(counts) <= set(kinds) or any(
                    isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts.values()):
                raise ValueError(f"{self.name}: {label} maps {kinds} to kernel counts >= 0, got {counts}")
            if (self.kernel_gpu_s or self.launch_cpu_s) and not set(ITERATION_KINDS) <= set(counts):
                raise ValueError(f"{self.name}: per-kernel overheads need {label} for {ITERATION_KINDS}")
            if (NARROW_DECODE in counts) != (self.narrow_decode_batch > 0):
                raise ValueError(f"{self.name}: {label} has a {NARROW_DECODE!r} count exactly when "
                                 f"narrow_decode_batch > 0 (it is {self.narrow_decode_batch})")
        if (PIECEWISE in self.kernels_per_layer) != (PIECEWISE in self.kernels_per_forward):
            raise ValueError(f"{self.name}: a {PIECEWISE!r} count goes in both kernels_per_layer and "
                             "kernels_per_forward, or in neither")

    @property
    def piecewise_host_s(self) -> float:
        """Seconds of serving host time an iteration replayed from piecewise CUDA graphs adds
        (``host_piecewise_s``, else ``host_eager_s``)."""
        return self.host_eager_s if self.host_piecewise_s is None else self.host_piecewise_s

    def iteration_kernels(self, layers: int, decode_only: ArrayLike, replayed: ArrayLike,
                          batch: ArrayLike) -> np.ndarray:
        """Kernels of iterations of a ``layers``-layer model (arrays broadcast): the
        ``NARROW_DECODE`` count for a decode-only one replayed from CUDA graphs with at most
        ``narrow_decode_batch`` requests (``batch``), the ``"decode"`` count for other decode-only
        ones, the ``"prefill"`` count otherwise (``kernel_count``)."""
        decode_only = np.asarray(decode_only, dtype=bool)
        narrow = decode_only & np.asarray(replayed, dtype=bool) & (np.asarray(batch) <= self.narrow_decode_batch)
        return np.where(narrow, self.kernel_count(NARROW_DECODE, layers),
                        np.where(decode_only, self.kernel_count("decode", layers), self.kernel_count("prefill", layers)))

    def kernel_count(self, kind: str, layers: int) -> int:
        """Kernels of one forward of a ``layers``-layer model in an iteration of ``kind``
        (``ITERATION_KINDS``, ``NARROW_DECODE`` or ``PIECEWISE``): ``layers * kernels_per_layer +
        kernels_per_forward``; 0 where the profile has no counts."""
        return layers * self.kernels_per_layer.get(kind, 0) + self.kernels_per_forward.get(kind, 0)

    def _check_points(self, label: str, points: Points, peak: float) -> None:
        sms = [p[0] for p in points]
        if not all(math.isfinite(x) for p in points for x in p):
            raise ValueError(f"{self.name}: {label} must be finite numbers")
        if not points or sms[0] <= 0 or any(b <= a for a, b in pairwise(sms)):
            raise ValueError(f"{self.name}: {label} need strictly increasing S > 0")
        if sms[-1] != self.num_sms:
            raise ValueError(f"{self.name}: {label} must end at num_sms={self.num_sms}")
        if any(not 0 < rate <= peak for _, rate in points):
            raise ValueError(f"{self.name}: {label} rates must be in (0, datasheet peak {peak:g}]")

    def compute_rate(self, sms: ArrayLike) -> np.ndarray:
        """Pi(S): FLOP/s reachable with ``sms`` SMs (scalar or array), times compute_efficiency.

        Linear interpolation between ``compute_points`` from (0, 0). Raises ValueError
        for S <= 0 or S > num_sms.
        """
        return self._interpolate(self.compute_points, sms) * self.compute_efficiency

    def bandwidth(self, sms: ArrayLike) -> np.ndarray:
        """BW(S): memory bytes/s reachable with ``sms`` SMs (scalar or array), times
        bandwidth_efficiency.

        Linear interpolation between ``bandwidth_points`` from (0, 0). Raises ValueError
        for S <= 0 or S > num_sms.
        """
        return self._interpolate(self.bandwidth_points, sms) * self.bandwidth_efficiency

    def _interpolate(self, points: Points, sms: ArrayLike) -> np.ndarray:
        s = np.asarray(sms, dtype=float)
        if np.any(s <= 0) or np.any(s > self.num_sms):
            raise ValueError(f"{self.name}: S must be in (0, {self.num_sms}] SMs, got {sms}")
        xs = [0.0] + [p[0] for p in points]
        ys = [0.0] + [p[1] for p in points]
        return np.interp(s, xs, ys)

    def granularity(self, backend: str) -> int:
        """SM step of partitions under ``backend`` (``"greenctx"`` or ``"tpcmask"``).

        Raises ValueError for a backend the profile does not know.
        """
        return self._backend_value(self.partition_granularity, backend)

    def min_partition_sms(self, backend: str) -> int:
        """Smallest partition, in SMs, that ``backend`` can create. Raises ValueError as above."""
        return self._backend_value(self.partition_min_sms, backend)

    def _backend_value(self, table: Mapping[str, int], backend: str) -> int:
        if backend not in table:
            raise ValueError(f"{self.name}: unknown partition backend {backend!r}; known {sorted(table)}")
        return table[backend]


_OPTIONAL_PROVENANCE_FIELDS = ("kernel_gpu_s", "launch_cpu_s", "kernels_per_layer", "kernels_per_forward",
                               "attention_efficiency", "gemm_efficiency", "host_per_request_s", "host_eager_s", "narrow_decode_batch",
                               "host_piecewise_s", "host_gap_s", "host_gap_per_request_s")
_PROVENANCE_FIELDS = tuple(
    f.name
    for f in fields(HardwareProfile)
    if f.name not in ("name", "description", "provenance", "notes", "compute_efficiency", "bandwidth_efficiency",
                      *_OPTIONAL_PROVENANCE_FIELDS)
)


def saturating_points(peak: float, s_sat: float, num_sms: int) -> Points:
    """Curve points for ``rate(S) = peak * min(1, S / s_sat)`` on a GPU of ``num_sms`` SMs.

    With the profile's interpolation from (0, 0) these points reproduce the formula exactly;
    ``s_sat = num_sms`` gives a rate linear in S. The "PD multiplexing" notebook ("Is it worth it")
    models decode bandwidth this way. Units follow ``peak`` (FLOP/s or bytes/s).

    Raises ValueError if ``s_sat`` or ``num_sms`` is not positive.
    """
    if s_sat <= 0 or num_sms <= 0:
        raise ValueError("s_sat and num_sms must be positive")
    if s_sat >= num_sms:
        return ((num_sms, peak * num_sms / s_sat),)
    return ((s_sat, peak), (num_sms, peak))


def available_profiles() -> list[str]:
    """Names of the profiles shipped with duetserve (``load_profile`` accepts them)."""
    return sorted(p.name[:-5] for p in _profile_dir().iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """Load a shipped profile by name (``h200``, ``h100``, ``a100``, ``h20``, any case) or a
    JSON file by path.

    A ``"calibration"`` key (measured iteration latencies that ``duetserve calibrate`` keeps
    beside the curves) is ignored.

    Raises ValueError if it is neither a shipped name nor an existing file, or if the file
    does not describe a valid profile (unknown or missing keys included).
    """
    name = str(name_or_path).lower()
    if name in available_profiles():
        text = (_profile_dir() / f"{name}.json").read_text()
    elif Path(name_or_path).is_file():
        text = Path(name_or_path).read_text()
    else:
        raise ValueError(f"no profile {name_or_path!r}: not one of {available_profiles()} and not a file")
    try:
        raw = loads_object(text)
    except ValueError as exc:
        raise ValueError(f"profile {name_or_path!r}: {exc}") from exc
    return profile_from_json(raw, name_or_path)


def profile_from_json(raw: dict, source: str | Path) -> HardwareProfile:
    """The ``HardwareProfile`` a profile's parsed JSON object describes (``load_profile``'s checks;
    ``source`` names it in errors). A ``"calibration"`` key is ignored; ``raw`` is not changed.

    Raises ValueError on unknown or missing keys, curves that are not [SMs, rate] number pairs,
    or values ``HardwareProfile`` refuses.
    """
    raw = {k: v for k, v in raw.items() if k != "calibration"}
    known = {f.name for f in fields(HardwareProfile)}
    if set(raw) - known:
        raise ValueError(f"profile {source!r}: unknown keys {sorted(set(raw) - known)}")
    required = {f.name for f in fields(HardwareProfile) if f.default is MISSING and f.default_factory is MISSING}
    if required - set(raw):
        raise ValueError(f"profile {source!r}: missing keys {sorted(required - set(raw))}")
    for key in ("compute_points", "bandwidth_points"):
        try:
            raw[key] = tuple((float(s), float(r)) for s, r in raw[key])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"profile {source!r}: {key} must be a list of [SMs, rate] number pairs") from exc
    return HardwareProfile(**raw)


def _profile_dir():  # a Traversable (importlib.resources)
    return resources.files("duetserve.planner") / "profiles"


def roofline_only(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` without the calibrated per-kernel and host overheads (the gap between
    iterations included) and GEMM and attention efficiencies: the pure roofline of
    docs/design.md section 3."""
    provenance = {k: v for k, v in profile.provenance.items() if k not in _OPTIONAL_PROVENANCE_FIELDS}
    return replace(profile, kernel_gpu_s=0.0, launch_cpu_s=0.0, kernels_per_layer={}, kernels_per_forward={},
                   gemm_efficiency=1.0, attention_efficiency=1.0, host_per_request_s=0.0, host_eager_s=0.0,
                   narrow_decode_batch=0, host_piecewise_s=None, host_gap_s=0.0, host_gap_per_request_s=0.0, provenance=provenance)
