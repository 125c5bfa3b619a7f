"""``duetserve simulate`` end to end on small synthetic traces, and its input errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_jsonio import strict_loads

import duetserve.planner
from duetserve import argtypes
from duetserve.cli import main
from duetserve.sim import cli as sim_cli

SMALL = ["simulate", "--format", "synthetic", "--num-requests", "40", "--input-len", "500:3000",
         "--output-len", "10:60", "--no-progress"]
KEYS = {"policy", "qps", "request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tbt_ms",
        "p50_tbt_ms", "p99_tbt_ms", "tbt_slo_attainment", "spatial_fraction"}


def test_end_to_end_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "rows.json", tmp_path / "plot.png"
    assert main([*SMALL, "--qps", "2,20", "--policy", "all", "--tbt-slo", "100ms", "--model-config", "qwen3-8b",
                 "--gpu", "h200", "--json", str(out_json), "--plot", str(out_png)]) == 0
    rows = json.loads(out_json.read_text())
    assert [(r["policy"], r["qps"]) for r in rows] == [
        (p, q) for p in ("chunked", "prefill-first", "duet", "pdmux") for q in (2.0, 20.0)]
    for row in rows:
        assert KEYS <= set(row) and row["completed"] == 40
        assert 0 <= row["tbt_slo_attainment"] <= 1 and 0 <= row["spatial_fraction"] <= 1
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "TBT ms mean" in printed and "TTFT ms mean" in printed and "chunked" in printed and "req/s" in printed


def test_json_is_strict_with_an_infinite_qps(tmp_path):
    """``--qps inf`` wrote a bare ``Infinity`` (not JSON: JavaScript's JSON.parse refuses the file)."""
    out = tmp_path / "rows.json"
    assert main([*SMALL, "--qps", "inf", "--policy", "chunked", "--json", str(out)]) == 0
    (row,) = strict_loads(out.read_text())
    assert row["qps"] == "inf" and row["completed"] == 40


def test_model_config_file_and_single_policy(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                                  "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                                  "tie_word_embeddings": True}))
    assert main([*SMALL, "--qps", "5", "--policy", "duet", "--model-config", str(config),
                 "--partition-backend", "tpcmask", "--max-num-batched-tokens", "2048"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("duet") and len([x for x in lines if x.startswith("duet ")]) == 1


def test_trim_margin_auto_is_accepted(capsys):
    assert main([*SMALL, "--qps", "5", "--policy", "duet", "--trim-margin", "auto", "--model-config", "qwen3-8b"]) == 0
    assert any(line.startswith("duet") for line in capsys.readouterr().out.splitlines())


def test_a_short_light_run_keeps_up(tmp_path, capsys):
    """``simulate --format synthetic --qps 2 --num-requests 20``: 1.77 requests a second finished
    over the whole run (the last one's drain included), and every policy was reported as "did
    not keep up". Between their first and last events requests finish as fast as they arrive."""
    out = tmp_path / "rows.json"
    assert main(["simulate", "--format", "synthetic", "--qps", "2", "--num-requests", "20", "--policy", "chunked",
                 "--json", str(out), "--no-progress"]) == 0
    (r,) = json.loads(out.read_text())
    assert r["request_throughput"] < 0.9 * 2 and r["completion_rate"] == pytest.approx(r["arrival_rate"], rel=0.1)
    assert "chunked: p99 TBT within 100 ms and keeping up until qps 2" in capsys.readouterr().out


def test_prediction_error_changes_the_run_and_the_seed_repeats_it(tmp_path, capsys):
    """``--prediction-error`` reaches the simulator: the rows differ from exact predictions, and
    the same ``--seed`` gives the same rows."""
    def rows(*extra):
        out = tmp_path / f"rows{len(list(tmp_path.iterdir()))}.json"
        assert main([*SMALL, "--qps", "5", "--policy", "chunked", "--json", str(out), *extra]) == 0
        return [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in json.loads(out.read_text())]
    exact, noisy = rows(), rows("--prediction-error", "0.2", "--seed", "3")
    assert noisy != exact and noisy == rows("--prediction-error", "0.2", "--seed", "3")
    assert noisy[0]["mean_ttft_ms"] != exact[0]["mean_ttft_ms"]


def test_num_decode_steps_reaches_the_simulator(tmp_path, capsys):
    """``--num-decode-steps``, serve's flag (default 8): decode-only iterations of up to N steps,
    each counting the host time once, so the same load decodes with shorter token gaps than
    with 1 (off)."""
    def row(*extra):
        out = tmp_path / f"rows{len(list(tmp_path.iterdir()))}.json"
        assert main([*SMALL, "--qps", "1", "--policy", "chunked", "--json", str(out), *extra]) == 0
        return json.loads(out.read_text())[0]
    single, four, default = row("--num-decode-steps", "1"), row("--num-decode-steps", "4"), row()
    assert default["p50_tbt_ms"] < four["p50_tbt_ms"] < single["p50_tbt_ms"]


def test_graph_flags_reach_the_simulator(tmp_path, capsys):
    """``--enforce-eager`` prices every iteration eager (decode graphs off too), and
    ``--piecewise-cuda-graph-max-tokens 0`` only the piecewise ones: on the h200 profile each
    step off lengthens the same load's token gaps (eager decodes launch ~400 kernels from the
    host) and its time to first token (mixed iterations up to 1024 tokens lose their graphs)."""
    def row(*extra):
        out = tmp_path / f"rows{len(list(tmp_path.iterdir()))}.json"
        assert main([*SMALL, "--qps", "1", "--policy", "chunked", "--json", str(out), *extra]) == 0
        return json.loads(out.read_text())[0]
    default, no_piecewise, eager = row(), row("--piecewise-cuda-graph-max-tokens", "0"), row("--enforce-eager")
    assert default["mean_ttft_ms"] < no_piecewise["mean_ttft_ms"] < eager["mean_ttft_ms"]
    assert default["p50_tbt_ms"] == pytest.approx(no_piecewise["p50_tbt_ms"])
    assert default["p50_tbt_ms"] * 2 < eager["p50_tbt_ms"]


def test_clock_profile_reaches_the_simulator_and_must_match_the_sm_count(tmp_path, capsys):
    """``--clock-profile``: iterations take its times (a clock with 2x the decode interference
    slows duet's splits, so the rows differ, while ``--gpu`` as the clock changes nothing); a
    profile of another SM count is refused naming the flags."""
    profiles = Path(duetserve.planner.__file__).parent / "profiles"
    slow = json.loads((profiles / "h200.json").read_text())
    slow["decode_interference"] *= 2
    (tmp_path / "slow.json").write_text(json.dumps(slow))

    def rows(*extra):
        out = tmp_path / f"rows{len(list(tmp_path.iterdir()))}.json"
        assert main(["simulate", "--format", "synthetic", "--num-requests", "60", "--input-len", "6000",
                     "--output-len", "50", "--qps", "8", "--policy", "duet", "--no-progress",
                     "--json", str(out), *extra]) == 0
        return [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in json.loads(out.read_text())]
    exact = rows()
    assert rows("--clock-profile", "h200") == exact
    # each QPS starts a fresh policy, as a fresh server: the QPS-8 row does not depend on a run before it
    slow_path = str(tmp_path / "slow.json")
    swept = rows("--clock-profile", slow_path, "--qps", "4,8")
    assert swept[1] == rows("--clock-profile", slow_path)[0] and swept[0]["qps"] == 4
    (biased,) = rows("--clock-profile", str(tmp_path / "slow.json"))
    # splits run slower than planned: duet's feedback backs off them (8.8% of the iterations against 0.8%
    # on the shipped profile) and the token gaps lengthen
    assert exact[0]["spatial_fraction"] > 5 * biased["spatial_fraction"] > 0
    assert biased["mean_tbt_ms"] > exact[0]["mean_tbt_ms"]
    capsys.readouterr()
    assert main([*SMALL, "--qps", "2", "--clock-profile", "a100"]) == 2
    assert capsys.readouterr().err == ("duetserve simulate: error: --clock-profile: the clock profile 'a100' has "
                                       "108 SMs, the planner's 'h200' 132 (--gpu)\n")


def test_context_limit_defaults_to_the_models(tmp_path, capsys):
    """Without ``--max-model-len`` the simulated server takes the model's context, as ``serve`` does
    (Qwen3-8B: 40960 tokens), and refuses what serve refuses: a 41000-token prompt, and a 40000-token
    prompt asking for 2000 tokens (the scheduler alone would cut its output at the limit).
    ``--max-model-len`` above the model's limit, and a trace whose every prompt is too long, are
    refused naming the flags."""
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,41000,8\n"
                     "2023-11-16 18:15:47.0,1000,8\n2023-11-16 18:15:48.0,40000,2000\n")

    def row(*extra):
        out = tmp_path / f"rows{len(list(tmp_path.iterdir()))}.json"
        assert main(["simulate", "--trace", str(trace), "--qps", "1", "--policy", "chunked", "--no-progress",
                     "--json", str(out), *extra]) == 0
        return json.loads(out.read_text())[0]
    assert (row()["completed"], row()["failed"]) == (1, 2)
    assert (row("--max-model-len", "2000")["completed"], row("--max-model-len", "2000")["failed"]) == (1, 2)
    capsys.readouterr()
    assert main(["simulate", "--trace", str(trace), "--qps", "1", "--no-progress", "--max-model-len", "42000"]) == 2
    assert capsys.readouterr().err == ("duetserve simulate: error: --max-model-len 42000 exceeds the model's limit "
                                       "of 40960 positions (--model-config)\n")
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,41000,8\n")
    assert main(["simulate", "--trace", str(trace), "--qps", "1", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        "duetserve simulate: error: the model's context of 40960 tokens (--model-config; --max-model-len sets "
        "another) holds no request of the trace: the shortest needs 41008 tokens of prompt and output\n")


@pytest.mark.parametrize("args, flag", [
    (["--qps", "2", "--policy", "fastest"], "--policy"),
    (["--qps", "fast"], "--qps"),
    (["--qps", "2,-1"], "--qps"),
    (["--qps", "2", "--trace", "/no/such/trace.csv"], "--trace"),
    (["--qps", "2", "--tbt-slo", "soon"], "--tbt-slo"),
    (["--qps", "2", "--model-config", "gpt-5"], "--model-config"),
    (["--qps", "2", "--gpu", "b300"], "--gpu"),
    (["--qps", "2", "--window", "10"], "--window"),
    (["--qps", "2", "--window", "5s:1s"], "--window"),
    (["--qps", "2", "--trim-margin", "1.2"], "--trim-margin"),
    (["--qps", "2", "--num-decode-steps", "0"], "--num-decode-steps: must be in [1, 256], got '0'"),
    (["--qps", "2", "--num-decode-steps", "300"], "--num-decode-steps: must be in [1, 256], got '300'"),
    (["--qps", "2", "--num-decode-steps", "two"], "--num-decode-steps: expected an integer, got 'two'"),
    (["--qps", "2,,4"], "--qps: empty item in '2,,4'"),
    (["--qps", "4,2,2"], "--qps: rate 2 given twice in '4,2,2'"),
    (["--qps", "2", "--policy", "duet,,chunked"], "--policy: empty item in 'duet,,chunked'"),
    (["--qps", "2", "--policy", "duet,chunked,duet"], "--policy: policy 'duet' given twice in 'duet,chunked,duet'"),
])
def test_bad_flags_are_usage_errors_naming_the_flag(args, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, *args])
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--qps", "2", "--tbt-slo", "-5ms"], "argument --tbt-slo: bad duration '-5ms': a duration cannot be negative"),
    (["--qps", "-2,4"], "argument --qps: must be a positive rate (req/s) or inf, got '-2'"),
    (["--qps", "2", "--input-len", "-5:10"],
     "argument --input-len: bad length '-5:10': expected N, LOW:HIGH or lognormal:MEAN:SIGMA with lengths in "
     "[1, 100000000] and SIGMA in [0, 5]"),
    (["--qps", "2", "--trim-margin", "-.5"], "argument --trim-margin: must be a number in (0, 1], auto or off, got '-.5'"),
])
def test_a_negative_value_after_a_space_is_the_flags_value(args, message, capsys):
    """``--tbt-slo -5ms`` was read as an unknown option: "argument --tbt-slo: expected one argument"."""
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, *args])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith(f"\nduetserve simulate: error: {message}\n")


