"""Fitting the cost model's serving host time to a server's iteration log (beyond the DuetServe
paper; ``duetserve.planner.cost_model``, "Host time").

``duetserve serve --iteration-log LOG`` writes one JSON line per iteration with the plan's
``predicted_s`` and the ``measured_s`` wall time of the whole engine step. For a temporal
iteration of ``R`` requests the cost model adds ``R h_r + e h_e + w h_pw`` seconds of host time:
``w = 1`` when the iteration replays piecewise CUDA graphs (it has prefill tokens and at most the
log's ``piecewise_tokens`` tokens in all), else ``e = 1`` when it runs eagerly (it has prefill
tokens, or the server records no CUDA graphs, ``cuda_graphs`` false in the log). The log's
predictions were made with terms ``h_r0``, ``h_e0``, ``h_pw0`` (each record carries them; older
logs: the profile's), so ``measured - predicted + R h_r0 + e h_e0 + w h_pw0`` is ``R h_r + e h_e +
w h_pw`` plus noise. The fit minimises the sum of relative errors ``|pred - meas| / meas`` (L1,
by iteratively reweighted least squares: robust to a stray slow iteration such as a kernel
compile, and aimed at the median error it reports), each term clamped at 0 (the most negative
one set to 0 and the others refitted, until none is negative). A term no logged iteration
carries (no piecewise iterations, say) is not fitted. Spatial iterations, multi-step decodes
(``k > 1``) and pdmux rounds (``prefill_layers``) are left out: their host work overlaps the GPU.
A log with no single-step decode-only iteration (a server with multi-step decode, the default,
decodes alone only in multi-step iterations) cannot tell ``R h_r`` from the eager term: ``h_r``
then stays the one the log was predicted with and only the others are fitted.

A log of a server that planned with another profile (e.g. GPU terms changed since) is first
re-predicted (``repredict``): each fitted iteration's ``predicted_s`` becomes the new profile's
prediction for its logged requests, with that profile's host terms.
"""
from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duetserve.jsonio import loads_object
from duetserve.planner.cost_model import CostModel, ModelShape
from duetserve.planner.hardware import HardwareProfile


@dataclass(frozen=True)
class HostFit:
    """Fitted host terms (seconds; ``host_eager_s`` / ``host_piecewise_s`` None when no logged
    iteration ran eagerly / from piecewise graphs) and the log's median relative error
    ``|pred - meas| / meas`` over the ``rows`` iterations used, with the log's predictions and
    with the fitted terms. ``per_request_fitted`` False: ``host_per_request_s`` is the log's own
    (no single-step decode-only iteration logged; module docstring)."""

    host_per_request_s: float
    host_eager_s: float | None
    host_piecewise_s: float | None
    rows: int
    median_error_before: float
    median_error_after: float
    per_request_fitted: bool = True


def read_iteration_log(path: str | Path) -> list[dict[str, Any]]:
    """The JSON records of an iteration log (blank lines skipped; a name ending in ``.gz`` is
    read gzipped, as ``scripts/device_serving.sh`` keeps them).

    Raises OSError when unreadable (a bad gzip file too), ValueError on a line that is not a
    JSON object, whose numbers are not numbers >= 0 and below ``_LIMITS`` (seconds under an hour,
    counts under 2^31; naming them: NaN broke the least-squares fit, inf and 1e300 fitted zeros),
    or whose flags (``spatial``, ``cuda_graphs``) are not true, false or null (the string "false"
    was taken as true)."""
    data = Path(path).read_bytes()
    if str(path).lower().endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # cut off, damaged, not gzip
            raise OSError(f"{path}: not a whole gzip file ({exc})") from None
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from None
    records = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                record = loads_object(line)
            except ValueError as exc:
                raise ValueError(f"{path}: line {i}: {exc}") from exc
            for names, kind, limit, label in _LIMITS:
                bad = [k for k in names if record.get(k) is not None and (isinstance(record[k], bool)
                       or not isinstance(record[k], (int, float)) or not 0 <= record[k] < limit)]
                if bad:
                    raise ValueError(f"{path}: line {i}: {', '.join(bad)} must be {kind} >= 0 and below {label}")
            flags = [k for k in _FLAGS if record.get(k) is not None and not isinstance(record[k], bool)]
            if flags:
                raise ValueError(f"{path}: line {i}: {', '.join(flags)} must be true, false or null")
            records.append(record)
    return records


_TERMS = ("host_per_request_s", "host_eager_s", "host_piecewise_s")
# The logged numbers and their bounds: an iteration (or gap) of an hour is no served one.
_LIMITS = ((("predicted_s", "measured_s", *_TERMS, "gap_s"), "seconds", 3600.0, "3600"),
           (("k", "num_decodes", "num_prefills", "num_prefill_tokens", "piecewise_tokens"), "counts", 2.0**31, "2^31"))
_FLAGS = ("spatial", "cuda_graphs")


