"""Serving host-time fit (duetserve.calibrate.host) and `duetserve calibrate --iteration-log`."""
from __future__ import annotations

import dataclasses
import gzip
import json
import os

import numpy as np
import pytest

from duetserve.calibrate.host import (
    fit_gap,
    fit_host_overheads,
    gap_summary,
    read_iteration_log,
    repredict,
    temporal_rows,
)
from duetserve.planner.cost_model import CostModel, ModelShape
from duetserve.cli import main
from duetserve.planner.hardware import load_profile

H200 = load_profile("h200")
QWEN = ModelShape.preset("qwen3-8b")


def log_records(h_r: float, h_e: float, h_r0: float = 0.0, h_e0: float = 0.0, noise: float = 0.0,
                h_pw: float | None = None, h_pw0: float = 0.0):
    """Iterations whose measured time is a GPU time plus ``R h_r + e h_e`` (``+ w h_pw`` with
    ``h_pw``: then a third of them are 256-token prefills beside their decodes, at most 1024
    tokens in all, replayed from piecewise graphs by a server logging ``piecewise_tokens`` 1024),
    logged with predictions made with ``h_r0``, ``h_e0``, ``h_pw0``; plus rows the fit must skip."""
    rng = np.random.default_rng(0)
    recs = []
    for i in range(200):
        decodes, prefills = int(rng.integers(1, 64)), int(i % 3 == 0)
        piecewise = int(h_pw is not None and i % 3 == 1)
        gpu = 0.01 + 0.001 * decodes + 0.03 * prefills + 0.005 * piecewise
        requests = decodes + prefills + piecewise
        rec = {"spatial": False, "k": 1, "num_decodes": decodes, "num_prefills": prefills + piecewise,
               "num_prefill_tokens": 2048 * prefills + 256 * piecewise,
               "predicted_s": gpu + requests * h_r0 + prefills * h_e0 + piecewise * h_pw0,
               "measured_s": gpu + requests * h_r + prefills * h_e + piecewise * (h_pw or 0.0) + noise * rng.normal()}
        recs.append(rec if h_pw is None else {**rec, "piecewise_tokens": 1024})
    recs += [{"spatial": True, "k": 8, "num_decodes": 9, "num_prefill_tokens": 8000, "predicted_s": 0.2,
              "measured_s": 9.0},  # spatial: left out
             {"spatial": False, "k": 4, "num_decodes": 9, "num_prefill_tokens": 0, "predicted_s": 0.04,
              "measured_s": 9.0},  # multi-step decode: left out
             {"spatial": False, "k": 1, "num_decodes": 9, "num_prefill_tokens": 0, "predicted_s": None,
              "measured_s": 0.01}]  # no prediction (chunked): left out
    return recs


def test_fit_recovers_the_host_terms():
    fit = fit_host_overheads(log_records(3e-4, 0.012), dataclasses.replace(H200, host_per_request_s=0.0,
                                                                            host_eager_s=0.0))
    assert fit.rows == 200
    assert fit.host_per_request_s == pytest.approx(3e-4) and fit.host_eager_s == pytest.approx(0.012)
    assert fit.host_piecewise_s is None  # no piecewise iterations logged: not fitted
    assert fit.median_error_before > 0.1 and fit.median_error_after == pytest.approx(0.0, abs=1e-9)


def test_fit_recovers_the_piecewise_term_beside_the_others():
    """Piecewise iterations (256 prefill tokens + decodes <= 1024) get ``h_pw`` 2.5 ms, eager ones
    (2048 tokens) ``h_e`` 12 ms, predicted with 0.2 / 9.6 / 9.6 ms (the profile's piecewise term
    was ``host_eager_s``): all three come back."""
    base = dataclasses.replace(H200, host_per_request_s=2e-4, host_eager_s=0.0096, host_piecewise_s=None)
    recs = log_records(3e-4, 0.012, 2e-4, 0.0096, h_pw=0.0025, h_pw0=0.0096)
    rows = temporal_rows(recs, base)
    assert rows[:, 2].sum() == 67 and rows[:, 1].sum() == 67 and not (rows[:, 1] * rows[:, 2]).any()
    assert rows[1, 5:].tolist() == [2e-4, 0.0096, 0.0096]  # no logged terms: the profile's (piecewise: h_e)
    fit = fit_host_overheads(recs, base)
    assert fit.host_per_request_s == pytest.approx(3e-4) and fit.host_eager_s == pytest.approx(0.012)
    assert fit.host_piecewise_s == pytest.approx(0.0025)
    assert fit.median_error_after == pytest.approx(0.0, abs=1e-9)
    # the same iterations logged by a server without piecewise graphs (piecewise_tokens 0) are eager
    assert temporal_rows([{**r, "piecewise_tokens": 0} for r in recs[:3]], base)[:, 1:3].tolist() == \
        [[1.0, 0.0], [1.0, 0.0], [0.0, 0.0]]


