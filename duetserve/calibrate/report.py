"""The cost model's prediction error against measured iteration latencies (docs/design.md section 3:
"validate predictions against measured iteration latencies"): statistics, tables, a plot.

A row is one entry of a calibrated profile's ``"calibration"`` list: ``kind`` (``decode``,
``prefill`` or ``mixed``), ``batch``, ``q``, ``c``, ``sms``, ``k`` (look-ahead steps, > 1 for
decode on a split of the SMs), ``chunk`` and ``chunk_cached`` (a mixed row's prefill chunk beside
its ``batch`` decodes, and the chunk's cached tokens; 0 otherwise), ``graphs`` (replayed from CUDA graphs), ``kernels`` (launched per
iteration), ``split`` (``fit`` or ``holdout``: which half of the overhead fit it belongs to),
``measured_s`` and the predictions in seconds: ``roofline_s`` (the measured curves, no
overheads: before the fit), ``predicted_s`` (the calibrated profile, overheads fitted on every
row: after the fit, in-sample), ``holdout_predicted_s`` (overheads fitted on the ``fit`` rows;
held-out rows only) and ``base_predicted_s`` (base profile; None when the base profile has
fewer SMs than the shape uses). Missing keys read as None. Statistics are kept per group:
prefill, decode on all SMs, decode on split SM levels, and mixed (decodes beside a chunk).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duetserve.calibrate.profile import Curve

GROUPS = {"prefill": "tab:orange", "decode": "tab:blue", "decode, split SMs": "tab:green", "mixed": "tab:red"}
"""Row groups of the statistics and their plot colours."""
PREDICTIONS = {"roofline_s": "roofline", "predicted_s": "fitted", "holdout_predicted_s": "held out",
               "base_predicted_s": "base"}
"""Row key of each prediction and its name in the tables."""


def group(row: Mapping) -> str:
    """The statistics group of ``row`` (a key of ``GROUPS``). Rows written before they carried
    ``spatial`` measured only split levels' decodes with ``k > 1``."""
    split = row.get("spatial", row.get("k", 1) > 1)
    return "decode, split SMs" if row["kind"] == "decode" and split else row["kind"]


@dataclass(frozen=True)
class ErrorStats:
    """Relative errors ``|predicted - measured| / measured`` of one group of iterations under one
    profile: ``count`` shapes, their ``median`` and 90th percentile ``p90`` (fractions)."""

    count: int
    median: float
    p90: float


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> np.ndarray:
    """``|predicted - measured| / measured`` element-wise (fractions).

    Raises ValueError for different lengths or a measured time that is not positive.
    """
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    if p.shape != m.shape:
        raise ValueError(f"{p.size} predictions for {m.size} measurements")
    if np.any(m <= 0):
        raise ValueError("measured times must be positive")
    return np.abs(p - m) / m


def error_stats(rows: Sequence[Mapping], key: str, split: str | None = None) -> dict[str, ErrorStats]:
    """Per group (``GROUPS``), the error of prediction ``key`` (a key of ``PREDICTIONS``)
    over the rows that have it, only those of ``split`` (``fit``, ``holdout``) unless None;
    p90 interpolates linearly between order statistics (numpy's default). Groups without rows
    are left out."""
    stats = {}
    for name in GROUPS:
        sel = [r for r in rows if group(r) == name and r.get(key) is not None
               and (split is None or r.get("split") == split)]
        if sel:
            err = relative_errors([r[key] for r in sel], [r["measured_s"] for r in sel])
            stats[name] = ErrorStats(len(sel), float(np.median(err)), float(np.percentile(err, 90)))
    return stats


ERROR_COLUMNS = (("roofline_s", None, "roofline"), ("predicted_s", None, "fitted, in-sample"),
                 ("roofline_s", "holdout", "held out: roofline"), ("holdout_predicted_s", "holdout", "fit half"),
                 ("base_predicted_s", None, "base"))
"""Columns of ``format_errors``: (prediction key, rows of split or None for all, header)."""