@dataclass(frozen=True)
class GapSummary:
    """Host time between iterations in an iteration log (``StepStats.gap_s``): ``count``
    iterations that had one, its median and p90 in seconds, and their sum over the
    iterations' own ``measured_s`` summed over the same iterations (a share)."""

    count: int
    median_s: float
    p90_s: float
    share: float


def gap_summary(records: Iterable[Mapping[str, Any]]) -> GapSummary | None:
    """``GapSummary`` of the records that carry a ``gap_s`` (logs written before it have none:
    None then). Beyond the paper: the cost model prices iterations, not the host time between
    them, which was 2-3 ms at the median on the H200 serving Azure traces (docs/benchmarks.md,
    twenty-seventh session)."""
    rows = [(r["gap_s"], r["measured_s"]) for r in records if r.get("gap_s") is not None and r.get("measured_s")]
    if not rows:
        return None
    gaps, measured = np.array(rows).T
    return GapSummary(len(rows), float(np.median(gaps)), float(np.quantile(gaps, 0.9)),
                      float(gaps.sum() / measured.sum()))


def fit_gap(records: Iterable[Mapping[str, Any]]) -> tuple[float, float] | None:
    """``(host_gap_s, host_gap_per_request_s)``: the L1 fit of ``gap_s = a + b R`` over the
    records that carry a ``gap_s``, ``R`` the requests of the record before it (the iteration
    whose tokens the gap hands out), both terms >= 0 (a negative one is set to 0 and the other
    refitted); None when fewer than 2 records carry one. On the H200 at 256 sequences the gap
    grew from 0.7 ms at the median with under 8 requests to 2.9 ms with 96 or more
    (docs/benchmarks.md, twenty-ninth session)."""
    rows, before = [], None
    for r in records:
        gap = r.get("gap_s")
        if gap is not None and before is not None and before.get("policy") == r.get("policy"):
            rows.append((len(before.get("requests") or ()), gap))
        before = r
    if len(rows) < 2:
        return None
    requests, gaps = np.array(rows, dtype=float).T
    ones = np.ones_like(requests)
    a, b = _l1_fit(np.column_stack([ones, requests]), gaps, ones)
    if b < 0:
        return float(np.median(gaps)), 0.0
    if a < 0:
        return 0.0, float(_l1_fit(requests[:, None], gaps, ones)[0])
    return float(a), float(b)


def temporal_rows(records: Iterable[Mapping[str, Any]], profile: HardwareProfile) -> np.ndarray:
    """``(N, 8)`` array of the temporal single-step iterations with both times, columns ``R``
    (decodes plus prefill chunks; logs without ``num_prefills`` count one chunk when there are
    prefill tokens), ``e`` (1.0 eager: prefill tokens beyond the record's ``piecewise_tokens``,
    or a server without CUDA graphs), ``w`` (1.0 replayed from piecewise graphs: prefill tokens,
    at most ``piecewise_tokens`` tokens with the decodes), ``predicted_s``, ``measured_s`` and the
    three host terms the prediction used (the record's, else ``profile``'s)."""
    defaults = (profile.host_per_request_s, profile.host_eager_s, profile.piecewise_host_s)
    rows = []
    for r in records:
        pred, meas = r.get("predicted_s"), r.get("measured_s")
        if r.get("spatial") or r.get("k", 1) != 1 or r.get("prefill_layers") is not None or not pred or not meas:
            continue
        prefill_tokens = r.get("num_prefill_tokens") or 0  # null: none logged
        decodes = r.get("num_decodes") or 0
        requests = decodes + (r.get("num_prefills") if r.get("num_prefills") is not None else int(prefill_tokens > 0))
        graphs = r.get("cuda_graphs", True)
        piecewise = graphs and prefill_tokens > 0 and decodes + prefill_tokens <= (r.get("piecewise_tokens") or 0)
        eager = (prefill_tokens > 0 or not graphs) and not piecewise  # without graphs every iteration is eager
        used = [r[k] if r.get(k) is not None else d for k, d in zip(_TERMS, defaults, strict=True)]
        if requests:
            rows.append((requests, float(eager), float(piecewise), pred, meas, *used))
    return np.array(rows, dtype=float).reshape(-1, 8)


