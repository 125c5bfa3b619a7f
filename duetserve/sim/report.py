"""Rows, table, capacity summary and plot of simulation results.

Latency statistics come from ``duetserve.bench.metrics.compute_metrics`` (the definitions of
``vllm bench serve``): TTFT is arrival to first token, TBT the gaps between consecutive tokens
of a request (vLLM's ITL), ``tbt_slo_attainment`` the share of those gaps at or below the SLO.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from duetserve.bench.metrics import Slos, compute_metrics
from duetserve.sim.simulator import SimResult

_COLUMNS = (  # (row key, header, format)
    ("policy", "policy", "{}"),
    ("qps", "qps", "{:g}"),
    ("completed", "done", "{}"),
    ("failed", "failed", "{}"),
    ("request_throughput", "req/s", "{:.2f}"),
    ("output_throughput", "tok/s", "{:.0f}"),
    ("mean_ttft_ms", "TTFT ms mean", "{:.0f}"),
    ("p50_ttft_ms", "p50", "{:.0f}"),
    ("p99_ttft_ms", "p99", "{:.0f}"),
    ("mean_tbt_ms", "TBT ms mean", "{:.1f}"),
    ("p50_tbt_ms", "p50", "{:.1f}"),
    ("p99_tbt_ms", "p99", "{:.1f}"),
    ("tbt_slo_attainment", "SLO att.", "{:.2%}"),
    ("spatial_fraction", "spatial", "{:.1%}"),
)


def summarize(result: SimResult, qps: float, tbt_slo_s: float) -> dict[str, Any]:
    """One table/JSON row: ``policy``, ``qps``, request and output token throughput (per
    second), TTFT and TBT mean/p50/p99 (ms), ``tbt_slo_attainment`` (share of TBT gaps
    <= ``tbt_slo_s``; None without gaps), ``spatial_fraction`` and ``slo_risk_fraction``
    (shares of iterations), counts, and the simulation's host time ``sim_wall_s``; for
    ``capacity_misses``, ``arrival_rate`` (requests a second between the first and the last
    arrival) and ``completion_rate`` (the same between the first and the last request to finish;
    None with fewer than two).

    Raises:
        ValueError: no request produced a token (nothing to measure).
    """
    if result.duration_s <= 0:
        raise ValueError("no request of the trace ran (each needs more KV cache than there is?)")
    m = compute_metrics(result.records, result.duration_s, Slos(tbt_s=tbt_slo_s), percentiles=(50, 99))
    its = result.iterations
    arrivals = sorted(r.arrival_s for r in result.records)
    ends = sorted(r.start_s + r.chunk_times_s[-1] for r in result.records if r.chunk_times_s and r.error is None)
    return {
        "policy": result.policy,
        "qps": qps,
        "completed": m["completed"],
        "failed": m["failed"],
        "duration_s": result.duration_s,
        "request_throughput": m["request_throughput"],
        "output_throughput": m["output_throughput"],
        "mean_ttft_ms": m["mean_ttft_ms"],
        "p50_ttft_ms": m["p50_ttft_ms"],
        "p99_ttft_ms": m["p99_ttft_ms"],
        "mean_tbt_ms": m["mean_itl_ms"],
        "p50_tbt_ms": m["p50_itl_ms"],
        "p99_tbt_ms": m["p99_itl_ms"],
        "tbt_slo_ms": tbt_slo_s * 1e3,
        "tbt_slo_attainment": m["tbt_slo_attainment"],
        "spatial_fraction": sum(i.spatial for i in its) / len(its),
        "slo_risk_fraction": sum(i.slo_risk for i in its) / len(its),
        "iterations": len(its),
        "preemptions": result.num_preemptions,
        "kv_cache_tokens": result.kv_cache_tokens,
        "sim_wall_s": result.wall_s,
        "arrival_rate": _rate(arrivals),
        "completion_rate": _rate(ends),
    }


def _rate(times: Sequence[float]) -> float | None:
    """Events a second between the first and the last of ``times`` (sorted); None for fewer than
    two or no time between them."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width text table of ``rows`` (one per policy and QPS); TTFT and TBT in ms."""
    cells = [[h for _, h, _ in _COLUMNS]]
    cells += [["-" if r[k] is None else f.format(r[k]) for k, _, f in _COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def capacity_misses(row: dict[str, Any], keep_up: float = 0.9) -> list[str]:
    """Why ``row`` does not count towards ``slo_capacity``, one reason per failed condition
    (empty when it counts): "p99 TBT 140.0 ms above the 100 ms SLO", "did not keep up: requests
    finished at 1.41/s while they arrived at 2.05/s (under 90%)", and "18 of 20 requests could
    not run (longer than --max-model-len, or more KV blocks than the cache has)".

    Keeping up compares the rate requests finished with the rate they arrived, each between
    its first and last event (``summarize``), so a short run is not failed for its last
    request's latency (20 requests at QPS 2 finished at 1.77 req/s over the whole run: the
    drain of the last one counted). Rows without those rates compare ``request_throughput``
    with ``qps``."""
    misses = []
    if row["failed"]:
        misses.append(f"{row['failed']} of {row['completed'] + row['failed']} requests could not run (longer than "
                      "--max-model-len, or more KV blocks than the cache has)")
    if row["p99_tbt_ms"] > row["tbt_slo_ms"]:
        misses.append(f"p99 TBT {row['p99_tbt_ms']:.1f} ms above the {row['tbt_slo_ms']:g} ms SLO")
    done, offered = row.get("completion_rate"), row.get("arrival_rate")
    if done is None or offered is None:
        done, offered = row["request_throughput"], row["qps"]
    if done < keep_up * offered:
        misses.append(f"did not keep up: requests finished at {done:.2f}/s while they arrived at {offered:.2f}/s "
                      f"(under {keep_up:.0%})")
    return misses


def slo_capacity(rows: Sequence[dict[str, Any]], keep_up: float = 0.9) -> dict[str, dict[str, Any] | None]:
    """Per policy, its row of highest request throughput among those that meet the SLO and
    keep up with the load: p99 TBT within the SLO (99% of TBT gaps attain it) and requests
    finishing at least ``keep_up`` times as fast as they arrive (past that the queue, and TTFT,
    grow with the trace's length); see ``capacity_misses``. None when no swept QPS qualifies."""
    best: dict[str, dict[str, Any] | None] = {}
    for r in rows:
        best.setdefault(r["policy"], None)
        if not capacity_misses(r, keep_up):
            current = best[r["policy"]]
            if current is None or r["request_throughput"] > current["request_throughput"]:
                best[r["policy"]] = r
    return best


def format_capacity(rows: Sequence[dict[str, Any]], baseline: str = "chunked") -> str:
    """One line per policy: its ``slo_capacity`` row (QPS, p99 TBT, request throughput) and
    that throughput relative to ``baseline``'s, i.e. at equal TBT SLO attainment. A policy with
    no such row gets, below its line, one indented line per swept QPS saying which condition failed."""
    best = slo_capacity(rows)
    base = best.get(baseline)
    lines = []
    for policy, row in best.items():
        if row is None:
            lines.append(f"{policy}: no swept QPS keeps p99 TBT within the SLO while keeping up:")
            lines += [f"  qps {r['qps']:g}: {'; '.join(capacity_misses(r))}"
                      for r in sorted(rows, key=lambda r: r["qps"]) if r["policy"] == policy]
            continue
        ratio = f", {row['request_throughput'] / base['request_throughput']:.2f}x {baseline}" \
            if base is not None and policy != baseline else ""
        lines.append(f"{policy}: p99 TBT within {row['tbt_slo_ms']:g} ms and keeping up until qps {row['qps']:g} "
                     f"(p99 TBT {row['p99_tbt_ms']:.1f} ms): {row['request_throughput']:.2f} req/s{ratio}")
    return "\n".join(lines)


def plot_rows(rows: Sequence[dict[str, Any]], out_path: str | Path) -> None:
    """Draw p99 and mean TBT, mean and p99 TTFT, and request throughput against QPS, one line
    per policy, into an image (format from the suffix).

    Raises:
        OSError: the image cannot be written.
    """
    fig = Figure(figsize=(15, 4.2), layout="constrained")
    ax_tbt, ax_ttft, ax_thr = fig.subplots(1, 3)
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["qps"])
        qps = [r["qps"] for r in mine]
        line, = ax_tbt.plot(qps, [r["p99_tbt_ms"] for r in mine], "o-", label=f"{policy} p99")
        ax_tbt.plot(qps, [r["mean_tbt_ms"] for r in mine], "x--", color=line.get_color(), alpha=0.6,
                    label=f"{policy} mean")
        ax_ttft.plot(qps, [r["mean_ttft_ms"] / 1e3 for r in mine], "o-", color=line.get_color(), label=f"{policy} mean")
        ax_ttft.plot(qps, [r["p99_ttft_ms"] / 1e3 for r in mine], "x--", color=line.get_color(), alpha=0.6,
                     label=f"{policy} p99")
        ax_thr.plot(qps, [r["request_throughput"] for r in mine], "o-", color=line.get_color(), label=policy)
    for slo in {r["tbt_slo_ms"] for r in rows}:
        ax_tbt.axhline(slo, color="red", linestyle=":", label=f"SLO {slo:g} ms")
    ax_tbt.set(title="TBT", xlabel="QPS (req/s)", ylabel="TBT (ms)", yscale="log")
    ax_ttft.set(title="TTFT", xlabel="QPS (req/s)", ylabel="TTFT (s)", yscale="log")
    ax_thr.set(title="Request throughput", xlabel="QPS (req/s)", ylabel="finished req/s")
    for ax in (ax_tbt, ax_ttft, ax_thr):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.savefig(out_path, dpi=80)
