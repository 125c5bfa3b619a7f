"""scripts/serving_bench.py (the GPU serving benchmark's driver): argument parsing (traces,
variants), lanes and their server commands, iteration summaries, the combined table and the
SLO-capacity line, a run of two lanes with fake servers; scripts/select_wheels.py's choice.

The end-to-end CPU smoke run (`SERVING_CPU=1 bash scripts/device_serving.sh`, ~40 s: two
servers, four bench runs) is not part of the suite.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shlex
import threading
import time
import zipfile
from pathlib import Path

import pytest
from conftest import load_script

sb = load_script("serving_bench")


def test_trace_run_parse():
    tr = sb.TraceRun.parse("mooncake:0.75,1.25:12:32768:1024")
    assert (tr.name, tr.qps, tr.seconds, tr.max_input_len, tr.max_output_len) == \
        ("mooncake", [0.75, 1.25], 12.0, 32768, 1024)
    assert tr.num_requests(0.75) == 9 and tr.num_requests(1.25) == 15
    tr = sb.TraceRun.parse("azure_code:10,16:10")
    assert tr.max_input_len is None and tr.max_output_len is None and tr.num_requests(16) == 160
    assert sb.TraceRun.parse("azure_code:1:10::64").max_input_len is None  # an empty cap: none
    assert sb.TraceRun.parse("azure_conv:20:40").num_requests(20) == 800
    assert sb.TRACE_FILES["azure_conv"] == ("AzureLLMInferenceTrace_conv.csv", "azure")
    for bad in ("sharegpt:1:10", "azure_code:1", "azure_code:0:10", "azure_code:x:10", "azure_code:1:10:1:2:3"):
        with pytest.raises(argparse.ArgumentTypeError):
            sb.TraceRun.parse(bad)
    for bad, why in (("azure_code:nan:1", "positive and finite"), ("azure_code:1:inf", "positive and finite"),
                     ("azure_code:1:1:0", "must be >= 1")):  # a traceback; 0 read as no cap
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            sb.TraceRun.parse(bad)


def test_variant_parse():
    v = sb.Config.variant("duet-trim=--policy duet --trim-margin 0.85")
    assert v == sb.Config("duet-trim", "duet", ("--trim-margin", "0.85"))
    v = sb.Config.variant(" chunked_2048.b = --max-num-batched-tokens 2048 --policy=chunked")
    assert v == sb.Config("chunked_2048.b", "chunked", ("--max-num-batched-tokens", "2048"))
    for bad, why in [("--policy duet", "use LABEL=SERVE_ARGS"), ("=--policy duet", "use LABEL=SERVE_ARGS"),
                     ("a b=--policy duet", "use LABEL=SERVE_ARGS"), ("a/b=--policy duet", "use LABEL=SERVE_ARGS"),
                     ("x=--trim-margin 0.85", "must contain --policy X exactly once"),
                     ("x=--policy duet --policy chunked", "must contain --policy X exactly once"),
                     ("x=--trim-margin 0.85 --policy", "must contain --policy X exactly once"),
                     ("x=--policy 'duet", "No closing quotation")]:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            sb.Config.variant(bad)


def _trace_args(tmp_path: Path) -> list[str]:
    """``--trace azure_code:2:3`` and a ``--traces-dir`` holding (empty) files of every trace."""
    folder = tmp_path / "traces"
    folder.mkdir(exist_ok=True)
    for name, _ in sb.TRACE_FILES.values():
        (folder / name).touch()
    return ["--trace", "azure_code:2:3", "--traces-dir", str(folder)]


def _parse_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        sb.parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_configurations_from_the_command_line(capsys, tmp_path):
    trace_args = _trace_args(tmp_path)
    args = sb.parse_args([*trace_args, "--policies", "duet,chunked",
                          "--variant", "duet-trim=--policy duet --trim-margin 0.85"])
    assert [(c.label, c.policy, c.serve_args) for c in args.configs] == \
        [("duet", "duet", ()), ("chunked", "chunked", ()), ("duet-trim", "duet", ("--trim-margin", "0.85"))]
    args = sb.parse_args([*trace_args, "--policies", "", "--variant", "c2k=--policy chunked"])
    assert args.configs == [sb.Config("c2k", "chunked")]
    assert "argument --variant: --variant 'x=--trim-margin 0.85': SERVE_ARGS must contain --policy X exactly once" \
        in _parse_error(capsys, [*trace_args, "--variant", "x=--trim-margin 0.85"])
    assert "labels must be unique across --policies and --variant: ['duet'] repeated" \
        in _parse_error(capsys, [*trace_args, "--policies", "duet,chunked", "--variant", "duet=--policy duet"])
    assert "no configuration: give --policies or --variant" in _parse_error(capsys, [*trace_args, "--policies", ""])
    assert "--gpus 0: must be >= 1" in _parse_error(capsys, [*trace_args, "--gpus", "0"])


def test_missing_traces_are_refused_before_any_server_starts(tmp_path, capsys):
    """Found only when the first bench run failed, after a server had started (minutes on a GPU)."""
    folder = tmp_path / "traces"
    runs = ["--trace", "azure_code:2:3", "--trace", "mooncake:1:3", "--trace", "azure_code:4:3"]
    assert _parse_error(capsys, [*runs, "--traces-dir", str(folder)]).endswith(
        f"error: --traces-dir {folder}: no such folder (scripts/copy_traces.sh fills .traces)\n")
    folder.mkdir()
    assert _parse_error(capsys, [*runs, "--traces-dir", str(folder)]).endswith(
        f"error: --traces-dir {folder}: no AzureLLMInferenceTrace_code.csv, mooncake_conversation_trace.jsonl "
        "(scripts/copy_traces.sh copies them)\n")
    (folder / "mooncake_conversation_trace.jsonl").touch()
    assert _parse_error(capsys, [*runs, "--traces-dir", str(folder)]).endswith(
        f"error: --traces-dir {folder}: no AzureLLMInferenceTrace_code.csv (scripts/copy_traces.sh copies them)\n")
    assert sb.parse_args(["--trace", "mooncake:1:3", "--traces-dir", str(folder)]).traces_dir == str(folder)


def test_assign_lanes_round_robin():
    configs = [sb.Config(f"c{j}", "duet") for j in range(5)]
    labels = lambda lanes: [[c.label for c in lane] for lane in lanes]
    assert labels(sb.assign_lanes(configs, 1)) == [["c0", "c1", "c2", "c3", "c4"]]
    assert labels(sb.assign_lanes(configs, 2)) == [["c0", "c2", "c4"], ["c1", "c3"]]
    assert labels(sb.assign_lanes(configs, 3)) == [["c0", "c3"], ["c1", "c4"], ["c2"]]
    assert labels(sb.assign_lanes(configs[:2], 4)) == [["c0"], ["c1"]]


def _bench(tmp_path: Path, *argv: str) -> sb.Bench:
    return sb.Bench(sb.parse_args([*_trace_args(tmp_path), "--out", str(tmp_path / "out"), "--work",
                                   str(tmp_path / "work"), "--port", "9000", *argv]))


def test_server_command_of_a_variant(tmp_path):
    bench = _bench(tmp_path, "--gpus", "2", "--policies", "chunked", "--device", "cpu",
                   "--variant", "duet-trim=--policy duet --trim-margin 0.85", "--serve-args", "--max-num-seqs 32")
    assert [(lane.index, lane.port, lane.gpu, [c.label for c in lane.configs]) for lane in bench.lanes] == \
        [(0, 9000, 0, ["chunked"]), (1, 9001, 1, ["duet-trim"])]
    lane = bench.lanes[1]
    words = shlex.split(bench.server_cmd(lane.configs[0], Path("/m"), Path("/w/it.jsonl"), lane))
    assert words[:2] == ["env", "CUDA_VISIBLE_DEVICES=1"]
    assert words[3:6] == ["-m", "duetserve.cli", "serve"]
    assert words.count("--policy") == 1 and words[words.index("--policy") + 1] == "duet"
    assert words[words.index("--port") + 1] == "9001"
    assert words[words.index("--iteration-log") + 1] == "/w/it.jsonl"
    assert words[-6:] == ["--device", "cpu", "--trim-margin", "0.85", "--max-num-seqs", "32"]

    bench = _bench(tmp_path, "--policies", "", "--variant", "duet-trim=--policy duet --trim-margin 0.85")
    lane = bench.lanes[0]
    assert (lane.port, lane.gpu) == (9000, None)  # one lane: the environment's GPUs
    words = shlex.split(bench.server_cmd(lane.configs[0], Path("/m"), Path("/w/it.jsonl"), lane))
    assert words[1:4] == ["-m", "duetserve.cli", "serve"] and "CUDA_VISIBLE_DEVICES" not in " ".join(words)
    assert words.count("--policy") == 1 and words[-2:] == ["--trim-margin", "0.85"]


def test_lanes_run_in_parallel_and_variant_labels_reach_the_outputs(tmp_path, monkeypatch):
    from duetserve.bench import launch

    both_up = threading.Barrier(2, timeout=10)  # broken (a "server failed") unless both lanes' first servers
    # are up at once
    started: list[str] = []

    class FakeServer:
        def __init__(self, config):
            self.config = config

        def __enter__(self):
            words = shlex.split(self.config.command)
            it_log = Path(words[words.index("--iteration-log") + 1])
            it_log.write_text(json.dumps({"t": time.time(), "spatial": False}) + "\n")
            started.append(self.config.command)
            if len(started) <= 2:
                both_up.wait()
            return self

        def stop(self):
            pass

        def log_tail(self):
            return "fake server log"

    def fake_bench(self, cmd, limit_s, lane):
        result = Path(cmd[cmd.index("--result-file") + 1])
        qps = float(cmd[cmd.index("--qps") + 1])
        result.write_text(json.dumps({"completed": 6, "failed": 0, "request_throughput": 1.9 * qps,
                                      "p99_itl_ms": 40.0 + lane.port - 9000, "start_time_unix": time.time() - 1,
                                      "duration": 2.0}))
        return 0, ""

    monkeypatch.setattr(launch, "ServerProcess", FakeServer)
    monkeypatch.setattr(sb.Bench, "run_bench", fake_bench)
    bench = _bench(tmp_path, "--gpus", "2", "--policies", "duet,chunked", "--warmup-requests", "0",
                   "--variant", "duet-trim=--policy duet --trim-margin 0.85")
    bench.run_lanes(tmp_path)

    assert len(started) == 3 and sum("CUDA_VISIBLE_DEVICES=0" in c for c in started) == 2
    doc = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert sorted((r["policy"], r["status"]) for r in doc["runs"]) == \
        [("chunked", "ok"), ("duet", "ok"), ("duet-trim", "ok")]
    assert {s["policy"]: (s["lane"], s["port"], s["log_tail"]) for s in doc["servers"]} == \
        {"duet": (0, 9000, "fake server log"), "chunked": (1, 9001, "fake server log"),
         "duet-trim": (0, 9000, "fake server log")}
    assert [c["label"] for c in doc["settings"]["configs"]] == ["duet", "chunked", "duet-trim"]
    table = (tmp_path / "out" / "serving_table.md").read_text()
    assert "| azure_code | duet-trim | 2 | 6/6 | 3.80 | - | - | - | - | 40.0 | - | 0.0% | - |" in table
    assert "| azure_code | chunked | 2 | 6/6 | 3.80 | - | - | - | - | 41.0 | - | 0.0% | - |" in table
    assert "duet-trim: qps 2 (3.80 req/s, 1.00x chunked)" in table
    with gzip.open(tmp_path / "out" / "iterations.jsonl.gz", "rt") as f:
        assert sorted(json.loads(line)["policy"] for line in f) == ["chunked", "duet", "duet-trim"]


def test_iteration_summary_window_and_error():
    recs = [{"t": 0.5, "spatial": True, "s_decode": 8, "k": 4, "predicted_s": 1.0, "measured_s": 1.0},
            {"t": 1.0, "spatial": False, "predicted_s": 0.5, "measured_s": 1.0},
            {"t": 2.0, "spatial": True, "s_decode": 16, "k": 12, "steps": 6, "predicted_s": 3.0, "measured_s": 2.0},
            {"t": 3.0, "spatial": False, "predicted_s": None, "measured_s": 1.0},
            {"t": 9.0, "spatial": True, "s_decode": 99, "k": 1, "predicted_s": 1.0, "measured_s": 1.0}]
    s = sb.iteration_summary(recs, 1.0, 3.0)
    assert s["iterations"] == 3 and s["spatial_iterations"] == 1
    assert s["spatial_share"] == pytest.approx(1 / 3)
    assert s["pred_err_median"] == pytest.approx(0.5)  # errors 0.5 and 0.5; None skipped
    assert s["s_decode_median"] == 16 and s["k_median"] == 6
    assert s["spatial_measured_over_predicted"] == pytest.approx(2 / 3)
    assert s["prefill_measured_over_predicted"] is None  # not logged by this (older) record
    assert sb.iteration_summary(recs, 20.0, 30.0) == {"iterations": 0, "spatial_iterations": 0,
                                                     "spatial_share": None, "pred_err_median": None}
    assert "schedule_ms_median" not in s  # an older log without the scheduler's time
    timed = [{**r, "schedule_s": 1e-3 * (i + 1)} for i, r in enumerate(recs)]  # 2, 3, 4 ms in the window
    s = sb.iteration_summary(timed, 1.0, 3.0)
    assert (s["schedule_ms_median"], s["schedule_ms_p99"]) == pytest.approx((3.0, 4.0))


def test_iteration_summary_stream_times():
    """Per-stream busy times against the plan's predictions (records as the server logs them)."""
    rec = {"spatial": True, "s_decode": 8, "k": 8, "predicted_s": 0.2, "measured_s": 0.3,
           "predicted_decode_s": 0.03, "predicted_prefill_s": 0.2}
    recs = [{**rec, "t": 1.0, "steps": 7, "decode_stream_s": 0.28, "prefill_stream_s": 0.26},
            {**rec, "t": 2.0, "steps": 5, "decode_stream_s": 0.15, "prefill_stream_s": 0.30},
            {**rec, "t": 3.0, "steps": 0, "decode_stream_s": None, "prefill_stream_s": 0.24}]
    s = sb.iteration_summary(recs, 0.0, 4.0)
    assert s["prefill_measured_over_predicted"] == pytest.approx(1.3)  # 1.2, 1.3, 1.5
    assert s["decode_step_measured_over_predicted"] == pytest.approx(4 / 3)  # 0.04/0.03 and 0.03/0.03
    assert s["spatial_measured_over_predicted"] == pytest.approx(1.5)
    assert "split_over_trimmed_rate_median" not in s  # no trim_rates logged
    weighed = [{**r, "trim_rates": [30e3, t]} for r, t in zip(recs, (33e3, 36e3, 31.5e3), strict=True)]
    assert sb.iteration_summary(weighed, 0.0, 4.0)["split_over_trimmed_rate_median"] == pytest.approx(1.1)
    assert "decode_bias_by_sms" not in s  # no decode_margin logged
    # priced with a margin: step x margin / prediction per level (the zero-step record is left out)
    priced = [{**recs[0], "decode_margin": 1.5}, {**recs[2], "decode_margin": 1.1}] + [
        {**recs[1], "t": 2.0 + i / 10, "decode_margin": m, "s_decode": 16} for i, m in enumerate((1.2, 1.6, 1.4))] + [
        {**recs[1], "decode_stream_s": None, "decode_margin": 1.3, "s_decode": 16}]  # no stream time: not counted
    assert sb.iteration_summary(priced, 0.0, 4.0)["decode_bias_by_sms"] == {
        8: [pytest.approx(0.04 * 1.5 / 0.03), 1], 16: [pytest.approx(1.4), 3]}  # 0.03 / 0.03 x 1.2, 1.6, 1.4
    assert "launch_ms_median" not in s and "first_handout_ms_median" not in s  # not logged
    # the host's timing of splits beside a prefill; the decode-only record (no prefill tokens) is left out
    host = [{**r, "num_prefill_tokens": 512, "launch_s": launch, "handout_s": handouts}
            for r, launch, handouts in zip(recs, (0.018, 0.016, 0.050), ([0.031, 0.06], [0.027], []), strict=True)]
    host.append({**recs[0], "num_prefill_tokens": 0, "launch_s": 0.001, "handout_s": [0.002]})
    s = sb.iteration_summary(host, 0.0, 4.0)
    assert (s["launch_ms_median"], s["launch_ms_p99"]) == pytest.approx((18.0, 50.0))
    assert (s["first_handout_ms_median"], s["first_handout_ms_p99"]) == pytest.approx((31.0, 31.0))