def test_fit_adds_to_the_terms_the_log_was_predicted_with():
    base = dataclasses.replace(H200, host_per_request_s=1e-4, host_eager_s=0.004)
    fit = fit_host_overheads(log_records(3e-4, 0.012, 1e-4, 0.004, noise=2e-4), base)
    assert fit.host_per_request_s == pytest.approx(3e-4, rel=0.05) and fit.host_eager_s == pytest.approx(0.012, rel=0.05)


def test_a_negative_term_is_clamped_and_the_other_refitted():
    # eager iterations ran 5 ms under their GPU estimate: the eager term would go negative
    fit = fit_host_overheads(log_records(3e-4, -0.005), dataclasses.replace(H200, host_per_request_s=0.0,
                                                                            host_eager_s=0.0))
    assert fit.host_eager_s == 0.0 and 0.0 < fit.host_per_request_s < 3e-4  # refitted alone, pulled down
    # with three terms only the negative one is clamped: the other two are refitted together
    fit = fit_host_overheads(log_records(3e-4, 0.012, h_pw=-0.004), dataclasses.replace(
        H200, host_per_request_s=0.0, host_eager_s=0.0, host_piecewise_s=0.0,
        provenance={**H200.provenance, "host_piecewise_s": "measured"}))
    assert fit.host_piecewise_s == 0.0 and fit.host_eager_s > 0.01 and 0.0 < fit.host_per_request_s < 3e-4


def test_rows_of_an_older_log_count_one_prefill_chunk():
    rows = temporal_rows([{"num_decodes": 5, "num_prefill_tokens": 300, "predicted_s": 0.1, "measured_s": 0.12},
                          {"num_decodes": 5, "num_prefill_tokens": 0, "predicted_s": 0.1, "measured_s": 0.12},
                          {"num_decodes": 5, "num_prefill_tokens": 900, "prefill_layers": 4, "predicted_s": 0.1,
                           "measured_s": 0.12}], H200)  # a pdmux round: left out
    assert rows[:, 0].tolist() == [6, 5] and rows[:, 1].tolist() == [1.0, 0.0] and not rows[:, 2].any()
    assert rows[0, 5:].tolist() == [H200.host_per_request_s, H200.host_eager_s, H200.piecewise_host_s]
    eager = temporal_rows([{"num_decodes": 5, "num_prefill_tokens": 0, "predicted_s": 0.1, "measured_s": 0.12,
                            "cuda_graphs": False}], H200)
    assert eager[0, 1] == 1.0  # decode-only on a server without CUDA graphs runs eagerly
    nulls = temporal_rows([{"num_decodes": 5, "num_prefill_tokens": None, "num_prefills": None, "predicted_s": 0.1,
                            "measured_s": 0.12}], H200)  # null counts were a TypeError: they count as none
    assert nulls[:, :3].tolist() == [[5, 0.0, 0.0]]


def test_the_terms_logged_with_each_record_are_the_baseline():
    """A log whose records carry the host terms they were predicted with fits the same whatever
    ``--base`` says (refitting an old log against a newer profile must not add the terms twice)."""
    recs = log_records(3e-4, 0.012, 1e-4, 0.004)
    for r in recs:
        r.update(host_per_request_s=1e-4, host_eager_s=0.004)
    for base in (H200, dataclasses.replace(H200, host_per_request_s=0.0, host_eager_s=0.0)):
        fit = fit_host_overheads(recs, base)
        assert fit.host_per_request_s == pytest.approx(3e-4) and fit.host_eager_s == pytest.approx(0.012)


def test_logs_that_cannot_be_fitted_raise():
    decode_only = [r for r in log_records(3e-4, 0.01) if r["num_prefill_tokens"] == 0]
    with pytest.raises(ValueError, match="need eager or piecewise ones"):
        fit_host_overheads(decode_only, H200)
    with pytest.raises(ValueError, match="0 temporal iterations"):
        fit_host_overheads([], H200)
    prefills = [{**r, "host_per_request_s": 1e-4 * (i % 2)} for i, r in enumerate(log_records(3e-4, 0.012))
                if r["num_prefill_tokens"]]
    with pytest.raises(ValueError, match="host_per_request_s differ: none to keep"):
        fit_host_overheads(prefills, H200)