def test_missing_qps_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(SMALL)
    assert "--qps" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["simulate", "--format", "azure", "--qps", "2"], "--trace FILE is required with --format azure"),
    (["simulate", "--format", "synthetic", "--qps", "2"], "--num-requests is required for a synthetic trace"),
    ([*SMALL, "--qps", "2", "--policy", "pdmux", "--partition-backend", "none"],
     "--policy pdmux needs an SM partition backend (greenctx or tpcmask); the partition backend is 'none'"),
    ([*SMALL, "--qps", "2", "--kv-cache-tokens", "10"],
     "--kv-cache-tokens 10 is less than one KV block of 16 tokens (--block-size)"),
    ([*SMALL, "--qps", "2", "--kv-cache-tokens", "100"],
     "the KV cache of 96 tokens (from --kv-cache-tokens) holds no request of the synthetic trace (--input-len, "
     "--output-len): the shortest needs 521 tokens of prompt and output"),
    ([*SMALL, "--qps", "2", "--gpu-memory-utilization", "0.01"],  # exited 1 naming no flag
     ("--gpu-memory-utilization 0.01 of the h200's memory (--gpu) leaves nothing for the KV cache after the model's "
      "weights (--model-config); raise it, or give --kv-cache-tokens")),
    ([*SMALL, "--qps", "2", "--tp", "3"],  # printed a ModelShape(...) repr
     "--tp 3: the model's 32 query heads and 8 KV heads are not divisible by 3"),
    ([*SMALL, "--qps", "2", "--max-model-len", "10"],
     "--max-model-len 10 holds no request of the synthetic trace (--input-len, --output-len): the shortest needs "
     "521 tokens of prompt and output"),
    ([*SMALL, "--qps", "2", "--max-model-len", "510"],  # room for the shortest prompt, not its output: exited 1
     "--max-model-len 510 holds no request of the synthetic trace (--input-len, --output-len): the shortest "
     "needs 521 tokens of prompt and output"),
    ([*SMALL, "--qps", "2", "--window", "1000:2000"],
     "the trace selection holds no requests (see --window and --num-requests)"),
])
def test_flags_that_do_not_fit_together_are_usage_errors(args, message, capsys):
    """Checked after parsing, named in the message; exited 1, as a failure of the run, before."""
    assert main(args) == 2
    assert capsys.readouterr().err == f"duetserve simulate: error: {message}\n"