def test_iteration_summary_host_idle_share():
    """The GPU's idle share: a temporal iteration of 60 ms with a 54 ms GPU span after a 2 ms gap, a
    multi-step decode of 40 ms whose decode stream ran 39 ms after 1 ms, a split of 100 ms whose
    longer stream ran 97 ms (no gap logged); an older record without any span is left out. Wall
    62 + 41 + 100 = 203 ms, host idle inside 6 + 1 + 3 = 10 ms, with the gaps 13 ms."""
    recs = [{"t": 1.0, "spatial": False, "measured_s": 0.060, "gpu_s": 0.054, "gap_s": 0.002},
            {"t": 2.0, "spatial": False, "measured_s": 0.040, "decode_stream_s": 0.039, "prefill_stream_s": None,
             "gpu_s": None, "gap_s": 0.001},
            {"t": 3.0, "spatial": True, "measured_s": 0.100, "decode_stream_s": 0.090, "prefill_stream_s": 0.097,
             "gap_s": None},
            {"t": 3.5, "spatial": False, "measured_s": 0.050, "gap_s": 0.010}]
    s = sb.iteration_summary(recs, 0.0, 4.0)
    assert s["host_idle_in_iteration_share"] == pytest.approx(0.010 / 0.203)
    assert s["host_idle_share"] == pytest.approx(0.013 / 0.203)
    assert "host_idle_share" not in sb.iteration_summary(recs[3:], 0.0, 4.0)  # no span logged