def test_without_decode_only_iterations_the_per_request_term_is_kept():
    """A multi-step server's log: every single-step iteration has prefill. Logged with h_r0 = 3e-4
    (the truth) and h_e0 = 4 ms, the eager term comes back, h_r stays."""
    base = dataclasses.replace(H200, host_per_request_s=3e-4, host_eager_s=0.004)
    prefills = [r for r in log_records(3e-4, 0.012, 3e-4, 0.004) if r["num_prefill_tokens"]]
    fit = fit_host_overheads(prefills, base)
    assert (fit.per_request_fitted, fit.host_per_request_s) == (False, 3e-4)
    assert fit.host_eager_s == pytest.approx(0.012) and fit.median_error_after == pytest.approx(0.0, abs=1e-9)
    assert fit_host_overheads(log_records(3e-4, 0.012), base).per_request_fitted


def served_log(truth):
    """Iterations timed by ``truth`` (a profile; its host terms included), logged by a server that
    planned with the shipped H200 profile at gemm_efficiency 1 and no host terms (other predictions):
    decode-only steps, 2048-token prompts beside decodes (eager), 512-token ones (piecewise, the
    server records up to 1024 tokens), a spatial round, a multi-step decode, one without requests."""
    rng = np.random.default_rng(1)
    other = CostModel(QWEN, dataclasses.replace(H200, gemm_efficiency=1.0, host_per_request_s=0.0, host_eager_s=0.0,
                                                host_piecewise_s=0.0,
                                                provenance={**H200.provenance, "host_piecewise_s": "measured"}),
                      piecewise_tokens=1024)
    served = CostModel(QWEN, truth, piecewise_tokens=1024)
    recs = []
    for i in range(90):
        reqs = [[1, int(c)] for c in rng.integers(100, 4000, int(rng.integers(1, 64)))]
        reqs += [[[2048, 0]], [[512, 0]], []][i % 3]
        recs.append({"spatial": False, "k": 1, "num_decodes": len(reqs) - (i % 3 < 2),
                     "num_prefills": int(i % 3 < 2), "num_prefill_tokens": [2048, 512, 0][i % 3],
                     "piecewise_tokens": 1024, "cuda_graphs": True, "requests": reqs,
                     "predicted_s": float(other.predict_total([tuple(r) for r in reqs], 132)),
                     "measured_s": float(served.predict_total([tuple(r) for r in reqs], 132)),
                     "host_per_request_s": 0.0, "host_eager_s": 0.0, "host_piecewise_s": 0.0})
    recs += [{"spatial": True, "k": 8, "requests": [[1, 100]], "predicted_s": 0.2, "measured_s": 0.3},
             {"spatial": False, "k": 1, "num_decodes": 3, "num_prefill_tokens": 0, "predicted_s": 0.01,
              "measured_s": 0.5}]  # no requests logged: left out once re-predicted
    return recs


def test_repredict_prices_the_logged_requests_with_the_new_profile():
    truth = dataclasses.replace(H200, gemm_efficiency=0.8, host_per_request_s=3e-4, host_eager_s=0.012,
                                host_piecewise_s=0.002, provenance={**H200.provenance, "gemm_efficiency": "measured",
                                                                    "host_piecewise_s": "measured"})
    recs = served_log(truth)
    new = repredict(recs, QWEN, truth)
    assert new[0]["predicted_s"] == new[0]["measured_s"] and new[-2] == recs[-2]  # spatial: as it was
    assert new[-1]["predicted_s"] is None and recs[-1]["predicted_s"] == 0.01  # the input is not changed
    assert (new[0]["host_eager_s"], new[0]["host_piecewise_s"]) == (0.012, 0.002)
    # the log as planned (other GPU terms) misfits; re-predicted with truth's GPU terms and host terms
    # of 0, the fit finds truth's host terms
    blank = dataclasses.replace(truth, host_per_request_s=0.0, host_eager_s=0.0, host_piecewise_s=0.0)
    fit = fit_host_overheads(repredict(recs, QWEN, blank), blank)
    assert fit.rows == 90 and fit.per_request_fitted
    assert (fit.host_per_request_s, fit.host_eager_s, fit.host_piecewise_s) == (
        pytest.approx(3e-4), pytest.approx(0.012), pytest.approx(0.002))
    # fitted to the logged predictions instead, the eager term swallows the GEMMs' shortfall
    assert fit_host_overheads(recs, blank).host_eager_s > 0.018


