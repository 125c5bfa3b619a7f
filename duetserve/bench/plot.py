"""Plots of benchmark results: TTFT and TBT CDFs, and TBT over time (TBT on log axes).

Spatial iterations can be marked on the time axis from an iteration log: a JSONL file whose
records are ``{"t": UNIX_SECONDS, "spatial": BOOL}``, one per engine iteration (``t`` is Unix
time, so it lines up with each result's ``start_time_unix``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

MIN_GAP_MS = 0.01
"""Gaps below this (chunks that arrived together) are drawn at it: the TBT axes are logarithmic,
so the tail (SLO misses, stalls of seconds) and the bulk (a few ms) both stay readable."""


def read_iteration_log(path: str | Path) -> list[float]:
    """Unix times in seconds of the spatial iterations in a JSONL iteration log.

    Raises:
        OSError: the file cannot be read.
        ValueError: a line that is not a JSON object with ``t`` and ``spatial``.
    """
    times = []
    with open(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
                if rec["spatial"]:
                    times.append(float(rec["t"]))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{line}: {type(e).__name__}: {e}") from e
    return times


def _gaps(result: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(time from the run start of each gap's second chunk, gap) in seconds, successes only."""
    at, gaps = [], []
    for r in result["requests"]:
        if r["error"] is None and r["itls_s"]:
            itls = np.asarray(r["itls_s"])
            at.append(r["start_s"] + r["ttft_s"] + np.cumsum(itls))
            gaps.append(itls)
    if not gaps:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(at), np.concatenate(gaps)


def _cdf(ax: Any, values_ms: np.ndarray, label: str) -> None:
    if len(values_ms):
        xs = np.sort(values_ms)
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)


def plot_results(
    results: Sequence[dict[str, Any]],
    labels: Sequence[str],
    out_path: str | Path,
    spatial_times_unix: Sequence[float] = (),
    spatial_by_result: Sequence[Sequence[float]] | None = None,
) -> None:
    """Draw TTFT CDF, TBT CDF and TBT over time of one or more results into one image.

    Args:
        results: result dicts as saved by ``duetserve bench`` (with ``requests``).
        labels: one legend label per result.
        out_path: image file; the format follows the suffix (``.png``, ``.pdf``, ...).
        spatial_times_unix: Unix times of spatial iterations, marked under each result's
            TBT-over-time points when they fall inside its run.
        spatial_by_result: instead, one list of such times per result (results of servers that
            ran at the same time, e.g. on different GPUs, each get their own server's marks).

    Raises:
        KeyError: a result without per-request records.
        ValueError: ``labels`` or ``spatial_by_result`` do not match ``results`` in length.
        OSError: the image cannot be written.
    """
    fig = Figure(figsize=(16, 4.8), layout="constrained")
    ax_ttft, ax_tbt, ax_time = fig.subplots(1, 3)
    if spatial_by_result is None:
        spatial_by_result = [spatial_times_unix] * len(results)
    for result, label, times in zip(results, labels, spatial_by_result, strict=True):
        spatial = np.asarray(times, dtype=float)
        ok = [r for r in result["requests"] if r["error"] is None]
        _cdf(ax_ttft, np.array([r["ttft_s"] for r in ok]) * 1000, label)
        at, gaps = _gaps(result)
        gaps_ms = np.maximum(gaps * 1000, MIN_GAP_MS)  # log axes: chunks that came together sit at the floor
        _cdf(ax_tbt, gaps_ms, label)
        points = ax_time.scatter(at, gaps_ms, s=2, alpha=0.4, label=label)
        rel = spatial - result["start_time_unix"]
        rel = rel[(rel >= 0) & (rel <= result["duration"])]
        if len(rel):  # ticks along the bottom edge (x in data, y in axes coordinates)
            ax_time.plot(rel, np.zeros_like(rel), "|", color=points.get_facecolor()[0], markersize=10,
                         transform=ax_time.get_xaxis_transform(), label=f"{label}: spatial iterations")
    slos = {r.get("tbt_slo_ms") for r in results} - {None}
    for slo in slos:
        ax_tbt.axvline(slo, color="red", linestyle="--", label=f"TBT SLO {slo:g} ms")
        ax_time.axhline(slo, color="red", linestyle="--", label=f"TBT SLO {slo:g} ms")
    ax_ttft.set(title="TTFT CDF", xlabel="TTFT (ms)", ylabel="fraction of requests")
    ax_tbt.set(title="TBT CDF (per streamed chunk)", xlabel="TBT (ms, log)", ylabel="fraction of gaps", xscale="log")
    ax_time.set(title="TBT over time", xlabel="time since start (s)", ylabel="TBT (ms, log)", yscale="log")
    for ax in (ax_ttft, ax_tbt, ax_time):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.savefig(out_path, dpi=120)
