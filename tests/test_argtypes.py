"""The argparse types the command lines share: what each accepts, and the exact message for bad input."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from duetserve import argtypes
from duetserve.argtypes import (
    argtype,
    number,
    output_file,
    positive_duration,
    positive_int,
    rate,
    rates,
)
from duetserve.traces import parse_length


def refused(parse: Callable[[str], object], text: str) -> str:
    """The ArgumentTypeError message of ``parse(text)``."""
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        parse(text)
    return str(exc.value)


def test_argtype_turns_value_and_os_errors_into_argparse_errors():
    def parse(text: str) -> str:
        if text == "os":
            raise FileNotFoundError("gone")
        return str(int(text))

    wrapped = argtype(parse)
    assert wrapped("7") == "7" and wrapped.__name__ == "parse"
    assert refused(wrapped, "x") == "invalid literal for int() with base 10: 'x'"
    assert refused(wrapped, "os") == "gone"


def test_number_says_which_kind_was_expected():
    assert number("3", int) == 3 and number("2.5", float) == 2.5
    with pytest.raises(ValueError, match=r"^expected an integer, got '2.5'$"):
        number("2.5", int)
    with pytest.raises(ValueError, match=r"^expected a number, got 'two'$"):
        number("two", float)


def test_positive_int():
    assert positive_int("1") == 1 and positive_int(" 64 ") == 64
    assert refused(positive_int, "0") == "must be a positive integer, got '0'"
    assert refused(positive_int, "-3") == "must be a positive integer, got '-3'"
    assert refused(positive_int, "1.5") == "expected an integer, got '1.5'"


def test_non_negative_int():
    assert argtypes.non_negative_int("0") == 0 and argtypes.non_negative_int("42") == 42
    assert refused(argtypes.non_negative_int, "-1") == "must be an integer >= 0, got '-1'"
    assert refused(argtypes.non_negative_int, "x") == "expected an integer, got 'x'"


def test_rate_and_rates():
    assert rate("2.5") == 2.5 and rate("inf") == math.inf
    assert refused(rate, "0") == "must be a positive rate (req/s) or inf, got '0'"
    assert refused(rate, "nan") == "must be a positive rate (req/s) or inf, got 'nan'"
    assert refused(rate, "fast") == "expected a number, got 'fast'"
    assert rates("2, 4,8") == [2.0, 4.0, 8.0] and rates("inf") == [math.inf]
    assert refused(rates, "2,-1") == "must be a positive rate (req/s) or inf, got '-1'"
    assert refused(rates, " , ") == "give one or more rates, e.g. 2,4,8"
    # as --policy: an empty item was skipped, a repeated rate simulated or benchmarked twice
    assert refused(rates, "2,,4") == "empty item in '2,,4'"
    assert refused(rates, "2,4,") == "empty item in '2,4,'"
    assert refused(rates, "4,2,2") == "rate 2 given twice in '4,2,2'"
    assert refused(rates, "2,2.0") == "rate 2 given twice in '2,2.0'"


def test_cv():
    assert argtypes.finite_non_negative("0") == 0.0 and argtypes.finite_non_negative("1.5") == 1.5
    assert refused(argtypes.finite_non_negative, "nan") == "must be a finite number >= 0, got 'nan'"
    assert refused(argtypes.finite_non_negative, "inf") == "must be a finite number >= 0, got 'inf'"
    assert refused(argtypes.finite_non_negative, "-1") == "must be a finite number >= 0, got '-1'"
    assert refused(argtypes.finite_non_negative, "x") == "expected a number, got 'x'"


def test_positive_duration_bare_numbers_are_in_the_given_unit():
    ms, s = positive_duration("ms"), positive_duration("s")
    assert ms("100") == pytest.approx(0.1) and ms("0.5s") == 0.5 and s("600") == 600.0 and s("2min") == 120.0
    assert refused(ms, "0") == "must be a positive duration, got '0'"
    assert refused(s, "0s") == "must be a positive duration, got '0s'"
    assert refused(ms, "-5ms") == "bad duration '-5ms': a duration cannot be negative"
    assert refused(ms, "soon") == "bad duration 'soon': expected e.g. 100ms, 0.1s, 2min"


def test_pair_splits_at_the_colon_and_names_the_form():
    assert argtypes.pair("1000:32000", int, "LOW:HIGH") == (1000, 32000)
    with pytest.raises(ValueError, match=r"^expected LOW:HIGH, got '5'$"):
        argtypes.pair("5", int, "LOW:HIGH")


def test_window_is_two_durations_in_seconds():
    assert argtypes.window("0:10min") == (0.0, 600.0) and argtypes.window("1.5:2500ms") == (1.5, 2.5)
    assert refused(argtypes.window, "5:1") == "START must be before END, got '5:1'"
    assert refused(argtypes.window, "2s:2000ms") == "START must be before END, got '2s:2000ms'"
    assert refused(argtypes.window, "10") == "expected START:END, got '10'"
    assert refused(argtypes.window, "0:soon") == "bad duration 'soon': expected e.g. 100ms, 0.1s, 2min"


def test_non_empty():
    assert argtypes.non_empty("h200-lent") == "h200-lent"
    assert refused(argtypes.non_empty, "") == "must not be empty"
    assert refused(argtypes.non_empty, "  ") == "must not be empty"


def test_existing_file(tmp_path: Path):
    file = tmp_path / "trace.csv"
    file.write_text("x")
    assert argtypes.existing_file(str(file)) == file
    assert refused(argtypes.existing_file, str(tmp_path)) == f"{tmp_path} is a folder, not a file"
    assert refused(argtypes.existing_file, str(tmp_path / "none.csv")) == f"no such file: {tmp_path / 'none.csv'}"


def test_output_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "plain").write_text("x")
    assert output_file(str(tmp_path / "out.json")) == tmp_path / "out.json"
    assert refused(output_file, str(tmp_path)) == f"{tmp_path} is a folder"
    assert refused(output_file, str(tmp_path / "no" / "out.json")) == f"no such folder: {tmp_path / 'no'}"
    assert refused(output_file, str(tmp_path / "plain" / "out.json")) == f"{tmp_path / 'plain'} is not a folder"
    read_only = tmp_path / "ro.json"
    read_only.write_text("{}")
    monkeypatch.setattr(argtypes.os, "access", lambda path, mode: Path(path) != read_only)  # as if not root
    assert refused(output_file, str(read_only)) == f"{read_only} is not writable"  # failed after the run
    monkeypatch.setattr(argtypes.os, "access", lambda path, mode: False)  # as if not root and read-only
    assert refused(output_file, str(tmp_path / "out.json")) == f"folder {tmp_path} is not writable"


def test_output_file_is_opened_once_and_left_as_it_was(tmp_path: Path):
    """/proc passes the permission checks but holds no new files: that failed after the whole run."""
    assert refused(output_file, "/proc/x.json") == "/proc/x.json: No such file or directory"
    assert output_file(str(tmp_path / "new.json")) == tmp_path / "new.json"
    assert not (tmp_path / "new.json").exists()  # created to check, removed again
    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    assert output_file(str(kept)) == kept and kept.read_text() == "{}"  # opened for append: not truncated


def test_write_output_names_the_flag(tmp_path: Path):
    out = tmp_path / "out.json"
    argtypes.write_output(out, "[]", "--json")
    assert out.read_text() == "[]"
    gone = tmp_path / "gone" / "out.json"  # a folder removed during the run
    with pytest.raises(OSError) as exc:
        argtypes.write_output(gone, "[]", "--json")
    assert str(exc.value) == f"--json {gone}: No such file or directory"


def test_plot_file_needs_a_suffix_matplotlib_writes(tmp_path: Path):
    formats = argtypes.image_formats()
    assert {"png", "pdf", "svg"} <= set(formats) and "txt" not in formats
    use = f"use one of {', '.join('.' + f for f in formats)}"
    assert argtypes.plot_file(str(tmp_path / "p.png")) == tmp_path / "p.png"
    assert argtypes.plot_file(str(tmp_path / "p.PDF")) == tmp_path / "p.PDF"
    assert refused(argtypes.plot_file, str(tmp_path / "p.txt")) == \
        f"{tmp_path / 'p.txt'}: matplotlib cannot write .txt images; {use}"
    assert refused(argtypes.plot_file, str(tmp_path / "p")) == f"{tmp_path / 'p'} has no image suffix; {use}"
    assert refused(argtypes.plot_file, str(tmp_path / "no" / "p.png")) == f"no such folder: {tmp_path / 'no'}"


def test_length_options_parse_their_defaults_too():
    parser = argparse.ArgumentParser()
    argtypes.add_length_options(parser.add_argument_group("trace"))
    args = parser.parse_args(["--input-len", "100:200"])
    assert args.input_len == parse_length("100:200") and args.output_len == parse_length("128")
    assert "(default 512)" in " ".join(parser.format_help().split())  # undo the line wrapping


def test_a_parser_names_the_flag(capsys: pytest.CaptureFixture[str]):
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--qps", type=rates)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--qps", "0"])
    assert exc.value.code == 2
    assert "tool: error: argument --qps: must be a positive rate (req/s) or inf, got '0'\n" in capsys.readouterr().err


def test_exit_status_is_2_for_a_usage_error_and_1_for_any_other(capsys: pytest.CaptureFixture[str]):
    assert argtypes.exit_status("bench", argtypes.UsageError("give either --qps or --sweep-qps")) == 2
    assert argtypes.exit_status("bench", OSError("server not reachable")) == 1
    assert capsys.readouterr().err == ("duetserve bench: error: give either --qps or --sweep-qps\n"
                                       "duetserve bench: error: server not reachable\n")


def test_join_negative_values_writes_flag_equals_value():
    assert argtypes.join_negative_values(["bench", "--tbt-slo", "-5ms", "--qps", "-2,4", "--window", "-5:10"]) == [
        "bench", "--tbt-slo=-5ms", "--qps=-2,4", "--window=-5:10"]
    assert argtypes.join_negative_values(["--cv", "-.5", "--seed", "-1"]) == ["--cv=-.5", "--seed=-1"]
    # left alone: positive values, an option after a flag, a flag with =, a short flag, anything after --
    for argv in (["--qps", "2"], ["--tbt-slo", "--qps"], ["--tbt-slo=1", "-5"], ["-h", "-5"], ["--", "--qps", "-5"]):
        assert argtypes.join_negative_values(argv) == argv


def test_trace_format_resolves_or_names_the_flag(tmp_path):
    csv, txt = tmp_path / "t.csv", tmp_path / "t.txt"
    csv.write_text("x")
    txt.write_text("x")
    assert argtypes.trace_format(csv, "auto", "--format") == "azure"
    assert argtypes.trace_format(None, "auto", "--format") == "synthetic"
    assert argtypes.trace_format(txt, "mooncake", "--trace-format") == "mooncake"
    with pytest.raises(argtypes.UsageError, match=r"^--trace FILE is required with --trace-format azure$"):
        argtypes.trace_format(None, "azure", "--trace-format")
    with pytest.raises(argtypes.UsageError, match=r"^--format synthetic generates requests: drop --trace .*t\.csv, or "
                                                  r"give its format$"):  # the file was ignored
        argtypes.trace_format(csv, "synthetic", "--format")
    with pytest.raises(argtypes.UsageError, match=r"^cannot infer the trace format of .*t\.txt from its suffix"):
        argtypes.trace_format(txt, "auto", "--format")
    with pytest.raises(argtypes.UsageError, match=r"^no such trace file: .*missing\.csv$"):
        argtypes.trace_format(tmp_path / "missing.csv", "auto", "--format")


def test_trim_margin_is_auto_or_a_fraction():
    assert argtypes.trim_margin("auto") == "auto" and argtypes.trim_margin("0.85") == 0.85
    assert argtypes.trim_margin("off") is None
    assert argtypes.trim_margin("1") == 1.0
    for bad in ("0", "1.5", "-0.5", "nan", "sometimes", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=r"must be a number in \(0, 1\], auto or off"):
            argtypes.trim_margin(bad)
