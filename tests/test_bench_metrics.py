"""Metric arithmetic of duetserve bench on hand-built token timestamps, and flag parsing."""

from __future__ import annotations

import math

import pytest

from duetserve.bench.cli import parse_goodput
from duetserve.bench.client import RequestRecord
from duetserve.bench.metrics import (
    Slos,
    compute_metrics,
    format_comparison,
    format_report,
)
from duetserve.config import parse_duration


def record(index: int, input_len: int, output_len: int, chunks: list[float],
           error: str | None = None) -> RequestRecord:
    """A request whose text chunks arrived at ``chunks`` seconds after it was sent."""
    return RequestRecord(index, input_len, output_len, arrival_s=0.0, chunk_times_s=chunks,
                         output_tokens=0 if error else output_len, error=error)


# Times are multiples of 1/8 s so every difference is exact in binary floating point.
RECORDS = [
    record(0, 10, 4, [0.125, 0.25, 0.5, 0.625]),  # TTFT 125, ITL 125/250/125, E2EL 625, TPOT 500/3
    record(1, 20, 3, [0.375, 0.5, 1.0]),  # TTFT 375, ITL 125/500, E2EL 1000, TPOT 312.5
    record(2, 5, 1, [0.25]),  # TTFT = E2EL = 250, no TPOT
    record(3, 7, 4, [], error="StreamError: HTTP 500: boom"),
]


def test_counts_and_throughput() -> None:
    m = compute_metrics(RECORDS, duration_s=2.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["duration"] == 2.0
    assert m["total_input_tokens"] == 35 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == 1.5
    assert m["output_throughput"] == 4.0
    assert m["total_token_throughput"] == 21.5
    assert m["request_goodput"] is None and m["tbt_slo_attainment"] is None
    assert m["failure_reasons"] == {"StreamError: HTTP 500: boom": 1}


def test_latency_statistics() -> None:
    m = compute_metrics(RECORDS, duration_s=2.0)
    # TTFT [125, 375, 250] ms; numpy linear percentiles on the sorted values.
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["median_ttft_ms"] == pytest.approx(250.0)
    assert m["std_ttft_ms"] == pytest.approx(125.0 * math.sqrt(2 / 3))
    assert m["p90_ttft_ms"] == pytest.approx(250.0 + 0.8 * 125.0)
    assert m["p99_ttft_ms"] == pytest.approx(250.0 + 0.98 * 125.0)
    # ITL [125, 250, 125, 125, 500] ms.
    assert m["mean_itl_ms"] == pytest.approx(225.0)
    assert m["median_itl_ms"] == pytest.approx(125.0)
    assert m["std_itl_ms"] == pytest.approx(math.sqrt(21250.0))
    assert m["p90_itl_ms"] == pytest.approx(250.0 + 0.6 * 250.0)
    assert m["p99_itl_ms"] == pytest.approx(250.0 + 0.96 * 250.0)
    # TPOT [(625-125)/3, (1000-375)/2] ms; the one-token request has none.
    tpots = [500.0 / 3, 312.5]
    assert m["mean_tpot_ms"] == pytest.approx(sum(tpots) / 2)
    assert m["median_tpot_ms"] == pytest.approx(sum(tpots) / 2)
    assert m["p90_tpot_ms"] == pytest.approx(tpots[0] + 0.9 * (tpots[1] - tpots[0]))
    # E2EL [625, 1000, 250] ms.
    assert m["mean_e2el_ms"] == pytest.approx(625.0)
    assert m["median_e2el_ms"] == pytest.approx(625.0)
    assert m["p90_e2el_ms"] == pytest.approx(625.0 + 0.8 * 375.0)


def test_custom_percentiles_keys() -> None:
    m = compute_metrics(RECORDS, 2.0, percentiles=(50, 99.9))
    assert m["p50_ttft_ms"] == pytest.approx(250.0)
    assert "p99.9_e2el_ms" in m and "p90_ttft_ms" not in m


def test_goodput() -> None:
    # Request 0 meets TTFT 300 / TPOT 200; request 1 misses TTFT; request 2's TPOT counts as 0.
    m = compute_metrics(RECORDS, 2.0, Slos(ttft_s=0.3, tpot_s=0.2))
    assert m["request_goodput"] == 1.0
    # The SLO bound is inclusive: E2EL 625 meets 625 ms.
    assert compute_metrics(RECORDS, 2.0, Slos(e2el_s=0.625))["request_goodput"] == 1.0
    assert compute_metrics(RECORDS, 2.0, Slos(e2el_s=0.2))["request_goodput"] == 0.0


def test_tbt_slo_attainment() -> None:
    assert compute_metrics(RECORDS, 2.0, Slos(tbt_s=0.125))["tbt_slo_attainment"] == 0.6
    m = compute_metrics(RECORDS, 2.0, Slos(tbt_s=0.25))
    assert m["tbt_slo_attainment"] == 0.8 and m["tbt_slo_ms"] == 250.0


def test_all_failed_still_reports() -> None:
    m = compute_metrics([RECORDS[3]], duration_s=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0
    assert "failed" in format_report(m)
    with pytest.raises(ValueError):
        compute_metrics(RECORDS, duration_s=0.0)


def test_report_and_comparison_text() -> None:
    a = compute_metrics(RECORDS, 2.0, Slos(tbt_s=0.25))
    b = compute_metrics(RECORDS, 1.0, Slos(tbt_s=0.25))
    report = format_report(a)
    assert "p99_tpot_ms" in report and "Inter-token Latency" in report and "HTTP 500" in report
    rows = {line.split()[0]: line.split() for line in format_comparison(a, b, ("A", "B")).splitlines()}
    assert rows["request_throughput"][1:] == ["1.50", "3.00", "2.000"]
    assert rows["mean_ttft_ms"][-1] == "1.000"


def test_parse_duration() -> None:
    assert parse_duration("100ms") == pytest.approx(0.1)
    assert parse_duration("0.1s") == pytest.approx(0.1)
    assert parse_duration("250us") == pytest.approx(250e-6)
    assert parse_duration("2min") == 120.0
    assert parse_duration("5") == 5.0
    assert parse_duration("100", "ms") == pytest.approx(0.1)
    for bad in ("abc", "10 parsecs", ""):
        with pytest.raises(ValueError, match="expected e.g. 100ms"):
            parse_duration(bad)
    for negative in ("-1s", "-5", " -100ms"):
        with pytest.raises(ValueError, match="a duration cannot be negative"):
            parse_duration(negative, "ms")


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:200", "tpot:0.05s", "e2el:2s"]) == Slos(0.2, 0.05, 2.0)
    for bad in (["itl:5"], ["ttft"], ["ttft:1", "ttft:2"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    # accepted: request_goodput 0.00 for any server, as --tbt-slo 0 is refused
    with pytest.raises(ValueError, match=r"^--goodput ttft:0ms: must be a positive duration$"):
        parse_goodput(["ttft:0ms"])