def test_late_gaps_are_matched_to_the_iteration_that_produced_them():
    """Client gaps over the SLO, placed in time (start 100 s, TTFT 0.5 s), are counted by the
    iteration whose log line comes next, less 10 ms: a temporal one ending at 100.70 s (its token
    seen at 100.699 s, and one delivered late at 100.705 s); a split of 4 steps of 50 ms that ran
    100.70-100.95 s, whose first step's token came at 100.759 s (within 1.5 steps of its start) and
    a later one at 100.899 s; a gap more than 10 ms after the last logged iteration is unmatched."""
    records = [{"t": 100.70, "spatial": False, "measured_s": 0.2},
               {"t": 100.95, "spatial": True, "measured_s": 0.25, "decode_stream_s": 0.2, "steps": 4}]
    result = {"start_time_unix": 100.0, "requests": [
        {"start_s": 0.0, "ttft_s": 0.5, "itls_s": [0.199, 0.06, 0.14]},  # 100.699 (temporal), 100.759, 100.899
        {"start_s": 0.1, "ttft_s": 0.4, "itls_s": [0.259, 0.211]},  # 100.759 (split, first step), 100.97 (after)
        {"start_s": 0.0, "ttft_s": 0.405, "itls_s": [0.3]},  # 100.705: the temporal iteration's, delivered late
        {"start_s": 0.0, "ttft_s": None, "itls_s": []}]}  # failed: no tokens
    assert sb.late_gaps(result, records, 0.1) == {"gaps": 6, "late": 5, "temporal": 2, "split_first_step": 1,
                                                  "split_later_step": 1, "unmatched": 1}
    assert sb.late_gaps(result, records, 0.3)["late"] == 0
    # with the hand-out times logged, a split's first-step tokens are those that came before the
    # second hand-out: at 100.78 s here, so as above 100.759 is a first step's and 100.899 a later
    # one's; with step 0 held back until 100.90 s and step 1 handed out at 100.92 s, both are
    # the first step's (the 1.5-step rule counted 100.899 as a later step's)
    records[1]["handout_s"] = [0.05, 0.08, 0.15, 0.2]
    assert [sb.late_gaps(result, records, 0.1)[k] for k in ("split_first_step", "split_later_step")] == [1, 1]
    records[1]["handout_s"] = [0.2, 0.22, 0.23, 0.24]
    assert [sb.late_gaps(result, records, 0.1)[k] for k in ("split_first_step", "split_later_step")] == [2, 0]


