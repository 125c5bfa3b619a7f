"""Trace readers, synthetic traces and arrival transforms (duetserve.traces)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from duetserve.traces import (
    FixedLength,
    LognormalLength,
    TraceFileError,
    TraceRequest,
    TraceSpec,
    UniformLength,
    gamma_arrivals,
    load_trace,
    parse_length,
    read_azure_csv,
    read_mooncake_jsonl,
)

REPO = Path(__file__).resolve().parents[1]
TRACE_DIRS = [REPO.parent / "shared" / "traces", Path("/work/shared/traces")]


def real_trace(name: str) -> Path:
    """Path of a shared trace file, or skip the test when it is absent."""
    for d in TRACE_DIRS:
        if (d / name).is_file():
            return d / name
    pytest.skip(f"{name} not found in {[str(d) for d in TRACE_DIRS]}")


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.0000001,110,27
2023-11-16 18:18:03.9799600,50,2"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_seven_digit_timestamps(tmp_path: Path) -> None:
    reqs = read_azure_csv(write(tmp_path, "a.csv", AZURE))
    assert [r.input_len for r in reqs] == [4808, 3180, 110, 50]
    assert [r.output_len for r in reqs] == [10, 8, 27, 2]
    assert reqs[0].arrival_s == 0.0
    assert reqs[1].arrival_s == pytest.approx(0.052, abs=1e-9)
    assert reqs[2].arrival_s == pytest.approx(1.0200401, abs=1e-9)
    assert reqs[3].arrival_s == pytest.approx(60.0, abs=1e-9)
    assert all(r.hash_ids is None for r in reqs)


def test_azure_rejects_bad_rows(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing columns"):
        read_azure_csv(write(tmp_path, "b.csv", "TIMESTAMP,Tokens\n2023-11-16 18:17:03.1,5"))
    with pytest.raises(ValueError, match=r"c.csv:3"):
        read_azure_csv(write(tmp_path, "c.csv", AZURE.replace("3180", "x")))
    with pytest.raises(ValueError, match=">= 1"):
        read_azure_csv(write(tmp_path, "d.csv", AZURE.replace(",8\n", ",0\n")))


@pytest.mark.parametrize("old, new, line, message", [
    ("\n2023-11-16 18:18:03.9799600,50,2", "\n2023-11-16 18:18:03.9799600,50", 5,  # a file cut mid-line
     "expected 3 columns (TIMESTAMP, ContextTokens, GeneratedTokens), got 2"),
    (",10\n", ",10,7\n", 2, "expected 3 columns (TIMESTAMP, ContextTokens, GeneratedTokens), got 4"),
    ("4808", "nan", 2, "ContextTokens must be a whole number >= 1, got 'nan'"),
    (",8\n", ",2.5\n", 3, "GeneratedTokens must be a whole number >= 1, got '2.5'"),
    (",8\n", ",0\n", 3, "GeneratedTokens must be a whole number >= 1, got '0'"),
    ("03.9799600", "03.97x", 2, "TIMESTAMP must be YYYY-MM-DD HH:MM:SS[.FRACTION], got '2023-11-16 18:17:03.97x'"),
    ("2023-11-16 18:17:04", "16/11/2023 18:17:04", 3,
     "TIMESTAMP must be YYYY-MM-DD HH:MM:SS[.FRACTION], got '16/11/2023 18:17:04.0319600'"),
])
def test_azure_says_what_is_wrong_with_a_row(tmp_path: Path, old: str, new: str, line: int, message: str) -> None:
    """A truncated row said "int() argument must be ... not 'NoneType'", a nan "invalid literal for int()"."""
    path = write(tmp_path, "t.csv", AZURE.replace(old, new, 1))
    with pytest.raises(TraceFileError) as exc:
        read_azure_csv(path)
    assert str(exc.value) == f"{path}:{line}: {message}"


def test_azure_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", AZURE.replace("\n2023-11-16 18:17:05", "\n\n2023-11-16 18:17:05,x"))
    with pytest.raises(TraceFileError, match=r"t.csv:5: expected 3 columns"):
        read_azure_csv(path)


def test_mooncake_reader(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [0, 2]},
        {"timestamp": 1500, "input_length": 10, "output_length": 1, "hash_ids": [3]},
    ]
    path = write(tmp_path, "m.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = read_mooncake_jsonl(path)
    assert reqs == [
        TraceRequest(0.0, 1000, 5, [0, 1]),
        TraceRequest(1.5, 600, 7, [0, 2]),
        TraceRequest(1.5, 10, 1, [3]),
    ]
    assert load_trace(path) == reqs  # format inferred from the suffix
    with pytest.raises(ValueError, match="m2.jsonl:1"):
        read_mooncake_jsonl(write(tmp_path, "m2.jsonl", '{"timestamp": 0}\n'))
    # a file cut from the middle of a trace: arrivals from its first record (bench waited 1593 s)
    late = write(tmp_path, "m3.jsonl", "\n".join(json.dumps({**x, "timestamp": x["timestamp"] + 1593000})
                                                 for x in lines) + "\n")
    assert read_mooncake_jsonl(late) == reqs


@pytest.mark.parametrize("text, message", [
    (AZURE, "a.csv:1: not a Mooncake trace (JSON lines): not JSON (Expecting value at line 1 column 1)"),
    ('{"timestamp": 0}\n', "a.csv:1: not a Mooncake trace (JSON lines): missing fields ['input_length', "
                            "'output_length']"),
    ("[1, 2]\n", "a.csv:1: not a Mooncake trace (JSON lines): not a JSON object but list"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": "x", "input_length": 5, '
     '"output_length": 2}\n', "a.csv:2: ValueError: could not convert string to float: 'x'"),
    # NaN and inf made simulate spin and bench sleep forever; 1e400 lengths raised OverflowError
    ('{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": NaN, "input_length": 5, '
     '"output_length": 2}\n', "a.csv:2: timestamp must be a finite number of ms >= 0, got nan"),
    ('{"timestamp": 1e400, "input_length": 5, "output_length": 2}\n',
     "a.csv:1: not a Mooncake trace (JSON lines): timestamp must be a finite number of ms >= 0, got inf"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": -5, "input_length": 5, '
     '"output_length": 2}\n', "a.csv:2: timestamp must be a finite number of ms >= 0, got -5"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1, "input_length": 1e400, '
     '"output_length": 2}\n', "a.csv:2: OverflowError: cannot convert float infinity to integer"),
])
def test_mooncake_reader_says_what_failed(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, "a.csv", text)
    with pytest.raises(ValueError) as exc:
        load_trace(path, TraceSpec(format="mooncake"))
    assert str(exc.value) == f"{tmp_path}/{message}"


def test_unsorted_rows_are_replayed_in_timestamp_order(tmp_path: Path) -> None:
    """Rows before the first row's timestamp arrived at negative times; now the file is sorted,
    stably (ties keep the file's order), and arrivals count from the earliest, as SGLang's
    bench_serving replays a trace."""
    shuffled = AZURE.splitlines()
    azure = "\n".join([shuffled[0], shuffled[3], shuffled[1], shuffled[4], shuffled[2],
                       shuffled[2].replace("3180", "3181")])
    reqs = read_azure_csv(write(tmp_path, "a.csv", azure))
    assert [r.input_len for r in reqs] == [4808, 3180, 3181, 110, 50]
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.052, 0.052, 1.0200401, 60.0], abs=1e-9)
    lines = [{"timestamp": 3000, "input_length": 1, "output_length": 1},
             {"timestamp": 1000, "input_length": 2, "output_length": 1},
             {"timestamp": 3000, "input_length": 3, "output_length": 1}]
    reqs = read_mooncake_jsonl(write(tmp_path, "m.jsonl", "\n".join(json.dumps(x) for x in lines)))
    assert [(r.arrival_s, r.input_len) for r in reqs] == [(0.0, 2), (2.0, 1), (2.0, 3)]


def test_a_byte_order_mark_is_dropped(tmp_path: Path) -> None:
    """Excel's "CSV UTF-8" starts with a BOM, which hid the TIMESTAMP column ("missing columns")."""
    azure, mooncake = tmp_path / "a.csv", tmp_path / "m.jsonl"
    azure.write_text(AZURE, encoding="utf-8-sig")
    mooncake.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n', encoding="utf-8-sig")
    assert [r.input_len for r in read_azure_csv(azure)] == [4808, 3180, 110, 50]
    assert read_mooncake_jsonl(mooncake) == [TraceRequest(0.0, 5, 2)]


@pytest.mark.parametrize("name, data, message", [
    ("a.csv", AZURE.encode().replace(b"3180", b"31\xff0"), "a.csv:3: not UTF-8 text (invalid start byte at byte 106)"),
    ("m.jsonl", b'{"timestamp": 0, "input_length": 5, "output_length": 2}\n\xe9\n',
     "m.jsonl:2: not UTF-8 text (invalid continuation byte at byte 56)"),
    ("a.csv", b"", "a.csv: the file is empty"),
    ("m.jsonl", b"\n \n", "m.jsonl: the file is empty"),
    ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n", "a.csv: no requests, only the header"),
])
def test_unreadable_trace_files_are_named(tmp_path: Path, name: str, data: bytes, message: str) -> None:
    """A Latin-1 file failed with "'utf-8' codec can't decode byte 0xff in position 106", naming no file;
    an empty .jsonl read as no requests, an empty .csv as missing columns."""
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(TraceFileError) as exc:
        load_trace(path)
    assert str(exc.value) == f"{tmp_path}/{message}"


def test_window_first_n_and_caps(tmp_path: Path) -> None:
    path = write(tmp_path, "a.csv", AZURE)
    reqs = load_trace(path, TraceSpec(window_s=(0.5, 61.0)))
    assert [r.input_len for r in reqs] == [110, 50]
    assert reqs[0].arrival_s == pytest.approx(0.5200401)  # measured from the window start
    reqs = load_trace(path, TraceSpec(num_requests=2, max_input_len=4000, max_output_len=9))
    assert [(r.input_len, r.output_len) for r in reqs] == [(4000, 9), (3180, 8)]
    with pytest.raises(ValueError, match="empty window"):
        load_trace(path, TraceSpec(window_s=(5.0, 5.0)))
    with pytest.raises(ValueError, match="caps"):
        load_trace(path, TraceSpec(max_input_len=0))


def test_cap_trims_hash_ids(tmp_path: Path) -> None:
    rec = {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [7, 8, 9]}
    path = write(tmp_path, "m.jsonl", json.dumps(rec))
    (req,) = load_trace(path, TraceSpec(max_input_len=600))
    assert req.input_len == 600 and req.hash_ids == [7, 8]


def test_arrival_transforms(tmp_path: Path) -> None:
    path = write(tmp_path, "a.csv", AZURE)
    scaled = load_trace(path, TraceSpec(arrival="scale", qps=3.0))
    assert scaled[0].arrival_s == 0.0
    assert scaled[-1].arrival_s == pytest.approx(1.0)  # 3 gaps at 3 req/s
    raw = load_trace(path)
    ratios = [s.arrival_s / r.arrival_s for s, r in zip(scaled[1:], raw[1:])]
    assert ratios == pytest.approx([ratios[0]] * 3)  # shape kept
    redrawn = load_trace(path, TraceSpec(arrival="poisson", qps=2.0, seed=1))
    assert [r.input_len for r in redrawn] == [r.input_len for r in raw]
    assert redrawn == load_trace(path, TraceSpec(arrival="poisson", qps=2.0, seed=1))
    assert all(r.arrival_s == 0 for r in load_trace(path, TraceSpec(arrival="scale", qps=math.inf)))
    with pytest.raises(ValueError, match="qps"):
        load_trace(path, TraceSpec(qps=2.0))  # keeping timestamps and a rate conflict
    with pytest.raises(ValueError, match="qps"):
        load_trace(path, TraceSpec(arrival="scale"))


def test_gamma_arrivals_rate_and_cv() -> None:
    rng = np.random.default_rng(0)
    for cv in (0.5, 1.0, 3.0):
        t = gamma_arrivals(20000, 5.0, cv, rng)
        gaps = np.diff(t)
        assert t[0] == 0.0 and np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(0.2, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)
    assert np.allclose(np.diff(gamma_arrivals(5, 4.0, 0.0, rng)), 0.25)
    for qps, cv in ((0.0, 1.0), (float("nan"), 1.0), (1.0, -0.5), (1.0, float("nan")), (1.0, float("inf"))):
        with pytest.raises(ValueError, match="finite cv"):  # NaN gaps made the simulator loop forever
            gamma_arrivals(5, qps, cv, rng)


def test_synthetic_trace() -> None:
    spec = TraceSpec(qps=10.0, num_requests=500, input_len=UniformLength(10, 20),
                     output_len=LognormalLength(100.0, 0.5), seed=3)
    reqs = load_trace(None, spec)
    assert len(reqs) == 500
    assert {r.input_len for r in reqs} <= set(range(10, 21))
    assert np.mean([r.output_len for r in reqs]) == pytest.approx(100, rel=0.1)
    assert reqs == load_trace(None, spec)
    faster = load_trace(None, replace(spec, qps=20.0))
    assert [r.input_len for r in faster] == [r.input_len for r in reqs]  # lengths kept
    assert faster[-1].arrival_s < reqs[-1].arrival_s
    with pytest.raises(ValueError, match="--num-requests and --qps"):
        load_trace(None, TraceSpec(qps=1.0))


def test_parse_length() -> None:
    assert parse_length("64") == FixedLength(64)
    assert parse_length("8:16") == UniformLength(8, 16)
    assert parse_length("lognormal:300:1.2") == LognormalLength(300.0, 1.2)
    for bad in ("0", "16:8", "x", "lognormal:1", "1:2:3",
                "99999999999999999999", "1:200000000", "lognormal:100:inf", "lognormal:1e308:5", "lognormal:nan:1"):
        with pytest.raises(ValueError, match="lengths in \\[1, 100000000\\] and SIGMA in \\[0, 5\\]"):
            parse_length(bad)  # huge lengths overflowed numpy; inf sigma sent max_tokens -2^63


@pytest.mark.parametrize(
    "name, rows, in_mean, out_mean, duration",
    [
        ("AzureLLMInferenceTrace_code.csv", 8819, 2047.8, 27.9, 3435.9),
        ("AzureLLMInferenceTrace_conv.csv", 19366, 1154.7, 211.1, 3501.7),
        ("mooncake_conversation_trace.jsonl", 12031, 12035.1, 342.6, 3537.0),
    ],
)
def test_real_traces(name: str, rows: int, in_mean: float, out_mean: float, duration: float) -> None:
    reqs = load_trace(real_trace(name))
    assert len(reqs) == rows
    assert np.mean([r.input_len for r in reqs]) == pytest.approx(in_mean, abs=0.05)
    assert np.mean([r.output_len for r in reqs]) == pytest.approx(out_mean, abs=0.05)
    assert reqs[-1].arrival_s - reqs[0].arrival_s == pytest.approx(duration, abs=0.05)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))