def repredict(records: Iterable[Mapping[str, Any]], shape: ModelShape, profile: HardwareProfile) -> list[dict]:
    """``records`` as if logged by a server planning with ``profile``: each temporal single-step
    iteration (``temporal_rows``' kind) gets ``predicted_s`` from ``CostModel.predict_total`` of its
    logged ``requests`` (``[q, c]`` pairs) on all ``profile.num_sms`` SMs, with the record's
    ``cuda_graphs`` and ``piecewise_tokens``, and ``profile``'s host terms; one without
    ``requests`` gets ``predicted_s`` None (left out of the fit). Other records are copied as they are.

    Raises ValueError "record N: ..." (N from 1, as the log's lines without blanks) for ``requests``
    that are not a list of ``[q, c]`` integer pairs with ``1 <= q`` and ``0 <= c``, both below 2^31.
    """
    models: dict[tuple[bool, int], CostModel] = {}
    terms = dict(zip(_TERMS, (profile.host_per_request_s, profile.host_eager_s, profile.host_piecewise_s)))
    out = []
    for i, r in enumerate(records, 1):
        r = dict(r)
        if not r.get("spatial") and r.get("k", 1) == 1 and r.get("prefill_layers") is None:
            key = (bool(r.get("cuda_graphs", True)), int(r.get("piecewise_tokens") or 0))
            if key not in models:
                models[key] = CostModel(shape, profile, cuda_graphs=key[0], piecewise_tokens=key[1])
            model = models[key]
            reqs = _requests(i, r.get("requests"))
            r["predicted_s"] = float(model.predict_total(reqs, profile.num_sms)) if reqs else None
            r.update(terms)
        out.append(r)
    return out


def _requests(i: int, logged: Any) -> list[tuple[int, int]]:
    """Record ``i``'s logged ``requests`` as ``(q, c)`` pairs ([] for None); ValueError otherwise."""
    if logged is None:
        return []
    def whole(x: Any, low: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and low <= x < 1 << 31

    if not isinstance(logged, list) or not all(isinstance(p, list) and len(p) == 2 and whole(p[0], 1)
                                               and whole(p[1], 0) for p in logged):
        raise ValueError(f"record {i}: requests must be [q, c] integer pairs, q >= 1 and c >= 0 (below 2^31), "
                         f"got {str(logged)[:80]}")
    return [(p[0], p[1]) for p in logged]


def fit_host_overheads(records: Iterable[Mapping[str, Any]], profile: HardwareProfile) -> HostFit:
    """Fit ``host_per_request_s``, ``host_eager_s`` and ``host_piecewise_s`` to ``records`` (an
    iteration log made by a server planning with ``profile``, whose terms count for records that
    do not carry their own); module docstring.

    Raises ValueError when fewer than 2 temporal iterations with predictions are logged (logs
    written before every policy's records carried one: chunked's had none), or when they hold none
    with prefill (the terms cannot be told apart), or only those and the records carry different
    per-request terms (none to keep).
    """
    rows = temporal_rows(records, profile)
    x, pred, meas, used = rows[:, :3], rows[:, 3], rows[:, 4], rows[:, 5:]
    with_prefill = x[:, 1:].any(axis=1)
    if len(pred) < 2 or not with_prefill.any():
        raise ValueError(f"{len(pred)} temporal iterations with predictions ({int(with_prefill.sum())} eager or "
                         "piecewise): need eager or piecewise ones (a log of a server that prefilled)")
    host = meas - pred + (x * used).sum(axis=1)  # the host time by the model: R h_r + e h_e + w h_pw
    fitted = [i for i in range(3) if x[:, i].any()]
    new = np.zeros(3)  # a term no row carries (x's column all 0) changes no prediction
    if with_prefill.all():  # no single-step decode-only iteration: keep h_r as logged (module docstring)
        if np.unique(used[:, 0]).size > 1:
            raise ValueError("no single-step decode-only iteration logged, and the records' host_per_request_s "
                             "differ: none to keep")
        new[0] = used[0, 0]
        host = host - x[:, 0] * new[0]
        fitted.remove(0)
    active = list(fitted)
    while active:
        coef = _l1_fit(x[:, active], host, 1.0 / meas)
        new[active] = coef
        if coef.min() >= 0:
            break
        worst = active[int(np.argmin(coef))]  # the most negative term: clamp it at 0, refit the others
        new[worst] = 0.0
        active.remove(worst)
    after = pred + (x * (new - used)).sum(axis=1)
    eager, piecewise = (float(new[i]) if i in fitted else None for i in (1, 2))
    return HostFit(float(new[0]), eager, piecewise, len(pred), float(np.median(np.abs(pred - meas) / meas)),
                   float(np.median(np.abs(after - meas) / meas)), 0 in fitted)


def _l1_fit(x: np.ndarray, y: np.ndarray, scale: np.ndarray, rounds: int = 50) -> np.ndarray:
    """Coefficients ``c`` minimising ``sum(scale * |x @ c - y|)`` by iteratively reweighted
    least squares (each round weights a row by ``scale / max(|residual|, floor)``), starting
    from the weighted least-squares fit. ``x`` ``(N, K)``, ``y`` and ``scale`` ``(N,)``."""
    weights = scale
    floor = 1e-9 * max(float(np.abs(y).max()), 1e-12)
    coef = np.zeros(x.shape[1])
    for _ in range(rounds):
        w = np.sqrt(weights)
        coef = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0]
        weights = scale / np.maximum(np.abs(x @ coef - y), floor)
    return coef