def _run(policy, trace, qps, p99, failed=0, req_s=None, status="ok", spatial=0.0):
    if status != "ok":
        return {"policy": policy, "trace": trace, "qps": qps, "status": status, "num_requests": 10}
    res = {"completed": 10 - failed, "failed": failed, "request_throughput": req_s or qps * 0.95,
           "output_throughput": 100.0, "mean_ttft_ms": 50.0, "p99_ttft_ms": 200.0,
           "median_itl_ms": 20.0, "p99_itl_ms": p99, "tbt_slo_attainment": 0.995}
    return {"policy": policy, "trace": trace, "qps": qps, "status": "ok", "num_requests": 10, "result": res,
            "iterations": {"spatial_share": spatial, "pred_err_median": 0.1}}


def test_table_and_capacity():
    runs = [_run("chunked", "azure_code", 10, 120.0), _run("chunked", "azure_code", 16, 170.0),
            _run("duet", "azure_code", 10, 80.0, spatial=0.02), _run("duet", "azure_code", 16, 95.0, spatial=0.1),
            _run("pdmux", "azure_code", 10, 20.0), _run("pdmux", "azure_code", 16, 25.0, failed=2),
            _run("chunked", "mooncake", 0.75, 90.0, req_s=0.5), _run("duet", "mooncake", 0.75, 99.0, req_s=0.6),
            _run("prefill-first", "mooncake", 0.75, 0, status="skipped: out of time")]
    rows = [sb.run_row(r) for r in runs]
    cap = sb.capacity(rows, 100.0)
    assert cap[("azure_code", "chunked")] == {"qps": None, "req_s": None}
    assert cap[("azure_code", "duet")]["qps"] == 16
    assert cap[("azure_code", "pdmux")]["qps"] == 10  # qps 16 had failed requests
    assert cap[("mooncake", "duet")]["req_s"] == 0.6
    assert cap[("mooncake", "prefill-first")]["qps"] is None
    assert sb.capacity(rows, 100.0, keep_up=0.9)[("mooncake", "duet")]["qps"] is None  # 0.6 < 0.9 x 0.75

    table = sb.format_table(runs, 100.0)
    lines = table.splitlines()
    assert lines[0].startswith("| trace | policy | qps |")
    body = [ln for ln in lines if ln.startswith("| azure_code") or ln.startswith("| mooncake")]
    assert len(body) == len(runs)
    assert "| azure_code | duet | 16 | 10/10 | 15.20 | 100 | 50 | 200 | 20.0 | 95.0 | 99.50% | 10.0% | 10% |" in table
    assert "| mooncake | prefill-first | 0.75 | skipped: out of time | - |" in table
    assert "- azure_code: chunked: none; duet: qps 16 (15.20 req/s); pdmux: qps 10 (9.50 req/s)" in table
    assert "duet: qps 0.75 (0.60 req/s, 1.20x chunked)" in table


