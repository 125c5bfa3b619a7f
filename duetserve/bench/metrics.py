"""Serving metrics from request records, with the keys and definitions of ``vllm bench serve``.

Only successful requests enter the latency statistics; failed ones are counted in ``failed``.
Per request: TTFT is send to first text chunk, E2EL send to last text chunk, ITLs the gaps
between text chunks, and TPOT ``(E2EL - TTFT) / (output_tokens - 1)`` for requests with more
than one output token. Statistics are in milliseconds; an empty list gives 0, as in vLLM.
Goodput counts requests meeting every given SLO (a one-token request's TPOT counts as 0).
``tbt_slo_attainment`` is the share of all ITL gaps at or below the TBT SLO.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from duetserve.bench.client import RequestRecord

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
_HEAD_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
)
_STAT_KEY = re.compile(r"^(mean|median|std|p[\d.]+)_(ttft|tpot|itl|e2el)_ms$")


@dataclass(frozen=True)
class Slos:
    """Service-level objectives, in seconds; ``None`` means not set.

    ``ttft_s``, ``tpot_s`` and ``e2el_s`` define goodput (vLLM's ``--goodput``); ``tbt_s`` is
    the time-between-tokens SLO that ``tbt_slo_attainment`` is measured against.
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2el_s: float | None = None
    tbt_s: float | None = None

    @property
    def has_goodput(self) -> bool:
        """True when any goodput SLO is set."""
        return any(x is not None for x in (self.ttft_s, self.tpot_s, self.e2el_s))


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000.0 if len(values_s) else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        out[f"p{_percentile_word(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def _tpot_s(r: RequestRecord) -> float:
    """Mean time per output token after the first (0 for a one-token request)."""
    if r.output_tokens <= 1:
        return 0.0
    return (r.e2el_s - r.ttft_s) / (r.output_tokens - 1)


def _is_good(r: RequestRecord, slos: Slos) -> bool:
    checks = ((slos.ttft_s, r.ttft_s), (slos.tpot_s, _tpot_s(r)), (slos.e2el_s, r.e2el_s))
    return all(slo is None or value <= slo for slo, value in checks)


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slos: Slos = Slos(),
    percentiles: Sequence[float] = (90, 99),
) -> dict[str, Any]:
    """Aggregate metrics of one run, keyed like ``vllm bench serve``'s JSON.

    Args:
        records: every request of the run, failed ones included.
        duration_s: benchmark wall time, seconds (> 0).
        slos: goodput and TBT SLOs.
        percentiles: percentiles reported for each latency metric (``p90_ttft_ms``, ...).

    Returns:
        ``completed``, ``failed``, ``duration``, token totals, throughputs (per second),
        ``request_goodput`` (``None`` without goodput SLOs), ``{mean,median,std,pP}_{ttft,tpot,
        itl,e2el}_ms``, ``tbt_slo_ms``, ``tbt_slo_attainment`` (``None`` without a TBT SLO or
        with no gaps) and ``failure_reasons`` (error message -> count).

    Raises:
        ValueError: ``duration_s <= 0``.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    ok = [r for r in records if r.success]
    itls = [gap for r in ok for gap in r.itls_s]
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    result: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (
            sum(_is_good(r, slos) for r in ok) / duration_s if slos.has_goodput else None
        ),
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    per_metric = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [_tpot_s(r) for r in ok if r.output_tokens > 1],
        "itl": itls,
        "e2el": [r.e2el_s for r in ok],
    }
    for name in LATENCY_METRICS:
        result.update(_stats(name, per_metric[name], percentiles))
    attained = slos.tbt_s is not None and bool(itls)
    result["tbt_slo_ms"] = None if slos.tbt_s is None else slos.tbt_s * 1000.0
    result["tbt_slo_attainment"] = (
        float(np.mean(np.asarray(itls) <= slos.tbt_s)) if attained else None
    )
    result["failure_reasons"] = dict(Counter(r.error for r in records if not r.success))
    return result


def metric_keys(result: dict[str, Any]) -> list[str]:
    """The scalar metric keys present in ``result``, in report order."""
    stats = [k for k in result if _STAT_KEY.match(k)]
    stats.sort(key=lambda k: LATENCY_METRICS.index(_STAT_KEY.match(k).group(2)))  # type: ignore[union-attr]
    tail = [k for k in ("tbt_slo_ms", "tbt_slo_attainment") if k in result]
    return [k for k in _HEAD_KEYS if k in result] + stats + tail


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def format_report(result: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """A ``vllm bench serve``-style text table of ``result``'s metrics."""
    lines = [f" {title} ".center(60, "=")]
    section = None
    for key in metric_keys(result):
        if result[key] is None:
            continue
        match = _STAT_KEY.match(key)
        name = match.group(2) if match else None
        if name != section and name is not None:
            lines.append(f" {_TITLES[name]} ".center(60, "-"))
        section = name
        lines.append(f"{key:<44}{_fmt(result[key]):>16}")
    reasons = result.get("failure_reasons") or {}
    if reasons:
        lines.append(" Failures (count, reason) ".center(60, "-"))
        for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1])[:10]:
            lines.append(f"{count:>6}  {reason}")
    lines.append("=" * 60)
    return "\n".join(lines)


def format_comparison(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str]) -> str:
    """Two results side by side with the ratio ``b / a`` for every metric present in both."""
    width = max(14, *(len(x) + 2 for x in labels))
    lines = [f"{'metric':<28}{labels[0]:>{width}}{labels[1]:>{width}}{'B/A':>10}"]
    for key in metric_keys(a):
        if key not in b:
            continue
        x, y = a[key], b[key]
        numeric = isinstance(x, (int, float)) and isinstance(y, (int, float))
        ratio = f"{y / x:.3f}" if numeric and x else "-"
        lines.append(f"{key:<28}{_fmt(x):>{width}}{_fmt(y):>{width}}{ratio:>10}")
    return "\n".join(lines)