@pytest.mark.parametrize("requests", [[[1, 10**30]], [5], [["1", "5"]], [[True, False]], [[1]], [[0, 5]], [[1, -3]],
                                      [[[1, 2], [3, 4]]], 7, [[1.5, 2]]])
def test_repredict_refuses_requests_that_are_not_pairs(requests):
    recs = served_log(H200)
    recs[4]["requests"] = requests
    with pytest.raises(ValueError, match=r"^record 5: requests must be \[q, c\] integer pairs"):
        repredict(recs, QWEN, H200)


def test_calibrate_repredict_flag(tmp_path, capsys):
    truth = dataclasses.replace(H200, gemm_efficiency=0.8, provenance={**H200.provenance, "gemm_efficiency": "measured"})
    log = tmp_path / "it.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in served_log(truth)))
    (tmp_path / "base.json").write_text(json.dumps(dataclasses.asdict(truth)))
    args = ["calibrate", "--gpu-name", "lab", "--out", str(tmp_path / "p.json"), "--base", str(tmp_path / "base.json")]
    assert main([*args, "--iteration-log", str(log), "--repredict"]) == 0
    assert "median |pred - meas| / meas" in capsys.readouterr().out
    fitted = load_profile(tmp_path / "p.json")
    assert (fitted.host_per_request_s, fitted.host_eager_s) == (pytest.approx(H200.host_per_request_s),
                                                                pytest.approx(H200.host_eager_s))
    assert main([*args, "--repredict"]) == 2
    assert capsys.readouterr().err == "duetserve calibrate: error: --repredict goes with --iteration-log\n"
    # a bad record names its log and record
    recs = served_log(truth)
    recs[1]["requests"] = [[1, "x"]]
    (tmp_path / "bad.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    assert main([*args, "--iteration-log", str(log), str(tmp_path / "bad.jsonl"), "--repredict"]) == 1
    assert capsys.readouterr().err.startswith(f"duetserve calibrate: error: --iteration-log {tmp_path / 'bad.jsonl'}: "
                                              "record 2: requests must be")


def test_gap_summary_of_the_host_time_between_iterations():
    """Median, p90 and share of ``gap_s`` over the iterations that carry one (hand-computed):
    gaps 1, 2, 3, 4, 10 ms beside 50 ms iterations: median 3 ms, p90 7.6 ms (numpy's linear
    quantile: 4 + 0.6 x 6), 20 ms over 250 ms = 8%. Records without one are left out; a log
    with none gives None."""
    records = [{"gap_s": g / 1e3, "measured_s": 0.05} for g in (1, 2, 3, 4, 10)]
    records += [{"gap_s": None, "measured_s": 0.05}, {"measured_s": 0.05}]
    gaps = gap_summary(records)
    assert gaps.count == 5 and gaps.median_s == pytest.approx(0.003) and gaps.p90_s == pytest.approx(0.0076)
    assert gaps.share == pytest.approx(0.08)
    assert gap_summary([{"measured_s": 0.05}]) is None


def test_gap_fit_follows_the_requests_of_the_iteration_before():
    """``fit_gap``: gaps of exactly 1 ms + 10 us per request of the record before are recovered;
    a record without a gap, the first of a log and the first of another server (``policy``) are
    left out; a gap that shrinks with the requests fits no per-request term (its median then);
    fewer than 2 gaps fit nothing."""
    rng = np.random.default_rng(1)
    counts = rng.integers(1, 200, 300)
    records, before = [], None
    for i, n in enumerate(counts):
        policy = "duet" if i < 150 else "chunked"
        gap = None if before is None else 0.001 + 1e-5 * before
        if i == 150:
            gap = 9.0  # the other server's first record: left out
        records.append({"policy": policy, "requests": [[1, 100]] * int(n), "gap_s": gap, "measured_s": 0.02})
        before = n
    records.insert(40, {"policy": "duet", "requests": [[1, 100]] * 7, "measured_s": 0.02})  # no gap_s
    records[41]["gap_s"] = 0.001 + 1e-5 * 7
    assert fit_gap(records) == (pytest.approx(0.001, rel=1e-6), pytest.approx(1e-5, rel=1e-6))
    shrinking = [{"policy": "p", "requests": [[1, 1]] * n, "gap_s": 0.01 - 1e-5 * n, "measured_s": 0.02}
                 for n in (10, 50, 100, 150, 200)]  # each gap read against the requests of the one before
    assert fit_gap(shrinking) == (pytest.approx(np.median([0.0095, 0.009, 0.0085, 0.008])), 0.0)
    assert fit_gap(records[:2]) is None


def test_calibrate_iteration_log_writes_the_profile(tmp_path, capsys):
    log = tmp_path / "it.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in log_records(3e-4, 0.012, H200.host_per_request_s,
                                                                 H200.host_eager_s)) + "\n\n")
    out = tmp_path / "p.json"
    # the GPU measurement's flags are refused with it (--plot wrote nothing, silently)
    assert main(["calibrate", "--gpu-name", "lab", "--out", str(out), "--iteration-log", str(log), "--quick",
                 "--plot", str(tmp_path / "c.png")]) == 2
    assert capsys.readouterr().err == ("duetserve calibrate: error: --plot, --quick do not go with "
                                       "--iteration-log\n") and not out.exists()
    assert main(["calibrate", "--gpu-name", "lab", "--out", str(out), "--iteration-log", str(log)]) == 0
    printed = capsys.readouterr().out
    assert ("host_per_request_s 0.300 ms, host_eager_s 12.00 ms, host_piecewise_s not fitted (no such "
            "iterations)") in printed and "between iterations" not in printed  # no gap_s logged
    p = load_profile(out)
    assert p.name == "lab" and p.host_per_request_s == pytest.approx(3e-4) and p.host_eager_s == pytest.approx(0.012)
    assert p.compute_points == H200.compute_points and p.provenance["host_eager_s"] == "measured"
    assert p.host_piecewise_s == H200.host_piecewise_s  # no piecewise iterations logged: --base's term kept
    gapped = [dict(r, gap_s=0.002) for r in log_records(3e-4, 0.012, H200.host_per_request_s, H200.host_eager_s)]
    log.write_text("\n".join(json.dumps(r) for r in gapped) + "\n")
    assert main(["calibrate", "--gpu-name", "lab", "--out", str(out), "--iteration-log", str(log)]) == 0
    share = 100 * 0.002 * len(gapped) / sum(r["measured_s"] for r in gapped)
    printed = capsys.readouterr().out
    assert (f"host time between iterations (gap_s) on {len(gapped)} iterations: median 2.00 ms, "
            f"p90 2.00 ms, {share:.1f}% of their own time") in printed
    assert ("fitted (duet's budget and the simulator; not in iteration predictions): host_gap_s 2.000 ms + "
            "host_gap_per_request_s 0.00 us a request of the iteration before") in printed
    p = load_profile(out)
    assert (p.host_gap_s, p.host_gap_per_request_s) == (pytest.approx(0.002), pytest.approx(0.0, abs=1e-12))
    assert p.provenance["host_gap_s"] == p.provenance["host_gap_per_request_s"] == "measured"
    log.write_text("\n".join(json.dumps(r) for r in log_records(3e-4, 0.012, H200.host_per_request_s,
                                                                 H200.host_eager_s, h_pw=0.0025,
                                                                 h_pw0=H200.piecewise_host_s)) + "\n")
    assert main(["calibrate", "--gpu-name", "lab", "--out", str(out), "--iteration-log", str(log)]) == 0
    assert "host_eager_s 12.00 ms, host_piecewise_s 2.50 ms" in capsys.readouterr().out
    p = load_profile(out)
    assert p.host_piecewise_s == pytest.approx(0.0025) and p.provenance["host_piecewise_s"] == "measured"
    assert p.piecewise_host_s == pytest.approx(0.0025) and p.host_eager_s == pytest.approx(0.012)
    log.write_text('{"spatial": false}\nnot json\n')
    assert main(["calibrate", "--gpu-name", "lab", "--out", str(out), "--iteration-log", str(log)]) == 1
    assert capsys.readouterr().err == (f"duetserve calibrate: error: --iteration-log: {log}: line 2: not JSON "
                                       "(Expecting value at line 1 column 1)\n")
    with pytest.raises(ValueError, match="line 2"):
        read_iteration_log(log)
    log.write_bytes(b'{"k": 1}\n\xff\xfe\n')  # not UTF-8: named, no traceback
    assert main(["calibrate", "--gpu-name", "lab", "--out", str(out), "--iteration-log", str(log)]) == 1
    assert capsys.readouterr().err.startswith(f"duetserve calibrate: error: --iteration-log: {log}: not UTF-8 text")
    for text, message in (("[1, 2]\n", "line 1: not a JSON object but list"),
                          ('{"k": "x", "measured_s": 0.1}\n', "line 1: k must be counts >= 0 and below 2^31"),
                          # NaN broke the least-squares fit (LAPACK noise, no line), inf fitted zeros
                          ('{"measured_s": NaN}\n', "line 1: measured_s must be seconds >= 0 and below 3600"),
                          ('{"measured_s": Infinity, "gap_s": -1}\n',
                           "line 1: measured_s, gap_s must be seconds >= 0 and below 3600"),
                          ('{"num_decodes": -1, "k": 4294967296}\n',
                           "line 1: k, num_decodes must be counts >= 0 and below 2^31"),
                          # 1e300 made the L1 fit's residual floor swallow every row: all terms 0
                          ('{"measured_s": 0.05, "predicted_s": 1e300}\n',
                           "line 1: predicted_s must be seconds >= 0 and below 3600"),
                          # strings were taken by truthiness: "false" read as a spatial iteration
                          ('{"spatial": "false", "cuda_graphs": 0}\n',
                           "line 1: spatial, cuda_graphs must be true, false or null")):
        log.write_text(text)
        assert main(["calibrate", "--gpu-name", "lab", "--out", str(out), "--iteration-log", str(log)]) == 1
        assert message in capsys.readouterr().err
    log.write_text("\n".join(json.dumps(r) for r in log_records(3e-4, 0.012)) + "\n")
    with pytest.raises(SystemExit) as exc:  # --out a folder: argparse names it, exit 2
        main(["calibrate", "--gpu-name", "lab", "--out", str(tmp_path), "--iteration-log", str(log)])
    assert exc.value.code == 2 and "is a folder" in capsys.readouterr().err
    if os.path.isdir("/proc"):  # a folder where no file can be made, even by root: refused before the work
        with pytest.raises(SystemExit) as exc:
            main(["calibrate", "--gpu-name", "lab", "--out", "/proc/duetserve.json", "--iteration-log", str(log)])
        assert exc.value.code == 2 and capsys.readouterr().err.endswith(
            "duetserve calibrate: error: argument --out: /proc/duetserve.json: No such file or directory\n")