def format_errors(rows: Sequence[Mapping]) -> str:
    """Table: per group, the count of shapes and the median / p90 relative error before the
    overhead fit (roofline) and after it (in-sample), on the held-out shapes before and after
    (overheads fitted on the other shapes only), and of the base profile; '-' where no row has
    the prediction."""
    stats = [error_stats(rows, key, split) for key, split, _ in ERROR_COLUMNS]
    lines = [f"{'iterations':<18} {'shapes':>6}" + "".join(f" {head:>19}" for _, _, head in ERROR_COLUMNS)]
    for name in GROUPS:
        count = sum(group(r) == name for r in rows)
        if not count:
            continue
        cells = [f"{100 * s[name].median:5.1f}% /{100 * s[name].p90:5.1f}% ({s[name].count:>2})" if name in s
                 else f"{'-':>19}" for s in stats]
        lines.append(f"{name:<18} {count:>6}" + "".join(f" {c:>19}" for c in cells))
    lines.append("cells: median / p90 relative error (shapes)")
    return "\n".join(lines)


def format_rows(rows: Sequence[Mapping]) -> str:
    """Table: one line per measured shape (a mixed one's chunk as tokens / cached), whether it ran
    from graphs, its kernels and split, times in ms, errors in %."""
    lines = [f"{'kind':<8} {'batch':>5} {'q':>5} {'c':>5} {'chunk':>10} {'SMs':>4} {'graph':>5} {'kernels':>7} {'split':>7} "
             f"{'meas ms':>9}" + "".join(f" {name + ' ms':>14} {'err':>6}" for name in PREDICTIONS.values())]
    for r in rows:
        cells = []
        for key in PREDICTIONS:
            if r.get(key) is None:
                cells.append(f"{'-':>14} {'-':>6}")
            else:
                err = relative_errors([r[key]], [r["measured_s"]])[0]
                cells.append(f"{1e3 * r[key]:14.3f} {100 * err:5.1f}%")
        chunk = f"{r['chunk']}/{r.get('chunk_cached') or 0}" if r.get("chunk") else "-"
        lines.append(f"{r['kind']:<8} {r['batch']:>5} {r['q']:>5} {r['c']:>5} {chunk:>10} {r['sms']:>4} "
                     f"{'yes' if r.get('graphs') else 'no':>5} {r.get('kernels') or '-':>7} {r.get('split') or '-':>7} "
                     f"{1e3 * r['measured_s']:9.3f} {' '.join(cells)}")
    return "\n".join(lines)


def format_curves(curves: Mapping[str, Curve], base_bandwidth: Curve, base_compute: Curve) -> str:
    """Table: measured copy and gemv GB/s and GEMM TFLOP/s by SM count, beside the base
    profile's BW(S) and Pi(S) at the same S ('-' where not measured)."""
    def cell(curve: Curve, s: int, scale: float) -> str:
        return f"{curve[s] / scale:9.0f}" if s in curve else f"{'-':>9}"

    sms = sorted(set().union(*curves.values()))
    lines = [f"{'SMs':>4} {'copy GB/s':>9} {'gemv GB/s':>9} {'base BW':>9} {'GEMM TF/s':>9} {'base Pi':>9}"]
    for s in sms:
        lines.append(f"{s:>4} {cell(curves['copy'], s, 1e9)} {cell(curves['gemv'], s, 1e9)} "
                     f"{cell(base_bandwidth, s, 1e9)} {cell(curves['gemm'], s, 1e12)} {cell(base_compute, s, 1e12)}")
    return "\n".join(lines)


PLOTTED = {"predicted_s": "fitted", "roofline_s": "roofline"}
"""Predictions ``plot_predictions`` draws: the first filled, the second hollow."""


def plot_predictions(rows: Sequence[Mapping], path: Path, title: str) -> None:
    """Predicted against measured seconds, log-log, with the line y = x: filled markers for the
    calibrated profile with its fitted overheads, hollow ones for the roofline alone, one
    colour per group. PNG via Agg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, colour in GROUPS.items():
        sel = [r for r in rows if group(r) == name]
        for key, label in PLOTTED.items():
            pts = [(r["measured_s"], r[key]) for r in sel if r.get(key) is not None]
            if pts:
                x, y = zip(*pts)
                face = colour if key == "predicted_s" else "none"
                ax.scatter(x, y, facecolors=face, edgecolors=colour, label=f"{name}, {label}")
    values = [v for r in rows for v in (r["measured_s"], *(r.get(k) for k in PLOTTED)) if v]
    if values:
        lo, hi = min(values) / 1.5, max(values) * 1.5
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1, label="y = x")
    ax.set(xscale="log", yscale="log", xlabel="measured iteration latency (s)",
           ylabel="predicted iteration latency (s)", title=title)
    ax.legend(fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