def test_a_trace_suffix_that_tells_no_format_is_a_usage_error(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("x\n")
    assert main(["simulate", "--trace", str(trace), "--qps", "2"]) == 2
    assert capsys.readouterr().err == (
        f"duetserve simulate: error: cannot infer the trace format of {trace} from its suffix (.csv: azure, "
        ".jsonl: mooncake); give the format (simulate --format, bench --trace-format)\n")


def test_a_malformed_trace_is_a_usage_error_naming_the_flag(tmp_path, capsys):
    """Exit 2 naming --trace, as an empty .jsonl trace did ("holds no requests"); it exited 1."""
    trace = tmp_path / "trace.csv"
    trace.write_text("a,b\n1,2\n")
    assert main(["simulate", "--trace", str(trace), "--qps", "2", "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"duetserve simulate: error: --trace {trace}: not an Azure trace, missing "
                                       "columns ['ContextTokens', 'GeneratedTokens', 'TIMESTAMP']\n")


def test_cv_with_arrival_scale_on_a_trace_file_is_refused(tmp_path, capsys):
    """--arrival scale keeps the trace's own gaps: --cv was ignored silently."""
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,10\n")
    assert main(["simulate", "--trace", str(trace), "--qps", "2", "--arrival", "scale", "--cv", "3"]) == 2
    assert capsys.readouterr().err == ("duetserve simulate: error: --cv 3 does nothing with --arrival scale: a trace "
                                       "file keeps its own gaps (--arrival poisson draws gaps of that CV)\n")


def test_arrival_scale_of_coincident_arrivals_is_a_usage_error(tmp_path, capsys):
    """Requests that all arrive at once have no rate to scale: exit status 2 naming --arrival (it
    was 1, an "other error", against what --help says of flags that do not fit the trace)."""
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "2023-11-16 18:15:46.6805900,100,10\n" * 3)
    assert main(["simulate", "--trace", str(trace), "--qps", "2", "--arrival", "scale", "--no-progress"]) == 2
    assert capsys.readouterr().err == ("duetserve simulate: error: --arrival scale: the selected requests all arrive "
                                       "at the same time, so there is no rate to scale; use --arrival poisson\n")


def test_all_without_partition_backend_leaves_pdmux_out(capsys):
    assert main([*SMALL, "--qps", "3", "--partition-backend", "none"]) == 0
    captured = capsys.readouterr()
    assert "pdmux left out" in captured.err and "pdmux" not in captured.out


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_unwritable_outputs_fail_before_simulating(flag, tmp_path, monkeypatch, capsys):
    simulated = []
    monkeypatch.setattr(sim_cli, "simulate", lambda *a, **k: simulated.append(a))
    for path, words in [(tmp_path / "no" / "out", f"argument {flag}: no such folder: {tmp_path / 'no'}"),
                        (tmp_path, f"argument {flag}: {tmp_path} is a folder"),
                        ("/proc/out", f"argument {flag}: /proc/out: No such file or directory")]:
        with pytest.raises(SystemExit) as exc:
            main([*SMALL, "--qps", "2", flag, str(path)])
        assert exc.value.code == 2 and words in capsys.readouterr().err
    monkeypatch.setattr(argtypes.os, "access", lambda path, mode: False)  # as if not root and read-only
    with pytest.raises(SystemExit):
        main([*SMALL, "--qps", "2", flag, str(tmp_path / "out")])
    assert f"argument {flag}: folder {tmp_path} is not writable" in capsys.readouterr().err
    assert simulated == []


def test_model_config_file_that_is_not_a_json_config(tmp_path, capsys):
    """Said only "Expecting value: line 1 column 1 (char 0)" before."""
    text, listed, empty = tmp_path / "passwd", tmp_path / "list.json", tmp_path / "empty.json"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    listed.write_text("[1, 2]")
    empty.write_text("{}")
    for path, reason in [(text, "Expecting value: line 1 column 1 (char 0)"),
                         (listed, "a JSON list, not an object"), (empty, "config has no 'hidden_size'")]:
        with pytest.raises(SystemExit) as exc:
            main([*SMALL, "--qps", "2", "--model-config", str(path)])
        assert exc.value.code == 2
        assert f"error: argument --model-config: {path} is not a JSON model config: {reason}\n" \
            in capsys.readouterr().err
    presets = "llama3-8b, qwen3-14b, qwen3-8b, smollm2-135m"
    for text, where in [("/nonexistent.json", ""), (str(tmp_path), " (a folder without config.json)")]:
        with pytest.raises(SystemExit):  # was "unknown model preset '/nonexistent.json'"
            main([*SMALL, "--qps", "2", "--model-config", text])
        assert (f"error: argument --model-config: {text!r} is neither a model preset ({presets}) nor a file{where}\n"
                in capsys.readouterr().err)


def test_plot_format_is_checked_before_simulating(tmp_path, monkeypatch, capsys):
    """A .txt plot failed in matplotlib only after every simulation had run."""
    monkeypatch.setattr(sim_cli, "simulate", lambda *a, **k: pytest.fail("simulated before checking --plot"))
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, "--qps", "2", "--plot", str(tmp_path / "x.txt")])
    assert exc.value.code == 2
    assert f"error: argument --plot: {tmp_path / 'x.txt'}: matplotlib cannot write .txt images; use one of " \
        in capsys.readouterr().err


