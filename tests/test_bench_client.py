"""duetserve bench against fake OpenAI-compatible servers on 127.0.0.1 (uvicorn in a thread).

Run as a script (``python test_bench_client.py --serve PORT``) this file serves the
well-behaved fake server, for the ``--launch`` tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from test_jsonio import strict_loads

from duetserve.bench.cli import configure_parser, run
from duetserve.bench.launch import LaunchConfig, ServerProcess, launched_base_url
from duetserve.bench.plot import read_iteration_log
from duetserve.bench.prompts import COMMON_WORDS, PromptBuilder
from duetserve.bench.runner import fetch_model_id
from duetserve.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

MISBEHAVIOURS = ("ok", "http500", "abort", "truncate", "short", "hang")


def fake_app(misbehave: bool = False, token_gap_s: float = 0.002) -> FastAPI:
    """A streaming OpenAI-style server. Misbehaving, the n-th request gets
    ``MISBEHAVIOURS[n % 6]``: ok, HTTP 500, connection dropped mid-stream, stream ended
    without [DONE], one token short, or no answer at all."""
    app = FastAPI()
    counter = itertools.count()
    app.state.in_flight = 0
    app.state.max_in_flight = 0

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def tokens(body: dict[str, Any], mode: str, chat: bool) -> AsyncIterator[str]:
        app.state.in_flight += 1
        app.state.max_in_flight = max(app.state.max_in_flight, app.state.in_flight)
        try:
            n = body["max_tokens"]
            prompt = body["messages"][0]["content"].split() if chat else body["prompt"]
            sent = n - 1 if mode == "short" else n
            if chat:  # like vLLM: a first chunk with the role and no text
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(sent):
                if i == n // 2 and mode == "abort":
                    raise RuntimeError("connection dropped by the fake server")
                if i == n // 2 and mode == "truncate":
                    return
                await asyncio.sleep(token_gap_s)
                piece = {"delta": {"content": " tok"}} if chat else {"text": " tok"}
                yield _sse({"choices": [{"index": 0, **piece, "finish_reason": None}]})
            usage = {"prompt_tokens": len(prompt), "completion_tokens": sent}
            yield _sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            app.state.in_flight -= 1

    async def respond(request: Request, chat: bool) -> Any:
        body = await request.json()
        mode = MISBEHAVIOURS[next(counter) % len(MISBEHAVIOURS)] if misbehave else "ok"
        wanted = body.get("stream") and body.get("ignore_eos") and body["stream_options"]["include_usage"]
        if not wanted or body["model"] != "fake-model":
            return JSONResponse({"error": {"message": "bad request"}}, 400)
        if mode == "http500":
            return JSONResponse({"error": {"message": "internal error"}}, 500)
        if mode == "hang":
            await asyncio.sleep(30)
        return StreamingResponse(tokens(body, mode, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await respond(request, chat=True)

    return app


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` on a free 127.0.0.1 port in a thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return run(parser.parse_args(["--no-progress", *argv]))


SYNTHETIC = ["--qps", "50", "--num-requests", "12", "--input-len", "16:64", "--output-len", "4:12"]


def test_misbehaving_server_failures_are_counted(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "r.json"
    with serving(fake_app(misbehave=True)) as url:
        code = bench(["--base-url", url, *SYNTHETIC, "--request-timeout", "1s", "--result-file", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 2 and result["failed"] == 10
    reasons = " | ".join(r["error"] for r in result["requests"] if r["error"])
    for expected in ("HTTP 500", "RemoteProtocolError", "before data: [DONE]", "output tokens, got",
                     "timeout after 1 s"):
        assert reasons.count(expected) == 2, expected
    assert sum(result["failure_reasons"].values()) == 10
    report = capsys.readouterr().out
    assert re.search(r"failed\s+10", report) and "Failures" in report


def test_a_run_where_every_request_fails_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions() -> Any:
        return JSONResponse({"error": {"message": "internal error"}}, 500)

    out = tmp_path / "r.json"
    with serving(app) as url:
        assert bench(["--base-url", url, *SYNTHETIC, "--result-file", str(out)]) == 2
    assert json.loads(out.read_text())["failed"] == 12
    assert "every request failed at qps 50" in capsys.readouterr().err


def test_well_behaved_server_completions(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    # SLOs far above the fake server's 2 ms token gaps: a 2-core CI machine once stalled a gap past
    # 100 ms (attainment 0.978); here only a bench that mis-measures misses them
    args = [*SYNTHETIC, "--goodput", "ttft:5s", "tpot:1000", "--tbt-slo", "2s",
            "--result-file", str(out), "--plot", str(png)]
    with serving(fake_app()) as url:
        assert bench(["--base-url", url, *args]) == 0
    result = json.loads(out.read_text())
    for key in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput", "tbt_slo_attainment", "model_id", "start_time_unix", "requests"):
        assert result[key] is not None, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert isinstance(result[f"{stat}_{metric}_ms"], float)
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["model_id"] == "fake-model"
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["tbt_slo_attainment"] == 1.0
    for r in result["requests"]:
        assert r["output_tokens"] == r["output_len"] and r["prompt_tokens"] == r["input_len"]
        assert 0 < r["ttft_s"] < r["e2el_s"]
        assert len(r["itls_s"]) == r["output_len"] - 1
    assert result["total_output_tokens"] == sum(r["output_len"] for r in result["requests"])
    assert png.stat().st_size > 10_000
    assert "Time to First Token" in capsys.readouterr().out


def test_a_result_file_that_cannot_be_written_after_the_run_names_the_flag(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Checked before the run (argtypes.output_file); a folder removed during the run printed only
    "[Errno 2] No such file or directory: '...'"."""
    from duetserve.bench import cli as bench_cli

    folder = tmp_path / "results"
    folder.mkdir()
    out = folder / "r.json"
    run_benchmark = bench_cli.run_benchmark

    async def removing_the_folder(*args: Any) -> Any:
        folder.rmdir()
        return await run_benchmark(*args)

    monkeypatch.setattr(bench_cli, "run_benchmark", removing_the_folder)
    with serving(fake_app()) as url:
        assert bench(["--base-url", url, *SYNTHETIC, "--result-file", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.err.endswith(f"duetserve bench: error: --result-file {out}: No such file or directory\n")
    assert "Serving Benchmark Result" in captured.out  # the report was printed first


def test_concurrency_cap(tmp_path: Path) -> None:
    app = fake_app(token_gap_s=0.01)
    out = tmp_path / "r.json"
    with serving(app) as url:
        assert bench(["--base-url", url, "--qps", "inf", "--num-requests", "8",
                      "--max-concurrency", "2", "--output-len", "5", "--result-file", str(out)]) == 0
    assert app.state.max_in_flight == 2
    result = strict_loads(out.read_text())  # --qps inf: "inf", not a bare Infinity
    assert (result["request_rate"], result["trace_spec"]["qps"], result["completed"]) == ("inf", "inf", 8)


def test_chat_with_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(COMMON_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    out = tmp_path / "r.json"
    with serving(fake_app()) as url:
        code = bench(["--base-url", url, "--endpoint", "/v1/chat/completions", *SYNTHETIC,
                      "--tokenizer", str(tmp_path / "tok"), "--result-file", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["failed"] == 0
    assert all(r["prompt_tokens"] == r["input_len"] for r in result["requests"])


def test_sweep_compare_and_iteration_log(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sweep.json"
    with serving(fake_app()) as url:
        args = ["--base-url", url, "--num-requests", "6", "--output-len", "4", "--input-len", "8"]
        assert bench([*args, "--sweep-qps", "20,40", "--result-file", str(out)]) == 0
    a, b = tmp_path / "sweep_qps20.json", tmp_path / "sweep_qps40.json"
    assert json.loads(a.read_text())["request_rate"] == 20.0
    assert json.loads(b.read_text())["request_rate"] == 40.0
    start = json.loads(a.read_text())["start_time_unix"]
    log = tmp_path / "iterations.jsonl"
    log.write_text("\n".join(json.dumps({"t": start + i * 0.01, "spatial": i % 2 == 0}) for i in range(20)))
    assert len(read_iteration_log(log)) == 10
    capsys.readouterr()
    png = tmp_path / "cmp.png"
    assert bench(["--compare", str(a), str(b), "--plot", str(png), "--iteration-log", str(log)]) == 0
    text = capsys.readouterr().out
    assert "sweep_qps20" in text and "B/A" in text and re.search(r"completed\s+6\s+6\s+1.000", text)
    assert png.is_file()


@pytest.mark.parametrize("error, reason", [
    (httpx.ReadTimeout(""), "ReadTimeout"),  # said "could not read a model id from URL/v1/models: " (bench --request-timeout 1ms)
    (httpx.ConnectError("All connection attempts failed"), "ConnectError: All connection attempts failed"),
])
def test_a_failed_model_list_names_the_reason(error: httpx.HTTPError, reason: str) -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        raise error

    async def fetch() -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(fail)) as client:
            return await fetch_model_id(client, "http://server")

    with pytest.raises(RuntimeError) as exc:
        asyncio.run(fetch())
    assert str(exc.value) == f"could not read a model id from http://server/v1/models: {reason}"


def test_unreachable_server_is_a_setup_error(capsys: pytest.CaptureFixture) -> None:
    port = free_port()
    assert bench(["--base-url", f"http://127.0.0.1:{port}", *SYNTHETIC]) == 1
    assert "could not read a model id" in capsys.readouterr().err
    # with --model: every request failed, exit 2 (a usage error's status) after a report of zeros
    assert bench(["--base-url", f"http://127.0.0.1:{port}", "--model", "m", *SYNTHETIC]) == 1
    captured = capsys.readouterr()
    assert captured.err.endswith(f"duetserve bench: error: server not reachable at http://127.0.0.1:{port}: "
                                 "ConnectError: All connection attempts failed\n")
    assert "Serving Benchmark Result" not in captured.out


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh folder as ``tempfile``'s, where a launched server's temporary log goes."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_launch_runs_and_stops_the_server(tmp_path: Path, temp_dir: Path) -> None:
    port = free_port()
    out = tmp_path / "r.json"
    command = f"{sys.executable} {Path(__file__)} --serve {port}"
    assert bench(["--launch", command, "--base-url", f"http://127.0.0.1:{port}", *SYNTHETIC,
                  "--launch-timeout", "60s", "--result-file", str(out)]) == 0
    assert json.loads(out.read_text())["completed"] == 12
    with socket.socket() as s:  # the server is gone
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert list(temp_dir.iterdir()) == []  # and so is its log (each run left /tmp/duetserve-bench-server-*.log)


def test_launch_without_base_url_polls_the_launched_servers_port(tmp_path: Path, temp_dir: Path) -> None:
    """bench polled :8000 for the whole --launch-timeout when the server listened elsewhere."""
    port = free_port()
    out = tmp_path / "r.json"
    assert bench(["--launch", f"{sys.executable} {Path(__file__)} --port {port}", *SYNTHETIC,
                  "--launch-timeout", "60s", "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["base_url"], result["completed"]) == (f"http://127.0.0.1:{port}", 12)


@pytest.mark.parametrize("command, url", [
    ("duetserve serve --model m", "http://127.0.0.1:8000"),
    ("vllm serve m --port 8123", "http://127.0.0.1:8123"),
    ("vllm serve m --host=0.0.0.0 --port=9000 --port 9001", "http://127.0.0.1:9001"),
    ("serve --host :: --port 7000", "http://[::1]:7000"),
    ("serve --host 10.1.2.3 --port 7000", "http://10.1.2.3:7000"),
    ("serve --host fe80::1 --port 7000", "http://[fe80::1]:7000"),
])
def test_launched_base_url(command: str, url: str) -> None:
    assert launched_base_url(command) == url


@pytest.mark.parametrize("port", ["0", "x", "70000"])
def test_a_launched_port_bench_cannot_reach_is_refused(port: str, capsys: pytest.CaptureFixture) -> None:
    assert bench(["--launch", f"true --port {port}", *SYNTHETIC]) == 2
    assert capsys.readouterr().err == (f"duetserve bench: error: --launch true --port {port}: its --port {port} "
                                       "is not a port to reach the server at; give --base-url\n")


def test_launch_failure_is_reported(temp_dir: Path, capsys: pytest.CaptureFixture) -> None:
    command = f"{sys.executable} -c \"print('no model here'); raise SystemExit(3)\""
    assert bench(["--launch", command, "--base-url", f"http://127.0.0.1:{free_port()}", *SYNTHETIC]) == 1
    err = capsys.readouterr().err
    assert "exited with code 3" in err and "no model here" in err
    log, = temp_dir.iterdir()  # kept, and named in the error
    assert f"(log: {log})" in err and log.read_text() == "no model here\n"


def test_launch_log_of_a_server_that_died_during_the_run_is_kept(temp_dir: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    port = free_port()
    config = LaunchConfig(f"{sys.executable} {Path(__file__)} --serve {port}", f"http://127.0.0.1:{port}/health",
                          startup_timeout_s=60)
    with ServerProcess(config) as server:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
    log, = temp_dir.iterdir()
    assert capsys.readouterr().err == f"duetserve bench: server log kept (it exited with code -9 during the run): {log}\n"
    with pytest.raises(RuntimeError, match="^boom$"), ServerProcess(config):
        raise RuntimeError("boom")
    assert len(list(temp_dir.iterdir())) == 2 and "server log kept (the run failed): " in capsys.readouterr().err
    named = temp_dir / "named.log"
    with ServerProcess(replace(config, log_path=named)):
        pass
    assert named.is_file()  # --launch-log: never deleted


def test_sigterm_stops_the_launched_server() -> None:
    """``timeout`` (SIGTERM) on ``bench --launch`` left the server running: it is in its own
    session and Python's default exit skipped ``__exit__``. Now the server goes too, exit 143."""
    port = free_port()
    health = f"http://127.0.0.1:{port}/health"
    bench_proc = _bench_under_way(
        ["-m", "duetserve.bench", "--launch", f"{sys.executable} {Path(__file__)} --serve {port}",
         "--base-url", f"http://127.0.0.1:{port}"], health, stderr=subprocess.DEVNULL)
    bench_proc.send_signal(signal.SIGTERM)
    assert bench_proc.wait(60) == 143 and not _answers(health)


def test_ctrl_c_stops_the_launched_server_and_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) printed a KeyboardInterrupt traceback; the server must still be stopped, and its
    temporary log deleted (an interrupt is no failure)."""
    port = free_port()
    health = f"http://127.0.0.1:{port}/health"
    # SIGINT at its default in the child: a test run started in the background (`nohup ... &`)
    # ignores it, the child inherits that, and Python then never raises KeyboardInterrupt
    bench_proc = _bench_under_way(
        ["-m", "duetserve.cli", "bench", "--launch", f"{sys.executable} {Path(__file__)} --port {port}",
         "--no-progress"], health, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    bench_proc.send_signal(signal.SIGINT)
    assert bench_proc.wait(60) == 130 and not _answers(health)
    assert bench_proc.stderr.read().splitlines()[-1:] == ["duetserve bench: interrupted"]
    assert list(tmp_path.glob("duetserve-bench-server-*.log")) == []


def _bench_under_way(args: list[str], health: str, **popen) -> subprocess.Popen:
    """``python ARGS`` plus a 1000-request run at QPS 1, once the server it launched answers
    ``health`` and the run has had a second to start."""
    proc = subprocess.Popen([sys.executable, *args, "--num-requests", "1000", "--qps", "1", "--input-len", "8",
                             "--output-len", "4"], stdout=subprocess.DEVNULL, **popen)
    deadline = time.time() + 60
    while time.time() < deadline and not _answers(health):
        time.sleep(0.2)
    assert _answers(health)
    time.sleep(1.0)
    return proc


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_launch_refused_while_another_server_answers(capsys: pytest.CaptureFixture) -> None:
    # The launched command would fail to bind; without the check bench would measure the other server.
    with serving(fake_app()) as url:
        assert bench(["--launch", "sleep 30", "--base-url", url, *SYNTHETIC, "--launch-timeout", "10s"]) == 1
    captured = capsys.readouterr()
    assert f"{url}/health already answers before the launch: another server is running there" in captured.err
    assert "Serving Benchmark Result" not in captured.out


def test_no_log_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with serving(fake_app()) as url:
        assert bench(["--base-url", url, *SYNTHETIC]) == 0
    assert [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))] == []


def test_module_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "duetserve.bench", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--sweep-qps" in done.stdout


def test_module_entry_point_reads_a_negative_value_after_a_space() -> None:
    done = subprocess.run([sys.executable, "-m", "duetserve.bench", "--tbt-slo", "-5ms"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.endswith("error: argument --tbt-slo: bad duration '-5ms': a duration cannot be negative\n")


def test_token_id_prompts_exact_and_prefix_shared() -> None:
    builder = PromptBuilder(seed=7, token_id_range=(100, 200))
    a = builder.token_ids(0, TraceRequest(0.0, 1200, 1, hash_ids=[5, 6, 7]))
    b = builder.token_ids(1, TraceRequest(0.0, 700, 1, hash_ids=[5, 9]))
    c = builder.token_ids(2, TraceRequest(0.0, 700, 1))
    assert (len(a), len(b), len(c)) == (1200, 700, 700)
    assert all(100 <= t < 200 for t in a + b + c)
    assert a[:MOONCAKE_BLOCK_TOKENS] == b[:MOONCAKE_BLOCK_TOKENS]  # shared first block
    assert a[MOONCAKE_BLOCK_TOKENS:700] != b[MOONCAKE_BLOCK_TOKENS:]
    assert c != b and c == PromptBuilder(7, (100, 200)).token_ids(2, TraceRequest(0.0, 700, 1))


class MergingTokenizer:
    """Whitespace words, except that 'of the' is one token and 'people' is two."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        words = text.replace("of the", "of_the").split()
        return [hash(w) for w in words for _ in range(2 if w == "people" else 1)]


def test_text_prompts_exact_under_tokenizer() -> None:
    builder = PromptBuilder(seed=0, token_id_range=(0, 10), tokenizer=MergingTokenizer())
    assert "people" not in builder.words
    for i, n in enumerate([1, 2, 5, 17, 64, 300]):
        text = builder.text(i, TraceRequest(0.0, n, 1))
        assert len(MergingTokenizer().encode(text)) == n


if __name__ == "__main__":
    cli = argparse.ArgumentParser()
    cli.add_argument("--serve", "--port", type=int, required=True, metavar="PORT")
    uvicorn.run(fake_app(), host="127.0.0.1", port=cli.parse_args().serve, log_level="warning")
