"""Fitting the cost model's serving host time to a server's iteration log (beyond the DuetServe
paper; ``duetserve.planner.cost_model``, "Host time").

``duetserve serve --iteration-log LOG`` writes one JSON line per iteration with the plan's
``predicted_s`` and the ``measured_s`` wall time of the whole engine step. For a temporal
iteration of ``R`` requests the cost model adds ``R h_r + e h_e`` seconds of host time
(``e = 1`` when the iteration runs eagerly: it has prefill tokens, or the server records no
CUDA graphs, ``cuda_graphs`` false in the log). The log's predictions were made with terms ``h_r0``, ``h_e0`` (each record carries
them; older logs: the profile's), so ``measured - predicted + R h_r0 + e h_e0`` is
``R h_r + e h_e`` plus noise. The fit minimises the sum of relative errors ``|pred - meas| /
meas`` (L1, by iteratively reweighted least squares: robust to a stray slow iteration such as
a kernel compile, and aimed at the median error it reports), each term clamped at 0 (the other
refitted alone when one is clamped). Spatial iterations,
multi-step decodes (``k > 1``) and pdmux rounds (``prefill_layers``) are left out: their host
work overlaps the GPU.
"""
from __future__ import annotations

import gzip
import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duetserve.jsonio import loads_object
from duetserve.planner.hardware import HardwareProfile


@dataclass(frozen=True)
class HostFit:
    """Fitted host terms (seconds) and the log's median relative error ``|pred - meas| / meas``
    over the ``rows`` iterations used, with the log's predictions and with the fitted terms."""

    host_per_request_s: float
    host_eager_s: float
    rows: int
    median_error_before: float
    median_error_after: float


def read_iteration_log(path: str | Path) -> list[dict[str, Any]]:
    """The JSON records of an iteration log (blank lines skipped; a name ending in ``.gz`` is
    read gzipped, as ``scripts/device_serving.sh`` keeps them).

    Raises OSError when unreadable (a bad gzip file too), ValueError on a line that is not a
    JSON object or whose numbers are not finite numbers >= 0 (naming them; NaN broke the
    least-squares fit and inf fitted zeros)."""
    data = Path(path).read_bytes()
    if str(path).lower().endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # cut off, damaged, not gzip
            raise OSError(f"{path}: not a whole gzip file ({exc})") from None
    text = data.decode()
    records = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                record = loads_object(line)
            except ValueError as exc:
                raise ValueError(f"{path}: line {i}: {exc}") from exc
            bad = [k for k in _NUMERIC if record.get(k) is not None and
                   (isinstance(record[k], bool) or not isinstance(record[k], (int, float))
                    or not 0 <= record[k] < math.inf)]
            if bad:
                raise ValueError(f"{path}: line {i}: {', '.join(bad)} must be finite numbers >= 0")
            records.append(record)
    return records


_NUMERIC = ("k", "predicted_s", "measured_s", "num_decodes", "num_prefills", "num_prefill_tokens",
            "host_per_request_s", "host_eager_s")


def temporal_rows(records: Iterable[Mapping[str, Any]], profile: HardwareProfile) -> np.ndarray:
    """``(N, 6)`` array of the temporal single-step iterations with both times, columns ``R``
    (decodes plus prefill chunks; logs without ``num_prefills`` count one chunk when there are
    prefill tokens), ``e`` (1.0 eager: prefill tokens, or a server without CUDA graphs),
    ``predicted_s``, ``measured_s`` and the two host terms
    the prediction used (the record's, else ``profile``'s)."""
    rows = []
    for r in records:
        pred, meas = r.get("predicted_s"), r.get("measured_s")
        if r.get("spatial") or r.get("k", 1) != 1 or r.get("prefill_layers") is not None or not pred or not meas:
            continue
        prefill = (r.get("num_prefill_tokens") or 0) > 0  # null: none logged
        requests = (r.get("num_decodes") or 0) + (r.get("num_prefills") if r.get("num_prefills") is not None
                                                  else int(prefill))
        eager = prefill or not r.get("cuda_graphs", True)  # without graphs every iteration is eager
        if requests:
            rows.append((requests, float(eager), pred, meas, r.get("host_per_request_s", profile.host_per_request_s),
                         r.get("host_eager_s", profile.host_eager_s)))
    return np.array(rows, dtype=float).reshape(-1, 6)


def fit_host_overheads(records: Iterable[Mapping[str, Any]], profile: HardwareProfile) -> HostFit:
    """Fit ``host_per_request_s`` and ``host_eager_s`` to ``records`` (an iteration log made
    by a server planning with ``profile``, whose terms count for records that do not carry
    their own); module docstring.

    Raises ValueError when fewer than 2 temporal iterations with predictions are logged (logs
    written before every policy's records carried one: chunked's had none), or when they hold no
    decode-only or no eager iteration (the two terms cannot be told apart).
    """
    rows = temporal_rows(records, profile)
    x, pred, meas, used = rows[:, :2], rows[:, 2], rows[:, 3], rows[:, 4:]
    if len(pred) < 2 or x[:, 1].all() or not x[:, 1].any():
        raise ValueError(f"{len(pred)} temporal iterations with predictions ({int(x[:, 1].sum())} eager): "
                         "need both decode-only and eager ones (a log of a server that both decoded alone and prefilled)")
    host = meas - pred + (x * used).sum(axis=1)  # the host time by the model: R h_r + e h_e
    new = _l1_fit(x, host, 1.0 / meas)
    for i in (0, 1):  # a negative term: clamp it at 0 and refit the other alone
        if new[i] < 0:
            j = 1 - i
            new[i] = 0.0
            new[j] = max(0.0, float(_l1_fit(x[:, j:j + 1], host, 1.0 / meas)[0]))
    after = pred + (x * (new - used)).sum(axis=1)
    return HostFit(float(new[0]), float(new[1]), len(pred), float(np.median(np.abs(pred - meas) / meas)),
                   float(np.median(np.abs(after - meas) / meas)))


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