def test_policy_takes_a_comma_separated_list(capsys):
    from duetserve.cli import main

    assert main(["simulate", "--format", "synthetic", "--num-requests", "10", "--qps", "4", "--policy",
                 "duet, chunked", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "duet " in printed and "chunked " in printed and "prefill-first" not in printed
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--format", "synthetic", "--num-requests", "10", "--qps", "4", "--policy", "duet,fast"])
    assert exc.value.code == 2 and "argument --policy: unknown policy 'fast'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # said "unknown policy 'all': use ... or all"
        main(["simulate", "--format", "synthetic", "--num-requests", "10", "--qps", "4", "--policy", "all,duet"])
    assert exc.value.code == 2 and "argument --policy: 'all' cannot be listed with other policies: give all " \
        "alone, or a list of policies" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--cv", "nan"], "argument --cv: must be a finite number >= 0, got 'nan'"),  # looped forever
    (["--cv", "-1"], "argument --cv: must be a finite number >= 0, got '-1'"),
    (["--gpu-memory-utilization", "2"], "argument --gpu-memory-utilization: must be in (0, 1], got '2'"),
    (["--gpu-memory-utilization", "0"], "argument --gpu-memory-utilization: must be in (0, 1], got '0'"),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),  # numpy's message, unnamed
    (["--prediction-error", "-0.1"], "argument --prediction-error: must be a number in [0, 1], got '-0.1'"),
    (["--prediction-error", "1000"], "argument --prediction-error: must be a number in [0, 1], got '1000'"),
    (["--prediction-error", "nan"], "argument --prediction-error: must be a number in [0, 1], got 'nan'"),
    # was "the KV cache of 0 tokens (from --gpu and --gpu-memory-utilization) holds no request", not naming it
    (["--block-size", "100000000"],
     "argument --block-size: must be one of 1, 8, 16, 32, 64, 128, 256, got '100000000'"),
    (["--block-size", "24"], "argument --block-size: must be one of 1, 8, 16, 32, 64, 128, 256, got '24'"),
])
def test_bad_values_name_the_flag(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, "--qps", "2", *args])
    assert exc.value.code == 2
    assert f"duetserve simulate: error: {message}\n" in capsys.readouterr().err