def test_tokenizer_streams_text_for_every_id(tmp_path):
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer

    sb.write_tokenizer(tmp_path, 1000)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_id is None
    for i in (0, 1, 2, 999):  # every id the model can sample decodes to non-empty text
        assert tok.decode([5, i], skip_special_tokens=True) == f"t5 t{i}"


def _wheel(path: Path, name: str, version: str, requires: list[str]) -> Path:
    whl = path / f"{name}-{version}-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (name, version)
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return whl


def test_select_wheels(tmp_path, monkeypatch):
    sw = load_script("select_wheels")
    site, opt = tmp_path / "site", tmp_path / "opt"
    site.mkdir(), opt.mkdir()
    info = site / "carried-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: carried\nVersion: 1.0\n"
        "Requires-Dist: pytest>=1\nRequires-Dist: pytest>=999\nRequires-Dist: nosuchpkg-abc>=1\n"
        "Requires-Dist: notcarried-xyz\nRequires-Dist: other-pkg; extra == 'x'\n")
    _wheel(opt, "pytest", "999.0", [])            # installed, but too old for >=999: chosen
    _wheel(opt, "nosuchpkg_abc", "1.0", ["dep-abc>=2"])  # missing: chosen, with its own need
    _wheel(opt, "dep_abc", "2.0", [])
    _wheel(opt, "other_pkg", "1.0", [])            # only under an extra: not chosen
    _wheel(opt, "pluggy", "1.0", [])               # installed and not required: not chosen
    monkeypatch.syspath_prepend(str(site))
    names = sorted(p.name.split("-")[0] for p in sw.select(site, opt))
    assert names == ["dep_abc", "nosuchpkg_abc", "pytest"]
    assert [p.name.split("-")[0] for p in sw.select(site, opt, ["pluggy>=9999"])].count("pluggy") == 1


