"""``duetserve serve`` rejects bad flags before loading anything, naming the flag."""
from __future__ import annotations

import argparse
import gc
import json
import logging
import re
from pathlib import Path

import pytest
import tomllib

from duetserve import argtypes
from duetserve.argtypes import image_formats
from duetserve.cli import _add_serve, _positive_float, main


@pytest.mark.parametrize("argv, flag", [
    (["--port", "70000"], "--port"),
    (["--port", "-1"], "--port"),
    (["--device", "tpu"], "--device"),
    (["--profile", "nosuch"], "--profile"),
    (["--tbt-slo", "fast"], "--tbt-slo"),
    (["--tbt-slo=-5ms"], "--tbt-slo"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--policy", "pdmux", "--device", "cpu"], "--policy"),
    (["--libsmctrl", "/nonexistent.so"], "--libsmctrl"),
    (["--trim-margin", "0"], "--trim-margin"),
    (["--trim-margin", "1.5"], "--trim-margin"),
    (["--host", "999.1.1.1"], "--host 999.1.1.1"),  # named --port before
    (["--iteration-log", "/nonexistent/dir/it.jsonl"], "--iteration-log /nonexistent/dir/it.jsonl: No such file"),
])
def test_bad_serve_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        # --port 0 (any free port) unless argv names one: port 8000 may be taken where tests run
        main(["serve", "--port", "0", *(["--device", "cpu"] if "--device" not in argv else []), *argv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--cpu-kv-cache-gb", "-1"], "argument --cpu-kv-cache-gb: must be a positive number, got '-1'"),
    (["--cpu-kv-cache-gb", "0"], "argument --cpu-kv-cache-gb: must be a positive number, got '0'"),
    (["--cpu-kv-cache-gb", "nan"], "argument --cpu-kv-cache-gb: must be a positive number, got 'nan'"),
    (["--cpu-kv-cache-gb", "inf"], "argument --cpu-kv-cache-gb: must be a positive number, got 'inf'"),
    (["--cpu-kv-cache-gb", "two"], "argument --cpu-kv-cache-gb: must be a positive number, got 'two'"),
    (["--served-model-name", ""], "argument --served-model-name: must not be empty"),
    (["--served-model-name", "  "], "argument --served-model-name: must not be empty"),
    (["--api-key", ""], "argument --api-key: must not be empty"),  # `--api-key "$UNSET"` served without auth
    (["--trim-margin", "fast"], "argument --trim-margin: must be a number in (0, 1], auto or off, got 'fast'"),
    (["--block-size", "1000000"],  # no upper bound: allocated blocks of a million tokens
     "argument --block-size: must be one of 1, 8, 16, 32, 64, 128, 256, got '1000000'"),
    (["--block-size", "0"], "argument --block-size: must be one of 1, 8, 16, 32, 64, 128, 256, got '0'"),
    (["--block-size", "x"], "argument --block-size: expected an integer, got 'x'"),
    (["--num-decode-steps", "0"], "argument --num-decode-steps: must be in [1, 256], got '0'"),  # as simulate words it
    (["--num-decode-steps", "300"], "argument --num-decode-steps: must be in [1, 256], got '300'"),  # MAX_LOOKAHEAD
    (["--num-decode-steps", "two"], "argument --num-decode-steps: expected an integer, got 'two'"),
    # accepted, while bench, simulate and the API's seed refuse negative seeds
    (["--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
    # "duetserve serve: error: Overflow when unpacking long long", after binding the port
    (["--port", "0", "--seed", str(2**64)], "duetserve serve: error: --seed must be in [0, 2**64)"),
])
def test_bad_serve_values_are_explained(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag, value, message", [
    (["serve", "--device", "cpu"], "--tbt-slo", "-5ms", "bad duration '-5ms': a duration cannot be negative"),
    (["serve", "--device", "cpu"], "--cpu-kv-cache-gb", "-1e3", "must be a positive number, got '-1e3'"),
    (["bench"], "--tbt-slo", "-5ms", "bad duration '-5ms': a duration cannot be negative"),
    (["bench"], "--qps", "-2", "must be a positive rate (req/s) or inf, got '-2'"),
    (["bench"], "--sweep-qps", "-2,4", "must be a positive rate (req/s) or inf, got '-2'"),
    (["bench"], "--window", "-5:10", "bad duration '-5': a duration cannot be negative"),
    (["bench"], "--request-timeout", "-1s", "bad duration '-1s': a duration cannot be negative"),
    (["bench"], "--token-id-range", "-1:5", "expected 0 <= LOW < HIGH, got '-1:5'"),
])
def test_a_negative_value_after_a_space_gets_the_flags_own_message(argv, flag, value, message, capsys):
    """``--tbt-slo -5ms`` said "expected one argument"; now it says what ``--tbt-slo=-5ms`` says."""
    errors = []
    for given in ([flag, value], [f"{flag}={value}"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, *given])
        assert exc.value.code == 2
        errors.append(capsys.readouterr().err)
    assert errors[0] == errors[1] and errors[0].endswith(f": error: argument {flag}: {message}\n")


def test_cpu_kv_cache_gb_accepts_small_positive_values():
    assert _positive_float("--cpu-kv-cache-gb")("0.25") == 0.25
    assert _positive_float("--cpu-kv-cache-gb")("1e-3") == 0.001


def test_serve_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert "(default: None)" not in text
    assert "model name in the API (default: from --model) --load-format" in text
    assert "cpu or cuda[:N] (default: cuda if available) --dtype" in text
    assert "context limit, tokens (default: the model's) --device" in text
    assert "port to listen on (default: 8000)" in text
    assert "KV-cache pool on the CPU, GiB (default: 2.0)" in text


def test_bench_help_is_for_users_and_lists_exit_codes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "configure_parser" not in text and ":func:" not in text and "``" not in text
    lines = [line.strip() for line in text.splitlines()]
    assert lines[lines.index("Exit status:") + 1].startswith("0  every run completed at least one request")
    assert any(line.startswith("1  setup error") for line in lines)
    assert any(line.startswith("2  every request of a run failed") for line in lines)
    assert "2 is also argparse's status for a usage error" in " ".join(lines)


def test_serve_tbt_slo_bare_number_is_milliseconds():
    """As in simulate and bench: 100 is 100 ms, not 100 s; the default is 100 ms."""
    parser = argparse.ArgumentParser()
    _add_serve(parser.add_subparsers())
    for text, seconds in (("100", 0.1), ("100ms", 0.1), ("0.25s", 0.25)):
        assert parser.parse_args(["serve", "--tbt-slo", text]).tbt_slo == pytest.approx(seconds)
    assert parser.parse_args(["serve"]).tbt_slo == pytest.approx(0.1)


@pytest.mark.parametrize("command", [["serve"], ["bench", "--num-requests", "2", "--qps", "1"],
                                     ["simulate", "--format", "synthetic", "--qps", "1", "--num-requests", "2"]])
def test_a_tbt_slo_under_a_millisecond_is_refused_as_a_likely_slip(command, capsys):
    """``--tbt-slo 0.1`` was 0.1 ms, served silently (its log said "TBT SLO 0 ms"); 1 ms is the least."""
    with pytest.raises(SystemExit) as exc:
        main([*command, "--tbt-slo", "0.1"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith(
        "error: argument --tbt-slo: a TBT SLO under 1 ms cannot be served, got '0.1' (bare numbers are milliseconds: "
        "write 100ms or 0.1s)\n")
    assert argtypes.tbt_slo("1") == pytest.approx(1e-3) and argtypes.tbt_slo("0.1s") == pytest.approx(0.1)


@pytest.mark.parametrize("command", [["serve"], ["bench", "--num-requests", "2", "--qps", "1"],
                                     ["simulate", "--format", "synthetic", "--qps", "1", "--num-requests", "2"]])
@pytest.mark.parametrize("value", ["1e400", "1e308min"])
def test_an_infinite_tbt_slo_is_refused(command, value, monkeypatch, capsys):
    """``serve --tbt-slo 1e400`` overflowed to inf and served with "TBT SLO inf ms"."""
    import duetserve.engine.engine as engine_module

    def no_loading(*_, **__):
        raise AssertionError("the model was loaded with an infinite --tbt-slo")

    monkeypatch.setattr(engine_module, "LLMEngine", no_loading)
    with pytest.raises(SystemExit) as exc:
        main([*command, "--tbt-slo", value])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: argument --tbt-slo: must be a finite duration, got {value!r}\n")


def test_serve_refuses_a_busy_port_before_loading(capsys):
    """A busy port is refused before the model loads; a wrong flag is named before the port,
    as it would be on a free one."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)])
        assert exc.value.code == 2 and f"--port {port}: cannot listen on 127.0.0.1" in capsys.readouterr().err
        for flags, message in ((["--policy", "pdmux"], "--policy pdmux needs an SM partition backend"),
                               (["--profile", "nowhere.json"], "--profile nowhere.json:"),
                               (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
                               (["--iteration-log", "/nonexistent/it.jsonl"], "--iteration-log /nonexistent/it.jsonl:")):
            with pytest.raises(SystemExit) as exc:
                main(["serve", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), *flags])
            err = capsys.readouterr().err
            assert exc.value.code == 2 and message in err and "cannot listen" not in err, err


@pytest.mark.parametrize("argv, message", [
    (["--qps", "0"], "argument --qps: must be a positive rate (req/s) or inf, got '0'"),
    (["--qps", "nan"], "argument --qps: must be a positive rate (req/s) or inf, got 'nan'"),
    (["--sweep-qps", "0,1"], "argument --sweep-qps: must be a positive rate (req/s) or inf, got '0'"),
    (["--sweep-qps", ","], "argument --sweep-qps: give one or more rates, e.g. 2,4,8"),
    (["--cv", "nan"], "argument --cv: must be a finite number >= 0, got 'nan'"),
    (["--cv", "-1"], "argument --cv: must be a finite number >= 0, got '-1'"),
    (["--endpoint", "v1/completions"],  # an httpx.InvalidURL traceback
     "argument --endpoint: must be a path starting with '/', e.g. /v1/completions, got 'v1/completions'"),
    (["--api-key", " "], "argument --api-key: must not be empty"),  # sent "Bearer  " (blank), "" no header
    (["--max-concurrency", "0"], "argument --max-concurrency: must be a positive integer, got '0'"),  # hung
    (["--max-concurrency", "-1"], "argument --max-concurrency: must be a positive integer, got '-1'"),
    (["--num-requests", "0"], "argument --num-requests: must be a positive integer, got '0'"),
    (["--max-input-len", "0"], "argument --max-input-len: must be a positive integer, got '0'"),
    (["--max-output-len", "x"], "argument --max-output-len: expected an integer, got 'x'"),
    (["--percentiles", "150"], "argument --percentiles: expected percentiles in [0, 100], e.g. 90,99, got '150'"),
    (["--percentiles", "90,,99"], "argument --percentiles: empty item in '90,,99'"),
    (["--token-id-range", "5:1"], "argument --token-id-range: expected 0 <= LOW < HIGH, got '5:1'"),
    (["--window", "5:1"], "argument --window: START must be before END, got '5:1'"),
    (["--result-file", "/nonexistent/r.json"], "argument --result-file: no such folder: /nonexistent"),
    (["--base-url", "notaurl"],  # failed after the run's header: "Request URL is missing an 'http://' ..."
     "argument --base-url: expected an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000, got 'notaurl'"),
    (["--base-url", "ftp://x"],
     "argument --base-url: expected an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000, got 'ftp://x'"),
    (["--base-url", "http://"],
     "argument --base-url: expected an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000, got 'http://'"),
    (["--base-url", "http://x:99999"], ("argument --base-url: expected an http:// or https:// URL with a host, "
                                        "e.g. http://127.0.0.1:8000, got 'http://x:99999'")),
    (["--base-url", "http://127.0.0.1:8000/v1/"],  # asked /v1/v1/models and failed with a 404
     ("argument --base-url: give the server root without /v1 (--endpoint adds it), e.g. http://127.0.0.1:8000, "
      "got 'http://127.0.0.1:8000/v1/'")),
    (["--result-file", "/proc/r.json"], "argument --result-file: /proc/r.json: No such file or directory"),
    (["--launch-log", "/proc/l.txt"], "argument --launch-log: /proc/l.txt: No such file or directory"),
    (["--plot", "/nonexistent/p.png"], "argument --plot: no such folder: /nonexistent"),
    (["--plot", "/tmp/p.txt"],  # failed in matplotlib after the whole run
     "argument --plot: /tmp/p.txt: matplotlib cannot write .txt images; use one of "
     + ", ".join(f".{f}" for f in image_formats())),
    (["--tokenizer", "/nonexistent"], "argument --tokenizer: no such folder: /nonexistent"),
    (["--compare", "/nonexistent/a.json", "/nonexistent/b.json"],
     "argument --compare: no such file: /nonexistent/a.json"),
    (["--launch", "no-such-command-xyz --port 1"], "argument --launch: command not found: no-such-command-xyz"),
    (["--request-timeout", "0"], "argument --request-timeout: must be a positive duration, got '0'"),
    (["--launch-timeout", "0s"], "argument --launch-timeout: must be a positive duration, got '0s'"),
    (["--tbt-slo", "0"], "argument --tbt-slo: must be a positive duration, got '0'"),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
    (["--iteration-log", "/nonexistent/it.jsonl"], "argument --iteration-log: no such folder: /nonexistent"),
    (["--trace", "/nonexistent/t.csv"], "argument --trace: no such file: /nonexistent/t.csv"),  # exited 1
])
def test_bad_bench_flags_exit_2_naming_the_flag(argv, message, capsys):
    """Refused before any request is sent (``--max-concurrency 0`` used to hang, ``--percentiles
    150`` and a missing ``--result-file`` folder used to fail only after the whole run)."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--base-url", "http://127.0.0.1:1", *argv])
    assert exc.value.code == 2
    assert f"duetserve bench: error: {message}\n" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--goodput", "ttft:-1"], "--goodput ttft:-1: bad duration '-1': a duration cannot be negative"),
    (["--goodput", "itl:5"], "--goodput itl:5: keys are ttft, tpot, e2el, each once"),  # named no flag
    (["--goodput", "ttft:1", "ttft:2"], "--goodput ttft:2: keys are ttft, tpot, e2el, each once"),
    (["--sweep-qps", "2,4"], "give either --qps or --sweep-qps"),
    (["--window", "1000:2000"], "the trace selection holds no requests (see --window and --num-requests)"),
])
def test_bench_flags_checked_after_parsing_are_usage_errors(argv, message, capsys):
    """Exit 2 with the flag named, as argparse's own errors; these exited 1, as a failed run does."""
    assert main(["bench", "--base-url", "http://127.0.0.1:1", "--qps", "1", "--num-requests", "1", *argv]) == 2
    assert capsys.readouterr().err == f"duetserve bench: error: {message}\n"