def test_real_mooncake_hash_ids() -> None:
    reqs = load_trace(real_trace("mooncake_conversation_trace.jsonl"), TraceSpec(num_requests=500))
    assert all(len(r.hash_ids or []) == math.ceil(r.input_len / 512) for r in reqs)


def test_real_azure_window() -> None:
    spec = TraceSpec(window_s=(0.0, 60.0), max_input_len=256, max_output_len=16)
    reqs = load_trace(real_trace("AzureLLMInferenceTrace_code.csv"), spec)
    assert len(reqs) > 10
    assert all(0 <= r.arrival_s < 60 and r.input_len <= 256 and r.output_len <= 16 for r in reqs)


def test_a_missing_trace_file_is_named(tmp_path):
    from duetserve.traces import resolve_format

    with pytest.raises(ValueError, match="no such trace file: .*nope.csv"):
        resolve_format(tmp_path / "nope.csv", "auto")
    with pytest.raises(ValueError, match="no such trace file"):
        resolve_format(tmp_path, "azure")  # a folder
    notes = tmp_path / "notes.md"
    notes.write_text("# not a trace\n")
    with pytest.raises(ValueError, match=r"give the format \(simulate --format, bench --trace-format\)"):
        resolve_format(notes, "auto")
    assert resolve_format(notes, "azure") == "azure"
