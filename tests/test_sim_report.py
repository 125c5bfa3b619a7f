"""Capacity at equal TBT SLO attainment, from hand-made rows."""
from __future__ import annotations

from duetserve.sim.report import (
    capacity_misses,
    format_capacity,
    format_table,
    slo_capacity,
)


def row(policy: str, qps: float, thr: float, p99: float) -> dict:
    return {"policy": policy, "qps": qps, "completed": 100, "failed": 0, "request_throughput": thr, "output_throughput": 10 * thr,
            "mean_ttft_ms": 50.0, "p50_ttft_ms": 40.0, "p99_ttft_ms": 90.0, "mean_tbt_ms": 10.0, "p50_tbt_ms": 8.0,
            "p99_tbt_ms": p99, "tbt_slo_ms": 100.0, "tbt_slo_attainment": 0.99, "spatial_fraction": 0.0}


ROWS = [
    row("chunked", 4, 4.0, 60), row("chunked", 8, 7.9, 95), row("chunked", 12, 11.8, 140),
    row("duet", 4, 4.0, 50), row("duet", 8, 7.9, 70), row("duet", 12, 11.8, 90),
    row("duet", 16, 13.0, 92),  # within the SLO but no longer keeping up (13 < 0.9 * 16)
    row("prefill-first", 4, 4.0, 300),
]


def test_capacity_needs_the_slo_and_keeping_up():
    best = slo_capacity(ROWS)
    assert best["chunked"]["qps"] == 8 and best["duet"]["qps"] == 12 and best["prefill-first"] is None


def test_capacity_lines_give_the_ratio_to_chunked():
    lines = format_capacity(ROWS).splitlines()
    assert lines[0].startswith("chunked: p99 TBT within 100 ms and keeping up until qps 8")
    assert lines[1].endswith("11.80 req/s, 1.49x chunked")
    assert lines[2:] == ["prefill-first: no swept QPS keeps p99 TBT within the SLO while keeping up:",
                         "  qps 4: p99 TBT 300.0 ms above the 100 ms SLO"]


def test_capacity_misses_say_which_condition_failed():
    """Said only "no swept QPS keeps p99 TBT within the SLO while keeping up", also when p99 TBT
    was far within the SLO and the finished rate alone fell short."""
    assert capacity_misses(row("duet", 12, 11.8, 90)) == []
    assert capacity_misses(row("duet", 16, 13.0, 92)) == [
        "did not keep up: requests finished at 13.00/s while they arrived at 16.00/s (under 90%)"]
    assert capacity_misses(row("duet", 16, 13.0, 120.3)) == [
        "p99 TBT 120.3 ms above the 100 ms SLO",
        "did not keep up: requests finished at 13.00/s while they arrived at 16.00/s (under 90%)"]
    rows = [row("duet", 4, 3.3, 33.5), row("duet", 2, 1.77, 6.7)]
    assert format_capacity(rows).splitlines() == [
        "duet: no swept QPS keeps p99 TBT within the SLO while keeping up:",
        "  qps 2: did not keep up: requests finished at 1.77/s while they arrived at 2.00/s (under 90%)",
        "  qps 4: did not keep up: requests finished at 3.30/s while they arrived at 4.00/s (under 90%)"]


def test_keeping_up_compares_the_completion_rate_with_the_arrival_rate():
    """A short light run (20 requests at QPS 2) finished 1.77 requests a second over the whole
    run, the last one's drain included, and was reported as not keeping up; between their first
    and last events, requests finished as fast as they arrived."""
    light = {**row("duet", 2, 1.77, 6.7), "arrival_rate": 2.05, "completion_rate": 2.01}
    assert capacity_misses(light) == []
    behind = {**row("duet", 16, 14.0, 80), "arrival_rate": 16.3, "completion_rate": 13.9}
    assert capacity_misses(behind) == [
        "did not keep up: requests finished at 13.90/s while they arrived at 16.30/s (under 90%)"]


def test_table_has_a_row_per_result():
    lines = format_table(ROWS).splitlines()
    assert len(lines) == 2 + len(ROWS) and lines[0].split()[:4] == ["policy", "qps", "done", "failed"]
    assert lines[2].split()[:5] == ["chunked", "4", "100", "0", "4.00"]


def test_requests_that_could_not_run_are_counted_and_named_as_a_miss():
    refused = {**row("duet", 4, 0.95, 50), "completed": 2, "failed": 18}
    assert format_table([refused]).splitlines()[2].split()[:5] == ["duet", "4", "2", "18", "0.95"]
    assert capacity_misses(refused) == [
        "18 of 20 requests could not run (longer than --max-model-len, or more KV blocks than the cache has)",
        "did not keep up: requests finished at 0.95/s while they arrived at 4.00/s (under 90%)"]