def test_iteration_summary_eager_span_over_the_cost_models_gpu_time():
    """Temporal iterations with prefill over the logged piecewise limit (1024 tokens): GPU span over
    the cost model's GPU time, here a stand-in pricing 10 us a query token. 2000 tokens in 24 ms
    (1.2x), 3000 in 33 ms (1.1x), 1502 in 19.526 ms (1.3x): median 1.2 of 3. Left out: a
    1000-token iteration (piecewise graphs), a split, one without a span, a decode-only one."""
    calls = []

    class Model:
        profile = type("P", (), {"num_sms": 132})()

        def predict_total(self, reqs, sms, graphs=None, host=True):
            calls.append((sms, graphs, host))
            return 1e-5 * sum(q for q, _ in reqs)

    base = {"t": 1.0, "spatial": False, "piecewise_tokens": 1024, "measured_s": 0.05}
    recs = [{**base, "requests": [[1, 50], [1999, 0]], "num_prefill_tokens": 1999, "gpu_s": 0.024},
            {**base, "requests": [[3000, 0]], "num_prefill_tokens": 3000, "gpu_s": 0.033},
            {**base, "requests": [[1, 10], [1, 10], [1500, 100]], "num_prefill_tokens": 1500, "gpu_s": 0.019526},
            {**base, "requests": [[1000, 0]], "num_prefill_tokens": 1000, "gpu_s": 0.5},
            {**base, "spatial": True, "requests": [[3000, 0]], "num_prefill_tokens": 3000, "gpu_s": 0.5},
            {**base, "requests": [[3000, 0]], "num_prefill_tokens": 3000, "gpu_s": None},
            {**base, "requests": [[1, 5000]] * 2000, "num_prefill_tokens": 0, "gpu_s": 0.5}]
    s = sb.iteration_summary(recs, 0.0, 2.0, Model())
    assert s["eager_span_count"] == 3
    assert s["eager_span_over_predicted"] == pytest.approx(1.2)
    assert calls == [(132, False, False)] * 3
    assert "eager_span_over_predicted" not in sb.iteration_summary(recs, 0.0, 2.0)  # no cost model given