def test_one_stray_slow_iteration_does_not_move_the_fit():
    """L1: a 1.4 s iteration (a kernel compile) among hundreds leaves the terms in place."""
    recs = log_records(3e-4, 0.012, 0.0, 0.0)
    recs[0] = {**recs[0], "measured_s": 1.4}
    fit = fit_host_overheads(recs, dataclasses.replace(H200, host_per_request_s=0.0, host_eager_s=0.0))
    assert fit.host_per_request_s == pytest.approx(3e-4, rel=1e-3) and fit.host_eager_s == pytest.approx(0.012, rel=1e-3)


def test_calibrate_pools_several_logs_gzipped_or_not(tmp_path, capsys):
    """Two halves of one log, one of them gzipped (as scripts/device_serving.sh keeps logs), fit
    the terms the whole log fits; the summary names both files."""
    lines = [json.dumps(r) for r in log_records(3e-4, 0.012, H200.host_per_request_s, H200.host_eager_s)]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"
    first.write_text("\n".join(lines[:100]) + "\n")
    second.write_bytes(gzip.compress(("\n".join(lines[100:]) + "\n").encode()))
    assert read_iteration_log(second) == [json.loads(line) for line in lines[100:]]
    out = tmp_path / "p.json"
    assert main(["calibrate", "--gpu-name", "lab", "--out", str(out), "--iteration-log", str(first), str(second)]) == 0
    printed = capsys.readouterr().out
    assert f"temporal iterations of {first} {second}: host_per_request_s 0.300 ms, host_eager_s 12.00 ms" in printed
    assert load_profile(out).host_eager_s == pytest.approx(0.012)
    whole = second.read_bytes()
    for bad in (b"not gzip", whole[:len(whole) // 2], whole[:12] + bytes(len(whole) - 12)):  # cut off, damaged
        second.write_bytes(bad)
        assert main(["calibrate", "--gpu-name", "lab", "--out", str(out), "--iteration-log", str(first),
                     str(second)]) == 1  # no traceback
        assert f"{second}: not a whole gzip file" in capsys.readouterr().err