@pytest.mark.parametrize("argv, message", [
    (["--num-requests", "3"], "a synthetic trace needs a number of requests and a QPS (--num-requests and --qps)"),
    (["--qps", "3"], "a synthetic trace needs a number of requests and a QPS (--num-requests and --qps)"),
    (["--trace-format", "azure"], "--trace FILE is required with --trace-format azure"),  # named no flag
])
def test_bench_trace_flags_that_give_no_trace_are_usage_errors(argv, message, capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:1", *argv]) == 2
    assert capsys.readouterr().err == f"duetserve bench: error: {message}\n"


@pytest.mark.parametrize("argv, message", [
    (["--qps", "2"], "--qps and --sweep-qps need --arrival scale or poisson for a trace file (--arrival trace, the "
                     "default, keeps the trace's own arrival times)"),
    (["--sweep-qps", "2,4"], "--qps and --sweep-qps need --arrival scale or poisson for a trace file (--arrival "
                             "trace, the default, keeps the trace's own arrival times)"),
    (["--arrival", "poisson"], "--arrival poisson needs --qps or --sweep-qps"),
    # --cv was ignored silently where the trace keeps its own gaps
    (["--cv", "2"], ("--cv 2 does nothing with --arrival trace: a trace file keeps its own gaps (--arrival poisson "
                     "draws gaps of that CV)")),
    (["--cv", "0.5", "--arrival", "scale", "--qps", "2"],
     ("--cv 0.5 does nothing with --arrival scale: a trace file keeps its own gaps (--arrival poisson draws gaps "
      "of that CV)")),
])
def test_bench_arrival_rate_and_cv_that_do_not_go_together_are_usage_errors(argv, message, tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,10\n")
    assert main(["bench", "--base-url", "http://127.0.0.1:1", "--trace", str(trace), *argv]) == 2
    assert capsys.readouterr().err == f"duetserve bench: error: {message}\n"


@pytest.mark.parametrize("argv, cv", [
    (["--trace", "TRACE", "--arrival", "poisson", "--qps", "2", "--cv", "2"], 2.0),
    (["--trace", "TRACE", "--arrival", "poisson", "--qps", "2"], 1.0),
    (["--num-requests", "2", "--qps", "2", "--cv", "0.5"], 0.5),  # synthetic arrivals are drawn too
])
def test_bench_cv_where_arrivals_are_drawn_reaches_the_trace(argv, cv, tmp_path, monkeypatch, capsys):
    from duetserve.bench import cli as bench_cli

    def read_trace(path, spec):
        specs.append(spec)
        raise argtypes.UsageError("stop here")

    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,10\n")
    specs = []
    monkeypatch.setattr(bench_cli, "read_trace", read_trace)
    assert main(["bench", "--base-url", "http://127.0.0.1:1", *[str(trace) if a == "TRACE" else a for a in argv]]) == 2
    assert capsys.readouterr().err == "duetserve bench: error: stop here\n"
    assert [s.cv for s in specs] == [cv]


def test_bench_compare_refuses_flags_that_only_matter_for_a_run(tmp_path, capsys):
    """They were ignored silently; --plot, --iteration-log and --no-progress go with --compare."""
    result = tmp_path / "a.json"
    result.write_text('{"completed": 1, "duration": 1.0, "requests": []}')
    compare = ["bench", "--compare", str(result), str(result)]
    assert main([*compare, "--qps", "2", "--result-file", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err == ("duetserve bench: error: --qps, --result-file: only when running a benchmark, "
                                       "not with --compare (which prints two saved results)\n")
    assert main([*compare, "--launch", "true", "--base-url", "http://127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.startswith("duetserve bench: error: --base-url, --launch: only when running")
    assert main([*compare, "--no-progress"]) == 0
    assert "completed" in capsys.readouterr().out


def test_bench_trace_suffix_and_content(tmp_path, capsys):
    """A suffix that tells no format and a malformed trace are both usage errors (2), the latter naming
    --trace (it exited 1, as a server that cannot be reached does)."""
    text, bad = tmp_path / "trace.txt", tmp_path / "trace.csv"
    text.write_text("x\n")
    bad.write_text("a,b\n1,2\n")
    assert main(["bench", "--base-url", "http://127.0.0.1:1", "--trace", str(text)]) == 2
    assert capsys.readouterr().err == (
        f"duetserve bench: error: cannot infer the trace format of {text} from its suffix (.csv: azure, "
        ".jsonl: mooncake); give the format (simulate --format, bench --trace-format)\n")
    assert main(["bench", "--base-url", "http://127.0.0.1:1", "--trace", str(bad)]) == 2
    assert capsys.readouterr().err == (f"duetserve bench: error: --trace {bad}: not an Azure trace, missing columns "
                                       "['ContextTokens', 'GeneratedTokens', 'TIMESTAMP']\n")


@pytest.mark.parametrize("command", ["bench", "simulate"])
@pytest.mark.parametrize("name, text, reason", [
    ("t.csv", "", "the file is empty"),  # exited 1, "not an Azure trace, missing columns [...]"
    ("t.jsonl", "", "the file is empty"),  # exited 2, "the trace selection holds no requests"
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests, only the header"),
])
def test_an_empty_trace_file_exits_2_naming_the_flag(command, name, text, reason, tmp_path, capsys):
    trace = tmp_path / name
    trace.write_text(text)
    argv = ["--base-url", "http://127.0.0.1:1"] if command == "bench" else ["--qps", "2", "--no-progress"]
    assert main([command, "--trace", str(trace), *argv]) == 2
    assert capsys.readouterr().err == f"duetserve {command}: error: --trace {trace}: {reason}\n"


def test_bench_compare_names_a_file_that_is_no_bench_result(tmp_path, capsys):
    """Printed json's "Expecting value: ..." alone, naming neither the flag nor the file."""
    text, rows, partial = tmp_path / "passwd", tmp_path / "rows.json", tmp_path / "partial.json"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    rows.write_text("[]")  # e.g. simulate --json
    partial.write_text('{"completed": 3}')
    for path, reason in [(text, "Expecting value: line 1 column 1 (char 0)"), (rows, "a JSON list, not an object"),
                         (partial, "no 'duration', 'requests'")]:
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--compare", str(path), str(path)])
        assert exc.value.code == 2
        assert capsys.readouterr().err.endswith(
            f"duetserve bench: error: argument --compare: {path} is not a bench JSON result: {reason}\n")


def test_bench_needs_the_iteration_log_up_front_unless_a_launched_server_writes_it(tmp_path, monkeypatch, capsys):
    """It was read only after the whole run: "[Errno 2] No such file or directory: '/nonexist.jsonl'"."""
    from duetserve.bench import cli as bench_cli

    monkeypatch.setattr(bench_cli, "read_trace", lambda *a: pytest.fail("the trace was loaded first"))
    missing = tmp_path / "it.jsonl"
    assert main(["bench", "--num-requests", "2", "--qps", "2", "--iteration-log", str(missing),
                 "--plot", str(tmp_path / "b.png")]) == 2
    assert capsys.readouterr().err == (f"duetserve bench: error: --iteration-log {missing}: no such file "
                                       "(only a --launch server can write it during the run)\n")
    parser = argparse.ArgumentParser()
    bench_cli.configure_parser(parser)
    launched = parser.parse_args(["--launch", "true", "--iteration-log", str(missing)])
    bench_cli._check_iteration_log(launched)  # the server may write it
    with pytest.raises(ValueError, match=f"^--iteration-log {missing}: No such file or directory$"):
        bench_cli._spatial_times(launched)  # ... and if it did not, the plot names the flag
    missing.write_text('{"t": 1.0}\n')
    with pytest.raises(ValueError, match=f"^--iteration-log {missing}:1: KeyError: 'spatial'$"):
        bench_cli._spatial_times(launched)


def test_serve_refuses_a_bad_iteration_log_before_loading_the_model(tmp_path, monkeypatch, capsys):
    import duetserve.engine.engine as engine_module

    def no_loading(*_, **__):
        raise AssertionError("the model was loaded before --iteration-log was checked")

    monkeypatch.setattr(engine_module, "LLMEngine", no_loading)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu", "--port", "0", "--iteration-log", str(tmp_path)])
    assert exc.value.code == 2
    assert f"--iteration-log {tmp_path}: Is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("env,value,message", [
    ("DUETSERVE_DECODE_GEMM", "Triton", "DUETSERVE_DECODE_GEMM must be cublas or triton, got 'Triton'"),
    ("DUETSERVE_FUSED", "yes", "DUETSERVE_FUSED must be 0, 1 or auto, got 'yes'"),
])
def test_serve_refuses_a_bad_kernel_switch_before_loading(monkeypatch, capsys, env, value, message):
    import duetserve.engine.engine as engine_module
    from duetserve.model.layers import decode_gemm_mode

    def no_loading(*_, **__):
        raise AssertionError(f"the model was loaded before {env} was checked")

    monkeypatch.setattr(engine_module, "LLMEngine", no_loading)
    monkeypatch.setenv(env, value)
    decode_gemm_mode.cache_clear()
    try:
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--device", "cpu", "--port", "0"])
    finally:
        monkeypatch.delenv(env)
        decode_gemm_mode.cache_clear()
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["greenctx", "tpcmask"])
def test_serve_refuses_an_explicit_partition_backend_without_cuda_before_loading(monkeypatch, capsys, backend):
    import duetserve.engine.engine as engine_module

    def no_loading(*_, **__):
        raise AssertionError("the model was loaded before --partition-backend was checked")

    monkeypatch.setattr(engine_module, "load_model", no_loading)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu", "--port", "0", "--partition-backend", backend])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"duetserve serve: error: --partition-backend {backend} needs a CUDA device, not cpu; use auto or none\n")


def test_serve_refuses_a_model_file_that_is_no_gguf(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# not a model\n")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu", "--port", "0", "--model", str(readme)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"duetserve serve: error: --model {readme}: neither a model folder (with config.json) nor a .gguf file\n")


_TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 1,
               "intermediate_size": 4, "vocab_size": 10, "max_position_embeddings": 64}


@pytest.mark.parametrize("config, reason", [
    # each was a traceback: transformers' OSError (exit 1), its own size check, torch.arange building RoPE
    ('{"model_type": "llama", ', "It looks like the config file at '{folder}/config.json' is not a valid JSON file."),
    (json.dumps({**_TINY_LLAMA, "num_attention_heads": 3}), "Class validation error for validator 'validate_architecture':"),
    (json.dumps({**_TINY_LLAMA, "hidden_size": -5}), "config.json: hidden_size must be an integer >= 1, got -5"),
    (json.dumps({**_TINY_LLAMA, "num_hidden_layers": 0}), "config.json: num_hidden_layers must be an integer >= 1, got 0"),
])
def test_serve_names_the_flag_for_a_bad_config_json(tmp_path, capsys, config, reason):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(config)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu", "--port", "0", "--load-format", "dummy", "--model", str(folder)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"duetserve serve: error: --model {folder}: {reason.format(folder=folder)}" in err


@pytest.mark.parametrize("content, message", [
    (b"junk" * 8, "{path} does not start with the GGUF magic bytes, so it is not a GGUF file."),
    (b"", "cannot mmap an empty file"),
])
def test_serve_names_the_flag_for_a_gguf_file_that_is_no_gguf(tmp_path, monkeypatch, capsys, content, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    monkeypatch.setenv("DUETSERVE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu", "--port", "0", "--model", str(bad)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"duetserve serve: error: --model {bad}: {message.format(path=bad)}\n")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []  # the failed conversion's folder is gone


@pytest.mark.parametrize("flags, message", [
    (["--num-kv-blocks", "5", "--max-model-len", "200"],
     "--max-model-len 200 is more than the KV cache holds (80 tokens in 5 blocks of 16); lower it, or give the cache "
     "more (--num-kv-blocks, --kv-cache-memory-fraction, on a CPU --cpu-kv-cache-gb)"),
    # started, "serving a context of at most 1 tokens", and answered every request with a 400
    (["--num-kv-blocks", "1", "--block-size", "1"],
     "the KV cache holds 1 token(s) (1 blocks of 1): no request fits; give it more (--num-kv-blocks, --block-size, "
     "--kv-cache-memory-fraction, on a CPU --cpu-kv-cache-gb)"),
])
def test_serve_names_real_flags_when_the_kv_cache_is_too_small(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu", "--port", "0", *flags])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith(f"duetserve serve: error: {message}\n")


# SmolLM2-135M in float32 on a CPU: a 16-token block holds 2 x 30 layers x 16 x 3 KV heads x 64 x 4 bytes
# = 737,280 bytes; with the spare block, 1e11 blocks need 68,664,550.8 GiB. --cpu-kv-cache-gb 100000
# gives int(0.9 x 100000 GiB) // 737,280 - 1 = 131,071,998 blocks, 90,000.0 GiB with the spare.
@pytest.mark.parametrize("flags, message", [
    (["--num-kv-blocks", "100000000000"], "--num-kv-blocks 100000000000: the KV cache needs 68664550.8 GiB"),
    (["--cpu-kv-cache-gb", "100000"], "--cpu-kv-cache-gb 100000: the KV cache needs 90000.0 GiB"),
])
def test_serve_refuses_a_kv_cache_larger_than_the_free_memory(flags, message, capsys):
    """Refused with the flag named; before, a raw allocator traceback, or the host ran out of memory."""
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu", "--port", "0", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert re.search(rf"duetserve serve: error: {re.escape(message)}, more than the [0-9.]+ GiB free on cpu\n$", err), err


@pytest.mark.parametrize("argv", [["serve"], ["bench"], ["simulate", "--qps", "1"],
                                  ["calibrate", "--gpu-name", "x", "--out", "OUT"]])
def test_ctrl_c_exits_130_with_one_line(argv, tmp_path, monkeypatch, capsys):
    """Ctrl-C printed a KeyboardInterrupt traceback."""
    import duetserve.cli as cli_module

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "_serve", interrupted)
    for _, module, _ in cli_module.TOOLS:
        monkeypatch.setattr(module, "run", interrupted)
    assert main([str(tmp_path / "p.json") if a == "OUT" else a for a in argv]) == 130
    assert capsys.readouterr().err == f"duetserve {argv[0]}: interrupted\n"


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    version = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert exc.value.code == 0 and capsys.readouterr().out == f"duetserve {version}\n"


@pytest.mark.parametrize("argv", [["serve", "--bogus", "x"], ["bench", "--num-requests", "5", "--qps", "2", "--bogus"],
                                  ["simulate", "--bogus"], ["calibrate", "--out", "p.json", "--bogus", "1"],
                                  # a negative value is joined to its flag for argparse, shown as typed
                                  ["calibrate", "--gpu-name", "x", "--out", "p.json", "--bogus", "-5ms"]])
def test_an_unknown_flag_gets_the_subcommands_usage(argv, capsys):
    """Named before a missing required flag (``simulate --qps``, ``calibrate --gpu-name``)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith(f"usage: duetserve {argv[0]} ")
    assert err.endswith(f"duetserve {argv[0]}: error: unrecognized arguments: {' '.join(argv[argv.index('--bogus'):])}\n")


@pytest.mark.parametrize("argv,missing", [(["simulate"], "--qps"), (["calibrate"], "--gpu-name, --out"),
                                          (["calibrate", "--out", "p.json"], "--gpu-name")])
def test_a_missing_required_flag_is_named(argv, missing, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith(f"duetserve {argv[0]}: error: the following arguments are required: "
                                            f"{missing}\n")


@pytest.mark.parametrize("flags,expected", [([], "auto"), (["--trim-margin", "off"], None),
                                            (["--trim-margin", "0.85"], 0.85)])
def test_serve_trim_margin_defaults_to_auto_and_off_is_the_papers_rule(monkeypatch, capsys, flags, expected):
    import duetserve.engine.engine as engine_module

    seen = []

    def capture(config):
        seen.append(config)
        raise ValueError("stop before loading")

    monkeypatch.setattr(engine_module, "LLMEngine", capture)
    with pytest.raises(SystemExit):
        main(["serve", "--device", "cpu", "--port", "0", *flags])
    assert seen[0].trim_margin == expected
    assert "stop before loading" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_port_0_logs_the_port_it_serves_on(monkeypatch, caplog):
    """``--port 0`` logged "on http://127.0.0.1:0" while uvicorn listened on a port of its own choosing;
    now uvicorn serves on the socket that serve bound, and the log names that socket's port."""
    import uvicorn

    ports, frozen = [], []  # of the sockets uvicorn is given (closed when serve returns); gc.get_freeze_count()

    def run(self, sockets):
        ports.extend(s.getsockname()[1] for s in sockets)
        frozen.append(gc.get_freeze_count())
    monkeypatch.setattr(uvicorn.Server, "run", run)
    with caplog.at_level(logging.INFO, logger="duetserve.cli"):
        assert main(["serve", "--device", "cpu", "--port", "0", "--load-format", "dummy", "--num-kv-blocks", "64"]) == 0
    [port] = ports
    assert port != 0
    # the start-up heap was frozen while serving (no full collection rescans it) and thawed after
    assert frozen[0] > 100_000 and gc.get_freeze_count() == 0
    messages = [r.getMessage() for r in caplog.records]
    assert f"serving SmolLM2-135M-Instruct on http://127.0.0.1:{port} (policy duet, TBT SLO 100 ms)" in messages
    assert messages.count("engine stopped") == 1  # by the finally: uvicorn (stubbed) ran no app shutdown


def test_serve_logs_the_cuda_allocators_counts_at_exit(monkeypatch, caplog):
    """At exit a CUDA server logs its caching allocator's retries (each frees cached blocks, and
    cudaFree synchronizes); a CPU server logs nothing of it."""
    import logging

    import torch

    from duetserve import cli

    stats = {"num_alloc_retries": 3, "num_ooms": 0, "num_device_alloc": 41, "num_device_free": 7,
             "allocated_bytes.all.peak": 3 * 2**30}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: stats if device == "cuda:1" else {})
    with caplog.at_level(logging.INFO, logger="duetserve.cli"):
        cli._log_allocator("cpu")
        assert caplog.messages == []
        cli._log_allocator("cuda:1")
    assert caplog.messages == ["CUDA allocator: 3 retries, 0 OOMs, 41 cudaMalloc and 7 cudaFree calls, peak 3.0 GiB"]


def test_serve_refuses_a_max_model_len_over_the_models_limit_before_building_it(monkeypatch, capsys):
    """``--max-model-len 100000000`` built a RoPE table that long first and was killed for memory
    (18 GB on the CPU); the limit is now checked before the model is built."""
    from duetserve.model import loader

    def built(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(loader, "CausalLM", built)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu", "--port", "0", "--max-model-len", "100000000"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith(
        "duetserve serve: error: --max-model-len 100000000 exceeds the model's limit of 8192 positions\n")


def test_launch_takes_the_duetserve_beside_the_interpreter_when_the_path_has_none(monkeypatch, tmp_path):
    """``.venv/bin/duetserve bench --launch "duetserve serve ..."`` without an activated
    environment said "command not found: duetserve": the one beside this interpreter runs."""
    import shutil
    import sys

    from duetserve.bench.cli import _command

    beside = Path(sys.executable).parent / "duetserve"
    assert shutil.which(str(beside)), "scripts/setup.sh installs the duetserve entry point beside python"
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on the PATH
    assert _command("duetserve serve --port 8001 --tbt-slo '100 ms'") == f"{beside} serve --port 8001 --tbt-slo '100 ms'"
    with pytest.raises(ValueError, match="command not found: vllm"):
        _command("vllm serve x")
    fake = tmp_path / "duetserve"  # one on the PATH is taken as given
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert _command("duetserve serve") == "duetserve serve"