def test_a_truncated_azure_trace_names_the_line_and_what_is_wrong(tmp_path, capsys):
    """Said "int() argument must be a string, a bytes-like object or a real number, not 'NoneType'"."""
    trace = tmp_path / "trunc.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,10\n"
                     "2023-11-16 18:15:47.1000000,81")
    assert main(["simulate", "--trace", str(trace), "--qps", "2", "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"duetserve simulate: error: --trace {trace}:3: expected 3 columns "
                                       "(TIMESTAMP, ContextTokens, GeneratedTokens), got 2\n")


def test_token_budget_defaults_to_serves_on_cuda():
    """``simulate --max-num-batched-tokens`` defaults to the budget ``serve`` gives an engine on
    CUDA (8192; on a CPU 512), both from one constant."""
    import argparse

    from duetserve.cli import _add_serve, _engine_config
    from duetserve.sim.cli import configure_parser

    parser = argparse.ArgumentParser()
    _add_serve(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert _engine_config(args, parser, "cuda").max_num_batched_tokens == 8192
    assert _engine_config(args, parser, "cpu").max_num_batched_tokens == 512
    simulate = argparse.ArgumentParser()
    configure_parser(simulate)
    assert simulate.parse_args(["--format", "synthetic", "--qps", "1"]).max_num_batched_tokens == 8192
    from duetserve.sim.simulator import SimConfig
    assert SimConfig.__dataclass_fields__["max_num_batched_tokens"].default == 8192  # the library's default too


def test_max_num_seqs_defaults_to_serves(tmp_path, capsys):
    """``--max-num-seqs`` defaults to serve's 256 (the simulator predicts the server as launched):
    100 requests at once wait for room beyond 64 running sequences, which the default does not
    make them do; 256 given is the default run."""
    import argparse

    from duetserve.cli import _add_serve
    from duetserve.config import EngineConfig

    parser = argparse.ArgumentParser()
    _add_serve(parser.add_subparsers())
    assert parser.parse_args(["serve"]).max_num_seqs == EngineConfig().max_num_seqs == 256

    def row(*extra):
        out = tmp_path / f"rows{len(list(tmp_path.iterdir()))}.json"
        assert main(["simulate", "--format", "synthetic", "--num-requests", "100", "--qps", "1000", "--input-len", "64",
                     "--output-len", "64", "--policy", "chunked", "--no-progress", "--json", str(out), *extra]) == 0
        return json.loads(out.read_text())[0]
    default, wide, narrow = row(), row("--max-num-seqs", "256"), row("--max-num-seqs", "64")
    assert default == {**wide, "sim_wall_s": default["sim_wall_s"]}
    assert default["mean_ttft_ms"] * 2 < narrow["mean_ttft_ms"]