def test_served_cost_model_prices_the_written_model(tmp_path):
    """The cost model serving_bench builds is the served model's: Qwen3-8B's 36 layers on the
    H200's 132 SMs; an 8192-token prompt alone takes ~2 x 8.2e9 x 8192 FLOPs at well under 1 PFLOP/s."""
    cm = sb.served_cost_model(sb.write_model(tmp_path, "qwen3-8b"))
    assert cm.shape.layers == 36 and cm.profile.num_sms == 132
    assert 0.1 < float(cm.predict_total([(8192, 0)], 132, host=False)) < 0.3



def test_served_cost_model_takes_the_profile_the_serve_args_name(tmp_path):
    """A configuration served with ``--profile`` is priced on that profile (the last one given, as
    serve's argparse reads them; a name or a path); without one, on serve's default (the H200)."""
    model = sb.write_model(tmp_path, "qwen3-8b")
    assert sb.served_cost_model(model, ["--num-decode-steps", "4"]).profile.num_sms == 132
    assert sb.served_cost_model(model, ["--profile", "h200", "--profile=a100"]).profile.num_sms == 108
    custom = tmp_path / "a100-copy.json"
    custom.write_text((sb.ROOT / "duetserve/planner/profiles/a100.json").read_text())
    assert sb.served_cost_model(model, ["--profile", str(custom)]).profile.num_sms == 108
    with pytest.raises(ValueError, match="no profile"):
        sb.served_cost_model(model, ["--profile", str(tmp_path / "missing.json")])
