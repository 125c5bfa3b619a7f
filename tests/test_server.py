"""A real ``duetserve serve`` process on loopback, driven over HTTP."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

import duetserve
from duetserve.engine.engine import RequestLimits

pytestmark = pytest.mark.slow

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str, sigint_ignored: bool = False) -> tuple[subprocess.Popen, str]:
    """``duetserve serve`` on the embedded model on a free port, with ``args``, once healthy:
    (the process, its output merged in one text pipe; its base URL). ``sigint_ignored``: the
    process starts with SIGINT ignored, as a job started with ``&`` by a script does."""
    port = free_port()
    cmd = [sys.executable, "-m", "duetserve.cli", "serve", "--port", str(port), *args]
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ignore)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail("server did not become healthy")


@pytest.fixture(scope="module")
def server_proc(smollm_folder, tmp_path_factory):
    """A running server: (base URL, path of its iteration log)."""
    log = tmp_path_factory.mktemp("log") / "iterations.jsonl"
    proc, base = start_server("--api-key", KEY, "--iteration-log", str(log), "--max-num-batched-tokens", "256",
                              "--num-kv-blocks", "1024", "--policy", "chunked")
    yield base, log
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_sigterm_stops_the_engine_before_the_process_ends(smollm_folder):
    """uvicorn answers SIGTERM with a graceful shutdown and then raises the signal again, which
    ends the process at once: the engine is stopped (and, on CUDA, the allocator's counts
    logged) in the app's shutdown, not after the server returns. A stream still running then
    is ended after ``--shutdown-timeout`` with ``finish_reason`` ``abort`` and ``[DONE]`` (it had
    kept the server up until it finished: minutes; then it was cut off without ``[DONE]``)."""
    proc, base = start_server("--num-kv-blocks", "256", "--shutdown-timeout", "1s")
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60).status_code == 200
    body = {"prompt": "Hi", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    whole = pool.submit(  # a non-streaming request beside it
        httpx.post, f"{base}/v1/completions", json={**body, "stream": False}, timeout=60)
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # streaming
        start = time.monotonic()
        proc.terminate()
        rest = [line for line in lines if line]
    assert time.monotonic() - start < 10
    answer = whole.result(timeout=10)
    pool.shutdown()
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "abort"
    assert 0 < answer.json()["usage"]["completion_tokens"] < 3000
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort"
    assert 0 < sum(len(json.loads(line[6:])["choices"][0]["text"]) > 0 for line in rest[:-1]) < 3000
    out, _ = proc.communicate(timeout=30)
    assert "Application shutdown complete" in out and "timeout graceful shutdown exceeded" not in out
    assert out.count("engine stopped") == 1, out[-2000:]


def test_engine_process_serves_as_the_engine_thread_does(server):
    """``--engine-process``: the same greedy text as the server whose engine runs on a thread, the
    metrics fed from the engine process's events, and Ctrl-C stops both processes cleanly."""
    proc, base = start_server("--engine-process", "--num-kv-blocks", "256")
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        ours = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        theirs = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=60).json()
        assert ours["choices"][0]["text"] == theirs["choices"][0]["text"] and ours["usage"]["completion_tokens"] == 8
        deadline = time.monotonic() + 5  # the metrics hear of the last part just after its delivery
        while time.monotonic() < deadline and metric(base, "vllm:request_success_total") < 1:
            time.sleep(0.05)
        assert metric(base, "vllm:generation_tokens_total") == 8 and metric(base, "vllm:num_requests_running") == 0
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in out and out.count("engine stopped") == 1, out[-3000:]


def test_a_dead_engine_process_ends_streams_with_an_error_and_the_server_exits():
    """``--engine-process`` with its engine process killed mid-stream: the stream gets an error
    event and ``[DONE]``, then the server shuts itself down and exits with status 1 (as vLLM's
    does when its engine core dies), so a supervisor can restart it."""
    import os
    from pathlib import Path

    proc, base = start_server("--engine-process", "--num-kv-blocks", "256")
    engine_pids = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _parent_of(d) == proc.pid
                   and b"spawn_main" in (d / "cmdline").read_bytes()]
    assert len(engine_pids) == 1
    body = {"prompt": "Hi", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(engine_pids[0], signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["error"]["message"] == "the engine process has ended"
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "the engine process has ended (exit code -9)" in out and "its engine is gone" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def _parent_of(proc_dir) -> int | None:
    """The parent pid of the process whose ``/proc`` folder is ``proc_dir`` (None if it is gone)."""
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_second_ctrl_c_ends_the_streams_at_once(smollm_folder):
    """A second SIGINT while the shutdown waits for running requests ends them now, as the
    timeout would: the stream gets ``finish_reason`` ``abort`` and ``[DONE]``, and the server exits
    cleanly (uvicorn's own second-signal exit cut streams off and logged tracebacks)."""
    proc, base = start_server("--num-kv-blocks", "256", "--shutdown-timeout", "60s")
    body = {"prompt": "Hi", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(1)
        assert proc.poll() is None  # the first one waits for the stream
        proc.send_signal(signal.SIGINT)
        rest = [line for line in lines if line]
    assert time.monotonic() - start < 15
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    out, _ = proc.communicate(timeout=30)
    # as after one Ctrl-C: exit status 130 with one line
    assert proc.returncode == 130 and out.endswith("duetserve serve: interrupted\n"), out[-3000:]
    assert "Traceback" not in out and out.count("engine stopped") == 1, out[-3000:]


def test_sse_events_are_compact_json_with_utf8_text():
    """A streamed chunk is one ``data:`` event of compact JSON, non-ASCII text as UTF-8 (json.dumps
    wrote ``\\u00e9``); the closing ``[DONE]`` as it is."""
    from duetserve.server.api import _sse

    event = _sse({"choices": [{"delta": {"content": "café ✓"}, "finish_reason": None}], "n": 3})
    assert event == 'data: {"choices":[{"delta":{"content":"café ✓"},"finish_reason":null}],"n":3}\n\n'
    assert json.loads(event[len("data: "):]) == {"choices": [{"delta": {"content": "café ✓"}, "finish_reason": None}],
                                                "n": 3}
    assert _sse("[DONE]") == "data: [DONE]\n\n"
    # a string orjson refuses (a lone surrogate, e.g. a model name from an undecodable path): escaped by json
    assert _sse({"model": "m\udcff", "text": "é"}) == 'data: {"model":"m\\udcff","text":"\\u00e9"}\n\n'


def test_chat_text_parts_are_joined_by_newlines():
    """A message's text parts reach the chat template joined by newlines, as vLLM joins them (they
    were glued together: "Translate to French:Good morning"); developer messages become system."""
    from duetserve.server.protocol import ChatCompletionRequest, template_messages

    request = ChatCompletionRequest(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Translate to French:"},
                                                    {"type": "text", "text": "Good morning"}]},
        {"role": "assistant", "content": None}])  # a participant name is accepted, not templated
    assert template_messages(request.messages) == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Translate to French:\nGood morning"},
                                       {"role": "assistant", "content": ""}]


def test_ctrl_c_exits_130_also_when_sigint_was_ignored_at_start(smollm_folder):
    """A server started with SIGINT ignored (``duetserve serve &`` in a script) still stops on
    SIGINT, as uvicorn handles it, and now also ends as after Ctrl-C: "interrupted", exit
    status 130 (it exited 0 without the line: uvicorn's re-raised signal was ignored)."""
    proc, _ = start_server("--num-kv-blocks", "64", sigint_ignored=True)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and out.endswith("duetserve serve: interrupted\n"), out[-3000:]


def test_draining_server_signals():
    """The first Ctrl-C asks for the shutdown; a second ends the running requests
    (``abort_all``, on the server's loop) even before uvicorn's loop has begun the shutdown (it
    looks every 0.1 s; a second one sooner used to force uvicorn out); a third forces the exit."""
    import uvicorn

    from duetserve.server.shutdown import DrainingServer

    aborted = []
    server = DrainingServer(uvicorn.Config(app=None), lambda: aborted.append(True), 60.0)
    loop = asyncio.new_event_loop()
    try:
        server.loop = loop  # as startup() sets it
        server.handle_exit(signal.SIGINT, None)
        assert server.should_exit and not server.force_exit and not server.ended_early
        assert server.exit_signal == signal.SIGINT  # serve ends with "interrupted", 130
        server.handle_exit(signal.SIGINT, None)
        assert server.ended_early and not server.force_exit
        loop.run_until_complete(asyncio.sleep(0))
        assert aborted == [True]
        server.handle_exit(signal.SIGINT, None)
        assert server.force_exit and aborted == [True]
    finally:
        loop.close()


@pytest.fixture(scope="module")
def server(server_proc):
    return server_proc[0]


@pytest.fixture(scope="module")
def tokenizer(smollm_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_folder)


def metric(base: str, name: str, label: str = "") -> float:
    """Sum of the samples of ``name`` whose labels contain ``label`` (e.g. 'finished_reason="abort"')."""
    text = httpx.get(f"{base}/metrics").text
    return sum(float(m.group(2)) for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE)
               if label in (m.group(1) or ""))


async def stream_chat(client: httpx.AsyncClient, base: str, content: str, max_tokens: int) -> tuple[list[dict], dict]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}}
    chunks, done = [], False
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=AUTH) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                done = True
                continue
            chunks.append(json.loads(line[6:]))
    assert done
    return chunks[:-1], chunks[-1]


def test_16_concurrent_streaming_chats(server, tokenizer):
    before = metric(server, "vllm:generation_tokens_total")
    contents = [f"Tell me fact number {i} about the sea." for i in range(16)]

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(stream_chat(client, server, c, 12 + i) for i, c in enumerate(contents)))

    results = asyncio.run(run())
    for i, (chunks, usage_chunk) in enumerate(results):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": contents[i]}], add_generation_prompt=True,
                                               tokenize=True)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12 + i,
                                        "total_tokens": len(prompt) + 12 + i}
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("usage" in c and c["usage"] is None for c in chunks)  # null until the last chunk
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert metric(server, "vllm:generation_tokens_total") - before == sum(12 + i for i in range(16))
    assert metric(server, "vllm:request_success_total") >= 16


def test_non_streaming_completion(server):
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=120,
                   json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"].strip().startswith("Paris")
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["stop_reason"] is None
    # token-id prompt and a stop string
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=120,
                   json={"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 20, "temperature": 0, "stop": ["."]})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    assert "." not in r.json()["choices"][0]["text"] and r.json()["choices"][0]["stop_reason"] == "."
    # the stop string completes on the last allowed token: "stop", not "length" (vLLM's rule)
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=120,
                   json={"prompt": "1, 2, 3, 4,", "max_tokens": 5, "temperature": 0, "stop": [", 6"]})
    assert r.json()["choices"][0] == {**r.json()["choices"][0], "text": " 5", "finish_reason": "stop",
                                      "stop_reason": ", 6"}  # vLLM's stop_reason: what it matched
    # vLLM's include_stop_str_in_output: the text ends after the stop string
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=120,
                   json={"prompt": "1, 2, 3, 4,", "max_tokens": 5, "temperature": 0, "stop": [", 6"],
                         "include_stop_str_in_output": True})
    assert r.json()["choices"][0] == {**r.json()["choices"][0], "text": " 5, 6", "finish_reason": "stop"}
    # a stop token id ends the text before its own text, unless include_stop_str_in_output (vLLM's
    # rule); the token counts as generated either way (token 30 is ".")
    for include, text in ((False, " Paris"), (True, " Paris.")):
        r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=120,
                       json={"prompt": "The capital of France is", "max_tokens": 10, "temperature": 0,
                             "stop_token_ids": [30], "include_stop_str_in_output": include})
        assert r.json()["choices"][0] == {**r.json()["choices"][0], "text": text, "finish_reason": "stop",
                                          "stop_reason": 30}
        assert r.json()["usage"]["completion_tokens"] == 2
    # unsupported OpenAI fields at their "off" values (as client libraries send them) are fine
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=120,
                   json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "logprobs": None,
                         "presence_penalty": 0, "frequency_penalty": 0.0, "best_of": 1, "user": "u-1"})
    assert r.json()["choices"][0]["text"] == body["choices"][0]["text"]
    for field, value in (("best_of", True), ("presence_penalty", False), ("logprobs", 1)):  # true is not 1
        r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": "The capital of France is", "max_tokens": 5, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    # vanishing top_p / temperature sample the most likely token, like greedy
    for extra in ({"temperature": 1, "top_p": 1e-300}, {"temperature": 1e-45}):
        r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=120,
                       json={"prompt": "The capital of France is", "max_tokens": 5, **extra})
        assert r.json()["choices"][0]["text"] == body["choices"][0]["text"], extra


BAD = [
    ("/v1/completions", {"prompt": "hi " * 9000, "max_tokens": 5}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 3.0}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, -5]}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**80}, "seed"),
    ("/v1/completions", b'{"prompt": "\\ud800 hi", "max_tokens": 4}', "prompt"),  # lone surrogate
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),  # could never match: refused, as in prompt
    ("/v1/completions", {"prompt": "x" * 2_000_000}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 0}, "logprobs"),  # 0: the sampled tokens' logprobs
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 9000}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2_000_000}]}, "messages"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages"),
]

# Wrong JSON types that pydantic's lax mode would coerce but OpenAI refuses: (path, body, param, message).
WRONG_TYPES = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens",
     "Input should be a valid integer, not a boolean (max_tokens)"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens",
     "Input should be a valid integer, not a string (max_tokens)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": True},
     "max_completion_tokens", "Input should be a valid integer, not a boolean (max_completion_tokens)"),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature",
     "Input should be a valid number, not a string (temperature)"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n", "Input should be a valid integer, not a boolean (n)"),
    ("/v1/completions", {"prompt": "hi", "seed": 1e30}, "seed",
     "Input should be an integer in [-2**63, 2**63), got 1e+30 (seed)"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream", "Input should be a valid boolean (stream)"),
    ("/v1/completions", {"prompt": "hi", "user": 5}, "user", "Input should be a valid string (user)"),  # was accepted
    ("/v1/completions", {"prompt": "hi", "ignore_eos": 1}, "ignore_eos", "Input should be a valid boolean (ignore_eos)"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids",
     "Input should be a valid integer, not a boolean (stop_token_ids.0)"),
    ("/v1/completions", {"prompt": 5}, "prompt",
     "Input should be a string, a list of token ids (integers), or a list holding one of either (prompt)"),
    ("/v1/completions", {"prompt": [True, 2]}, "prompt",
     "Input should be a string, a list of token ids (integers), or a list holding one of either (prompt)"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, "stop", "Input should be a string or a list of strings (stop)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages",
     "a user message needs content: a string or a list of text parts (messages.0.content)"),
    ("/v1/chat/completions", {"messages": [{"role": "system"}, {"role": "user", "content": "hi"}]}, "messages",
     "a system message needs content: a string or a list of text parts (messages.0.content)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages",
     "Input should be a valid string (messages.0.name)"),  # was accepted
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     'Input should be a string or a list of {"type": "text", "text": ...} parts (messages.0.content)'),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, "messages",
     "content is an empty list: give at least one text part (messages.0.content)"),  # was accepted
]


@pytest.mark.parametrize("path,body,param,message", WRONG_TYPES, ids=[str(b)[:60] for _, b, _, _ in WRONG_TYPES])
def test_wrong_json_types_get_400_naming_the_field(server, path, body, param, message):
    r = httpx.post(f"{server}{path}", headers=AUTH, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": message, "type": "BadRequestError", "param": param, "code": 400}


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": "hi", "stop_token_ids": [5, 10**9]}, "stop_token_ids",
     "stop_token_ids must be in [0, 49152), got 1000000000"),  # the value was not shown
    ({"prompt": "hi", "stop": ["ok", "\ud800"]}, "stop",
     "stop is not valid Unicode text: surrogates not allowed at character 0"),  # was accepted
])
def test_bad_values_get_400_saying_what_was_sent(server, body, param, message):
    r = httpx.post(f"{server}/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                   content=json.dumps(body), timeout=60)  # ASCII escapes: a lone surrogate is sendable
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": message, "type": "BadRequestError", "param": param, "code": 400}


def test_assistant_message_may_have_null_content(server):
    """OpenAI allows a null ``content`` only on assistant messages (those that carried tool calls)."""
    body = {"messages": [{"role": "assistant", "content": None}, {"role": "user", "content": "hi"}],
            "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_health_answers_get_and_head(server):
    """Load balancers probe ``/health`` with GET or HEAD (no API key needed); other methods get 405."""
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
    head = httpx.head(f"{server}/health", timeout=10)
    assert head.status_code == 200 and head.content == b""
    r = httpx.post(f"{server}/health", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["type"] == "MethodNotAllowedError"


def test_unknown_model_gets_404_like_openai(server):
    for path, body in (("/v1/completions", {"prompt": "hi", "model": "gpt-17"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-17"})):
        r = httpx.post(f"{server}{path}", headers=AUTH, json=body, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 404 and err["param"] == "model" and err["type"] == "NotFoundError"
        assert "`gpt-17` does not exist" in err["message"]


def test_body_must_be_a_json_object(server):
    for content, ctype in ((b'"hello"', "application/json"), (b"hello", "text/plain"), (b"[1, 2]", "application/json")):
        r = httpx.post(f"{server}/v1/completions", headers={**AUTH, "Content-Type": ctype}, content=content, timeout=60)
        assert r.status_code == 400, r.text
        hint = " (it was sent as text/plain: send it with Content-Type: application/json)" if ctype == "text/plain" else ""
        assert r.json()["error"]["message"] == "the request body must be a JSON object" + hint, r.text
    # a JSON object with no Content-Type: FastAPI does not parse it (CSRF); the message says what to send
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, content=b'{"prompt": "Hi", "max_tokens": 3}', timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "the request body must be a JSON object (it was sent without a Content-Type: send it with "
        "Content-Type: application/json)"), r.text
    r = httpx.post(f"{server}/v1/completions", headers={**AUTH, "Content-Type": "application/json"}, content=b"",
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "the request body is empty: expected a JSON object", "type": "BadRequestError", "param": None,
        "code": 400}, r.text


def test_streamed_completion_sends_no_empty_text_chunks(server):
    """Text held back for a possible stop string sends no chunk; the last chunk, the usage and
    [DONE] still come."""
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "stream": True,
            "stop": ["Question number"], "stream_options": {"include_usage": True}}
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, json=body, timeout=120)
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines[:-1]]
    assert lines[-1] == "[DONE]"
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]] == \
        [(" Paris.\n\n", "length")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(line == json.dumps(c, separators=(",", ":")) for line, c in zip(lines, chunks))  # compact, as bodies


def test_streamed_stop_reason_comes_with_the_finish(server):
    """Streamed, ``stop_reason`` is null until the chunk that finishes, which names the stop string
    (completions) or the stop token id (chat), as vLLM's chunks do."""
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=120, json={
        "prompt": "1, 2, 3, 4,", "max_tokens": 5, "temperature": 0, "stop": [", 6"], "stream": True})
    choices = [json.loads(line[6:])["choices"][0] for line in r.text.splitlines() if line.startswith("data: {")]
    assert [(c["finish_reason"], c["stop_reason"]) for c in choices] == [(None, None)] * (len(choices) - 1) + \
        [("stop", ", 6")]
    assert "".join(c["text"] for c in choices) == " 5"
    r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=120, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 30,
        "temperature": 0, "stop_token_ids": [30], "stream": True})
    choices = [json.loads(line[6:])["choices"][0] for line in r.text.splitlines() if line.startswith("data: {")]
    assert [c["stop_reason"] for c in choices] == [None] * (len(choices) - 1) + [30]
    assert choices[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize("extra, stop_reason", [
    ({}, None),  # EOS (<|im_end|>, id 2) ends the answer: no stop_reason, as vLLM
    ({"stop_token_ids": [2]}, None),  # EOS is checked first, as vLLM does
    ({"stop_token_ids": [2], "ignore_eos": True}, 2),  # EOS ignored: the stop token ends it
])
def test_stop_reason_of_an_eos_finish(server, tokenizer, extra, stop_reason):
    assert tokenizer.eos_token_id == 2
    r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=120, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 30,
        "temperature": 0, **extra})
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == \
        ("The capital of France is Paris.", "stop", stop_reason)


def test_default_max_tokens_is_named_when_the_prompt_leaves_no_room_for_it(server):
    for extra, note in (({}, " (the default for /v1/completions)"), ({"max_tokens": 16}, "")):
        r = httpx.post(f"{server}/v1/completions", headers=AUTH, json={"prompt": [504] * 8185, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"] == {
            "message": f"max_tokens=16{note} plus the 8185-token prompt exceeds the maximum context length of "
                       "8192 tokens", "type": "BadRequestError", "param": "max_tokens", "code": 400}, r.text


def test_bad_inputs_get_400_while_a_stream_completes(server):
    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            long_stream = asyncio.create_task(stream_chat(client, server, "Count to one hundred.", 150))
            await asyncio.sleep(1.0)
            answers = []
            for path, body, param in BAD:
                raw = {"content": body} if isinstance(body, bytes) else {"json": body}
                r = await client.post(f"{server}{path}", headers={**AUTH, "Content-Type": "application/json"}, **raw)
                answers.append((r, param))
            r = await client.post(f"{server}/v1/completions", content=b'{"prompt": "hi",', headers=AUTH)
            answers.append((r, None))
            for raw, message in ((b'{"prompt": "\xff\xfe"}', "not UTF-8 text (invalid start byte at byte 12)"),
                                 (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
                                 (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
                                  "an integer of more than 4300 digits")):
                r = await client.post(f"{server}/v1/completions", content=raw,
                                      headers={**AUTH, "Content-Type": "application/json"})
                assert message in r.json()["error"]["message"], r.text
                answers.append((r, None))
            assert not long_stream.done(), "the long request should still be streaming"
            return answers, await long_stream

    answers, (chunks, usage_chunk) = asyncio.run(run())
    for r, param in answers:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400 and err["message"]
        if param:
            assert err["param"] == param, err
    assert usage_chunk["usage"]["completion_tokens"] == 150


def test_non_streaming_disconnect_frees_the_request(server):
    body = {"prompt": "Once upon a time", "max_tokens": 8000, "ignore_eos": True}  # minutes of CPU decode
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=2.0)
    deadline = time.time() + 30
    while time.time() < deadline and metric(server, "vllm:num_requests_running") != 0:
        time.sleep(0.5)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


def test_api_key_required(server):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    models = httpx.get(f"{server}/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    card = httpx.get(f"{server}/v1/models/SmolLM2-135M-Instruct", headers=AUTH).json()
    assert card["id"] == "SmolLM2-135M-Instruct" and card["object"] == "model"
    assert (card["root"], card["parent"]) == ("SmolLM2-135M-Instruct", None) and card["max_model_len"] > 0
    r = httpx.get(f"{server}/v1/models/gpt-4", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_disconnect_frees_the_request(server):
    """A client leaving mid-stream aborts its request and frees its KV blocks; its prompt counts
    in ``vllm:prompt_tokens_total`` as vLLM's does (it was prefilled), not only finished ones'."""
    prompt_len = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": "Once upon a time", "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    aborted = metric(server, "vllm:request_success_total", 'finished_reason="abort"')
    prompts = metric(server, "vllm:prompt_tokens_total")
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
    deadline = time.time() + 30
    while time.time() < deadline:
        if metric(server, "vllm:num_requests_running") == 0 and metric(server, "vllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.5)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0
    assert metric(server, "vllm:request_success_total", 'finished_reason="abort"') == aborted + 1
    assert metric(server, "vllm:prompt_tokens_total") == prompts + prompt_len


def test_iteration_log_records_every_iteration(server_proc):
    base, log = server_proc
    before = len(log.read_text().splitlines()) if log.exists() else 0
    r = httpx.post(f"{base}/v1/completions", headers=AUTH, timeout=120,
                   json={"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    # The engine thread delivers a step's outputs before it logs the step, so the last row may
    # land just after the response.
    def rows() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()[before:]]

    deadline = time.time() + 5
    while sum(r["steps"] for r in rows()) < 5 and time.time() < deadline:
        time.sleep(0.05)
    rows = rows()
    # one prefill iteration, then decode iterations of up to 8 steps (--num-decode-steps) with one
    # step per further token (plus other requests' steps)
    assert len(rows) >= 2 and sum(r["steps"] for r in rows if r["num_decodes"]) >= 5
    assert {"t", "spatial", "s_decode", "s_prefill", "k", "predicted_s", "measured_s"} <= set(rows[-1])
    assert all(r["measured_s"] > 0 and r["spatial"] is False for r in rows)  # no partition backend on the CPU
    assert all(0 < r["schedule_s"] < r["measured_s"] for r in rows)  # scheduling is part of the iteration
    assert all(r["gap_s"] is None or r["gap_s"] >= 0 for r in rows) and rows[0]["gap_s"] is None  # idle before
    assert all(r["trim_rates"] is None for r in rows)  # chunked weighs no split
    # each scheduled sequence's (q, c): one new token per decode, the chunk's tokens per prefill
    assert all(len(r["requests"]) == r["num_decodes"] + r["num_prefills"] and
               sum(q for q, _ in r["requests"]) == r["num_decodes"] + r["num_prefill_tokens"] and
               all(q == 1 and c >= 1 for q, c in r["requests"][:r["num_decodes"]]) for r in rows)
    prompt = [r["requests"][0] for r in rows if r["num_decodes"] == 0 and r["num_prefills"] == 1]
    assert prompt and prompt[-1][1] == 0  # this prompt's prefill, nothing cached before it
    assert all(r["decode_stream_s"] is None and r["prefill_stream_s"] is None and r["decode_tail_s"] is None
               and r["gpu_s"] is None for r in rows)  # no CUDA events
    # temporal plans: one part each; multi-step decodes (temporal, decode-only): one part per step
    assert all(r["launch_s"] is None and (r["handout_s"] == [] if r["k"] == 1 else
                                          r["num_prefills"] == 0 and len(r["handout_s"]) == r["steps"] <= r["k"])
               for r in rows)
    assert any(r["k"] == 5 for r in rows)  # its 5 tokens after the first (k stops at max_tokens)
    # chunked plans without predicting: the log carries the engine cost model's (h200 profile, no graphs on the CPU)
    assert all(r["prefill_layers"] is None and r["predicted_s"] > 0 and r["cuda_graphs"] is False for r in rows)


def _logging_metrics(tmp_path, cuda_graphs: bool = False, piecewise_tokens: int = 0):
    """ServerMetrics writing an iteration log, watching a stand-in engine whose cost model is
    Qwen3-8B on the h200 profile; returns (metrics, log path, cost model)."""
    from types import SimpleNamespace

    from duetserve.planner.cost_model import CostModel, ModelShape
    from duetserve.planner.hardware import load_profile
    from duetserve.server.metrics import ServerMetrics

    cost_model = CostModel(ModelShape.preset("qwen3-8b"), load_profile("h200"), cuda_graphs=cuda_graphs,
                           piecewise_tokens=piecewise_tokens)
    log = tmp_path / "it.jsonl"
    metrics = ServerMetrics("m", str(log))
    metrics.watch_engine(SimpleNamespace(num_running=lambda: 0, num_waiting=lambda: 0, kv_usage=lambda: 0.0,
                                         cost_model=cost_model))
    return metrics, log, cost_model


def test_iteration_log_carries_the_planning_host_terms(tmp_path):
    """Records carry the host terms of the profile the predictions use (`calibrate
    --iteration-log` fits against them); a plan's own prediction is kept."""
    from duetserve.engine.engine import StepStats
    from duetserve.planner.optimizer import Plan

    metrics, log, cost_model = _logging_metrics(tmp_path)
    metrics.on_step(StepStats(Plan(predicted_s=0.05), 3, 100, 0.06, 0, num_prefills=1), [], 1.0)
    rec = json.loads(log.read_text())
    h200 = cost_model.profile
    assert (rec["host_per_request_s"], rec["host_eager_s"]) == (h200.host_per_request_s, h200.host_eager_s)
    assert rec["cuda_graphs"] is False and rec["piecewise_tokens"] == 0  # an engine without recorded graphs
    assert rec["host_piecewise_s"] == h200.piecewise_host_s  # the term in force (host_eager_s without one)
    assert (rec["num_decodes"], rec["num_prefills"], rec["num_prefill_tokens"], rec["prefill_layers"]) == (3, 1, 100, None)
    assert rec["predicted_s"] == 0.05
    assert rec["decode_margin"] is None
    metrics.on_step(StepStats(Plan(spatial=True, s_prefill=124, s_decode=8, predicted_s=0.2, trim_rates=(3e4, 3.3e4),
                                   decode_margin=1.25), 3, 8192, 0.21, 0, num_prefills=1), [], 2.0)
    last = json.loads(log.read_text().splitlines()[-1])
    assert last["trim_rates"] == [3e4, 3.3e4] and last["decode_margin"] == 1.25  # what duet weighed and priced with


def test_iteration_log_predicts_plans_without_a_prediction(tmp_path):
    """chunked and prefill-first plan nothing: their records get the engine cost model's
    prediction of the batch as scheduled, (q, c) per sequence on all SMs; a multi-step decode
    (any policy) the steps that ran (3 of the plan's 4 here) with the host time once."""
    from duetserve.engine.engine import StepStats
    from duetserve.engine.scheduler import ScheduledSeq
    from duetserve.planner.optimizer import Plan

    metrics, log, cost_model = _logging_metrics(tmp_path, cuda_graphs=True, piecewise_tokens=1024)
    mixed = [ScheduledSeq(None, 1, 700), ScheduledSeq(None, 1, 3000), ScheduledSeq(None, 2048, 1024)]
    metrics.on_step(StepStats(Plan(), 2, 2048, 0.07, 0, num_prefills=1, scheduled=mixed), [], 1.0)
    decodes = [ScheduledSeq(None, 1, 700), ScheduledSeq(None, 1, 3000)]
    metrics.on_step(StepStats(Plan(k=4), 2, 0, 0.03, 0, decode_steps=3, scheduled=decodes), [], 2.0)
    first, multi = (json.loads(line) for line in log.read_text().splitlines())
    one_step = float(cost_model.predict_total([(1, 700), (1, 3000)], 132))
    assert first["predicted_s"] == pytest.approx(float(cost_model.predict_total([(1, 700), (1, 3000), (2048, 1024)], 132)))
    assert first["predicted_s"] > 0.05  # a 2k-token chunk of Qwen3-8B: tens of ms, eager
    gpu_step = float(cost_model.predict_total([(1, 700), (1, 3000)], 132, host=False))
    assert one_step - gpu_step == pytest.approx(2 * cost_model.profile.host_per_request_s)  # graph-replayed
    assert multi["predicted_s"] == pytest.approx(3 * gpu_step + 2 * cost_model.profile.host_per_request_s)
    assert 0.004 < one_step < 0.01
    # a plan that carries a prediction (duet's) is predicted the same way for a multi-step decode
    metrics.on_step(StepStats(Plan(k=4, predicted_s=1.0), 2, 0, 0.03, 0, decode_steps=3, scheduled=decodes), [], 3.0)
    assert json.loads(log.read_text().splitlines()[-1])["predicted_s"] == pytest.approx(multi["predicted_s"])
    assert multi["cuda_graphs"] is True and multi["piecewise_tokens"] == 1024


def test_predicted_gauge_is_made_at_scrape_time_without_an_iteration_log():
    """Without an iteration log, a multi-step decode's prediction (the plan carries none) is made
    when /metrics is read, not on the engine thread: 0 before any iteration (as the measured
    time), then the cost
    model's for the steps that ran; a plan's own prediction as it is; a plan without one (chunked)
    the cost model's for the batch on all SMs. ITL, TTFT and token counts from bound children,
    one finish count per reason."""
    from types import SimpleNamespace

    from duetserve.engine.engine import RequestOutput, StepStats
    from duetserve.engine.scheduler import ScheduledSeq
    from duetserve.planner.cost_model import CostModel, ModelShape
    from duetserve.planner.hardware import load_profile
    from duetserve.planner.optimizer import Plan
    from duetserve.server.metrics import ServerMetrics

    cost_model = CostModel(ModelShape.preset("qwen3-8b"), load_profile("h200"), cuda_graphs=True)
    metrics = ServerMetrics("m")
    metrics.watch_engine(SimpleNamespace(num_running=lambda: 0, num_waiting=lambda: 0, kv_usage=lambda: 0.0,
                                         cost_model=cost_model))

    def sample(name, **labels):
        return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})

    predicted = "duetserve:predicted_vs_measured_seconds"
    assert sample(predicted, kind="predicted") == sample(predicted, kind="measured") == 0.0
    calls = []
    real = cost_model.predict_steps
    cost_model.predict_steps = lambda *a: calls.append(a) or real(*a)
    decodes = [ScheduledSeq(None, 1, 700), ScheduledSeq(None, 1, 3000)]
    metrics.on_arrival("a", 10.0)
    metrics.on_arrival("b", 10.0)
    metrics.on_step(None, [RequestOutput("a", [5], "x", False, None, 7, 1),
                           RequestOutput("b", [6], "y", False, None, 9, 1)], 10.25)
    metrics.on_step(StepStats(Plan(k=4), 2, 0, 0.03, 0, decode_steps=3, scheduled=decodes),
                    [RequestOutput("a", [8, 9], "zz", True, "length", 7, 3),
                     RequestOutput("b", [], "", True, "weird", 9, 1)], 10.5)
    assert calls == []  # nothing predicted on the engine thread
    assert sample(predicted, kind="predicted") == pytest.approx(real([(1, 700), (1, 3000)], 132, 3))
    assert len(calls) == 1
    sample(predicted, kind="predicted")
    assert len(calls) == 1  # made once per iteration
    assert sample(predicted, kind="measured") == 0.03
    assert sample("vllm:generation_tokens_total") == 4
    assert sample("vllm:prompt_tokens_total") == 16
    assert sample("vllm:time_to_first_token_seconds_count") == 2
    assert sample("vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert sample("vllm:inter_token_latency_seconds_count") == 1  # b's finish carried no token
    assert sample("vllm:inter_token_latency_seconds_sum") == pytest.approx(0.25)
    assert sample("vllm:request_success_total", finished_reason="length") == 1
    assert sample("vllm:request_success_total", finished_reason="weird") == 1
    assert sample("duetserve:iterations_total", plan="temporal") == 1
    metrics.on_step(StepStats(Plan(predicted_s=0.02), 1, 64, 0.025, 0, num_prefills=1,
                              scheduled=[ScheduledSeq(None, 64, 0)]), [], 11.0)
    assert sample(predicted, kind="predicted") == 0.02 and len(calls) == 1
    metrics.on_step(StepStats(Plan(), 1, 64, 0.025, 0, num_prefills=1, scheduled=[ScheduledSeq(None, 64, 0)]), [], 12.0)
    assert sample(predicted, kind="predicted") == pytest.approx(float(cost_model.predict_total([(64, 0)], 132)))

    def broken(*args):
        raise RuntimeError("no prediction")
    cost_model.predict_steps = broken
    metrics.on_step(StepStats(Plan(k=4), 2, 0, 0.03, 0, decode_steps=3, scheduled=decodes), [], 13.0)
    assert math.isnan(sample(predicted, kind="predicted"))  # the scrape still answers


def test_null_fields_take_their_defaults(server):
    """``"temperature": null`` and the like mean the default, as OpenAI and vLLM read them."""
    base = {"prompt": "Once upon a time", "max_tokens": 6, "seed": 7}
    nulls = {"temperature": None, "top_p": None, "top_k": None, "n": None, "stream": None, "stop": None,
             "stop_token_ids": None, "ignore_eos": None, "echo": None, "stream_options": None, "logprobs": None}
    plain = httpx.post(f"{server}/v1/completions", headers=AUTH, json=base, timeout=120)
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, json={**base, **nulls}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, json={"prompt": None}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    stream = {**base, "stream": True, "stream_options": {"include_usage": None}}  # vLLM accepts it: the default
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, json=stream, timeout=120)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and chunks and all(c.get("usage") is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain.json()["choices"][0]["text"]


def test_chat_default_max_tokens_fits_a_small_kv_cache(tmp_path):
    """Without max_tokens a chat gets the context left after its prompt; a KV cache smaller than
    the model's context caps the engine's max_model_len (vLLM refuses to start instead; with
    --num-kv-blocks 5 a chat was refused: "needs 512 KV blocks; the cache has 5"), and an explicit
    --max-model-len the cache cannot hold is refused naming the flag."""
    from duetserve.config import EngineConfig
    from duetserve.engine.async_engine import AsyncEngine
    from duetserve.engine.engine import LLMEngine
    from duetserve.server.api import _room

    small = LLMEngine(EngineConfig(num_kv_blocks=5))  # the embedded model: 8192 positions, blocks of 16
    assert small.max_model_len == 80
    assert _room(AsyncEngine(small), 37) == 80 - 37
    assert _room(AsyncEngine(small), 90) == 1  # the engine then refuses the prompt itself
    with pytest.raises(ValueError, match="--max-model-len 200 is more than the KV cache holds .80 tokens"):
        LLMEngine(EngineConfig(num_kv_blocks=5, max_model_len=200))


@pytest.mark.parametrize("field,off,on", [
    ("echo", False, True), ("add_generation_prompt", True, False), ("continue_final_message", False, True),
    ("chat_template", None, "{{ messages }}"), ("chat_template_kwargs", {}, {"enable_thinking": False}),
    ("min_p", 0, 0.5), ("structured_outputs", None, {"choice": ["a", "b"]}), ("logprobs", False, True),
])
def test_chat_fields_this_server_does_not_implement(field, off, on):
    """vLLM's chat extensions that change the prompt or the sampling are refused (400 naming the
    field) unless sent at the value that asks for nothing, as client libraries may send them."""
    from duetserve.sampling import ParamError
    from duetserve.server.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    ChatCompletionRequest(messages=messages, **{field: off}).sampling_params(16)
    with pytest.raises(ParamError, match=f"{field} is not supported") as err:
        ChatCompletionRequest(messages=messages, **{field: on}).sampling_params(16)
    assert err.value.param == field


def test_unknown_fields_are_ignored_with_a_warning(caplog):
    """A field the API does not know is ignored and named in a warning (vLLM's behaviour); known
    refused fields at their "off" value are not named."""
    from duetserve.server.protocol import CompletionRequest

    with caplog.at_level("WARNING", logger="duetserve.server.protocol"):
        params = CompletionRequest(prompt="hi", foo=1, bar={"x": 2}, echo=False).sampling_params(16)
    assert params.max_tokens == 16
    assert [r.getMessage() for r in caplog.records] == [
        "The following fields were present in the request but ignored: ['bar', 'foo']"]
    caplog.clear()  # OpenAI's bookkeeping fields, as the SDK and agent frameworks send them: no warning
    quiet = {"user": "u1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
             "parallel_tool_calls": True, "request_id": "r1", "modalities": ["text"]}
    with caplog.at_level("WARNING", logger="duetserve.server.protocol"):
        CompletionRequest(prompt="hi", **quiet).sampling_params(16)
        CompletionRequest(prompt="hi", reasoning_effort="low", **quiet).sampling_params(16)
    assert [r.getMessage() for r in caplog.records] == [
        "The following fields were present in the request but ignored: ['reasoning_effort']"]
    caplog.clear()  # unknown keys inside stream_options too
    with caplog.at_level("WARNING", logger="duetserve.server.protocol"):
        params = CompletionRequest(prompt="hi", stream=True, stream_options={"include_usage": True, "foo": 1},
                                   baz=0).sampling_params(16)
    assert params.max_tokens == 16
    assert [r.getMessage() for r in caplog.records] == [
        "The following fields were present in the request but ignored: ['baz', 'stream_options.foo']"]


# A value asking for something, for every field in protocol._UNSUPPORTED (a pair: /v1/completions, chat)
UNSUPPORTED_ON = {
    "logprobs": 1, "top_logprobs": 2, "best_of": 2, "frequency_penalty": 0.5, "presence_penalty": 0.5,
    "repetition_penalty": 1.2, "min_p": 0.1, "logit_bias": {"5": 10}, "suffix": "!", "min_tokens": 3,
    "response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required", "functions": [{"name": "f"}], "function_call": {"name": "f"},
    "guided_json": {"type": "object"}, "guided_regex": "[0-9]+", "guided_choice": ["a", "b"],
    "guided_grammar": 'root ::= "a"', "structured_outputs": {"choice": ["a", "b"]}, "echo": True,
    "add_generation_prompt": False, "continue_final_message": True, "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False}, "documents": [{"title": "t", "text": "x"}],
    "use_beam_search": True, "length_penalty": 0.5, "allowed_token_ids": [5], "bad_words": ["Paris"],
    "prompt_logprobs": 0, "truncate_prompt_tokens": 4,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "add_special_tokens": (False, True),
    "return_tokens_as_token_ids": True, "return_token_ids": True, "priority": 1,
    "logits_processors": ["my.Processor"], "prompt_embeds": "AAAA",
    "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
}
ENDPOINTS = {"/v1/completions": {"prompt": "1, 2, 3,", "max_tokens": 3, "temperature": 0},
             "/v1/chat/completions": {"messages": [{"role": "user", "content": "1, 2, 3,"}], "max_tokens": 3,
                                      "temperature": 0}}


def test_every_unsupported_field_has_a_test_value():
    from duetserve.server.protocol import _CHAT_UNSUPPORTED, _UNSUPPORTED

    assert set(UNSUPPORTED_ON) == set(_UNSUPPORTED) == set(_CHAT_UNSUPPORTED)


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_ON))
def test_unsupported_fields_are_refused_naming_the_field(server, field):
    """A field the server does not implement gets 400 naming it when it asks for something (vLLM
    would honour it), on both endpoints; sent at its "off" values it is accepted."""
    from duetserve.server.protocol import _CHAT_UNSUPPORTED, _UNSUPPORTED

    on = UNSUPPORTED_ON[field]
    for (path, base), value, offs in zip(ENDPOINTS.items(), on if isinstance(on, tuple) else (on, on),
                                         (_UNSUPPORTED[field], _CHAT_UNSUPPORTED[field])):
        r = httpx.post(f"{server}{path}", headers=AUTH, json={**base, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"] == {
            "message": f"{field} is not supported by this server", "type": "BadRequestError", "param": field,
            "code": 400}, (path, r.text)
        for off in offs:
            r = httpx.post(f"{server}{path}", headers=AUTH, json={**base, field: off, "max_tokens": 1}, timeout=60)
            assert r.status_code == 200, (path, off, r.text)


def test_off_values_of_unsupported_fields_change_nothing(server):
    """vLLM's defaults sent explicitly (as client libraries do) give the same text as leaving them out."""
    from duetserve.server.protocol import _CHAT_UNSUPPORTED, _UNSUPPORTED

    for (path, base), table in zip(ENDPOINTS.items(), (_UNSUPPORTED, _CHAT_UNSUPPORTED)):
        plain = httpx.post(f"{server}{path}", headers=AUTH, json=base, timeout=120).json()
        offs = {field: offs[-1] for field, offs in table.items()}
        r = httpx.post(f"{server}{path}", headers=AUTH, json={**base, **offs}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"] == plain["choices"] and r.json()["usage"] == plain["usage"]


def test_continuous_usage_stats(server):
    """stream_options.continuous_usage_stats (vLLM): with include_usage every chunk carries the
    usage so far; without include_usage it changes nothing."""
    for path, base in ENDPOINTS.items():
        body = {**base, "max_tokens": 4, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        r = httpx.post(f"{server}{path}", headers=AUTH, json=body, timeout=120)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        *content, last = chunks
        prompt = last["usage"]["prompt_tokens"]
        assert last["choices"] == [] and last["usage"] == {"prompt_tokens": prompt, "completion_tokens": 4,
                                                           "total_tokens": prompt + 4}
        done = [c["usage"]["completion_tokens"] for c in content]
        assert all(c["usage"]["prompt_tokens"] == prompt and c["usage"]["total_tokens"] == prompt +
                   c["usage"]["completion_tokens"] for c in content), content
        if path == "/v1/chat/completions":  # the role chunk first, then one chunk per token
            assert done == [0, 1, 2, 3, 4]
        else:  # a chunk per token with text
            assert done == sorted(set(done)) and done[-1] == 4 and done[0] >= 1
        body["stream_options"] = {"continuous_usage_stats": True}
        r = httpx.post(f"{server}{path}", headers=AUTH, json=body, timeout=120)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert r.status_code == 200 and chunks and all("usage" not in c for c in chunks)


def test_chat_max_completion_tokens_is_named_when_it_exceeds_the_context(server, tokenizer):
    """The context-length check (the engine's, after the chat template) names the field the client
    sent, as the range checks do."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    n = len(prompt if isinstance(prompt, list) else prompt["input_ids"])
    for field in ("max_completion_tokens", "max_tokens"):
        r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=60,
                       json={"messages": messages, field: 8190})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": f"{field}=8190 plus the {n}-token prompt exceeds the maximum context length of 8192 "
                       "tokens", "type": "BadRequestError", "param": field, "code": 400}, r.text
    r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"messages": messages, "max_tokens": 5, "max_completion_tokens": 8190})  # it wins
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text


class SlowPrefillEngine:
    """A stand-in ``LLMEngine`` (no tokenizer) whose requests never get a token: one runs (a
    prefill of ``steps_per_request`` steps of 10 ms), the others wait in the queue behind it."""

    model_name, tokenizer, cost_model, last_stats = "fake", None, None, None
    limits = RequestLimits(vocab_size=100_000, max_model_len=8192, block_size=16, num_blocks=1024)

    def __init__(self, steps_per_request: int = 10_000):
        self.steps_per_request = steps_per_request
        self.queue: list[str] = []  # the first one is prefilling
        self.steps = 0
        self.aborted: list[str] = []

    def set_interrupt(self, fn) -> None:
        pass

    def add_request(self, request_id, prompt, params) -> None:
        self.queue.append(request_id)

    def abort(self, request_id) -> None:
        if request_id in self.queue:
            self.aborted.append(request_id)
            self.queue.remove(request_id)

    def request_ids(self) -> list[str]:
        return list(self.queue)

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step_parts(self):
        time.sleep(0.01)
        self.steps += 1
        assert self.steps < self.steps_per_request, "the prefill should have been aborted"
        yield []


async def asgi_post(app, path: str, body: dict, gone: asyncio.Event, sent: list | None = None) -> list[dict]:
    """POST ``body`` to the ASGI ``app`` as a client that disconnects once ``gone`` is set;
    returns the ASGI messages the app sent (appended to ``sent`` as they come, if given)."""
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    sent = [] if sent is None else sent

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_the_first_token_aborts_the_request(stream):
    """A client leaving while its request is prefilling, or still queued behind another, gets it
    aborted in the engine within a poll (DISCONNECT_POLL_S), not after its prefill."""
    from duetserve.engine.async_engine import AsyncEngine
    from duetserve.server.api import DISCONNECT_POLL_S, create_app
    from duetserve.server.metrics import ServerMetrics

    fake = SlowPrefillEngine()
    front = AsyncEngine(fake)
    app = create_app(front, ServerMetrics("fake"), "fake")
    interval = sys.getswitchinterval()
    front.start()

    async def run():
        gone = [asyncio.Event(), asyncio.Event()]
        body = {"prompt": [1000] * 8000, "max_tokens": 5, "stream": stream}
        calls = []
        for event in gone:  # the first one prefills, the second one waits behind it
            calls.append(asyncio.create_task(asgi_post(app, "/v1/completions", body, event)))
            while len(fake.queue) < len(calls):
                await asyncio.sleep(0.005)
        await asyncio.sleep(2 * DISCONNECT_POLL_S)  # both polled at least once before they go
        assert fake.aborted == [] and fake.steps > 0 and not any(c.done() for c in calls)
        before = list(fake.queue)  # [prefilling, waiting]
        start = time.monotonic()
        for event in gone:
            event.set()
        sent = await asyncio.wait_for(asyncio.gather(*calls), timeout=5)
        while len(fake.aborted) < 2 and time.monotonic() - start < 5:
            await asyncio.sleep(0.005)
        return sent, time.monotonic() - start, before

    try:
        (sent_a, sent_b), elapsed, before = asyncio.run(run())
    finally:
        front.shutdown()
        sys.setswitchinterval(interval)
    assert len(before) == 2 and sorted(fake.aborted) == sorted(before) and fake.queue == []
    assert elapsed < 2 * DISCONNECT_POLL_S + 0.5, elapsed
    for sent in (sent_a, sent_b):
        # a stream's headers went out at once (200, as vLLM's); it ends with no event
        assert sent[0] == {**sent[0], "type": "http.response.start", "status": 200 if stream else 499}
        if stream:
            assert b"".join(m.get("body", b"") for m in sent[1:]) == b"" and not sent[-1].get("more_body", False)


def test_stream_headers_go_out_before_the_prefill_ends():
    """A streamed response's status and headers are sent as soon as the request is accepted (a
    client or proxy timing the response's start saw nothing for the whole prefill before)."""
    from duetserve.engine.async_engine import AsyncEngine
    from duetserve.server.api import create_app
    from duetserve.server.metrics import ServerMetrics

    fake = SlowPrefillEngine()
    front = AsyncEngine(fake)
    app = create_app(front, ServerMetrics("fake"), "fake")
    front.start()

    async def run():
        gone, sent = asyncio.Event(), []
        call = asyncio.create_task(asgi_post(app, "/v1/completions", {"prompt": [1] * 100, "stream": True}, gone, sent))
        while not (fake.queue and fake.steps > 2):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        during = list(sent)
        gone.set()
        await asyncio.wait_for(call, timeout=5)
        return during

    try:
        during = asyncio.run(run())
    finally:
        front.shutdown()
    assert len(during) == 1 and during[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in during[0]["headers"]
    assert fake.queue == [] and len(fake.aborted) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_real_server_aborts_a_prefill_when_the_client_leaves(server, stream):
    """An 8000-token prompt prefills in 256-token chunks for many seconds on the CPU; a client
    timing out after 1 s gets it aborted before its first token."""
    aborted = metric(server, "vllm:request_success_total", 'finished_reason="abort"')
    generated = metric(server, "vllm:generation_tokens_total")
    body = {"prompt": [1000] * 8000, "max_tokens": 5, "stream": stream}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=1.0) as client, \
            client.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH) as resp:
        resp.read()
    left = time.monotonic()
    while time.monotonic() - left < 5 and metric(server, "vllm:num_requests_running") != 0:
        time.sleep(0.1)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0
    assert metric(server, "vllm:request_success_total", 'finished_reason="abort"') == aborted + 1
    assert metric(server, "vllm:generation_tokens_total") == generated  # no token: aborted in its prefill


def test_tokenize_detokenize_and_version(server, tokenizer):
    """vLLM's /tokenize, /detokenize and /version: the tokens are Hugging Face's, a chat's are those
    /v1/chat/completions counts as its prompt, and bad input gets an OpenAI error body."""
    prompt = "The capital of France is"
    r = httpx.post(f"{server}/tokenize", json={"prompt": prompt})
    assert r.status_code == 200
    assert r.json() == {"count": len(tokenizer.encode(prompt)), "max_model_len": 8192,
                        "tokens": tokenizer.encode(prompt), "token_strs": None}
    r = httpx.post(f"{server}/tokenize", json={"prompt": prompt, "return_token_strs": True,
                                               "add_special_tokens": False})
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert r.json()["tokens"] == ids and r.json()["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    counts = {}
    for generation_prompt in (True, False):
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        chat = chat if isinstance(chat, list) else chat["input_ids"]
        r = httpx.post(f"{server}/tokenize", json={"messages": messages, "add_generation_prompt": generation_prompt})
        assert r.status_code == 200 and r.json()["tokens"] == chat
        counts[generation_prompt] = r.json()["count"]
    assert counts[True] > counts[False]
    r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"messages": messages, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == counts[True]
    r = httpx.post(f"{server}/detokenize", json={"tokens": [504, 3575, 282, 4649, 314]})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode([504, 3575, 282, 4649, 314])}
    assert httpx.get(f"{server}/version").json() == {"version": duetserve.__version__}
    for path, body, status, param, message in (
            ("/tokenize", {"prompt": "a", "messages": messages}, 400, "prompt", "send exactly one of prompt and messages"),
            ("/tokenize", {}, 400, "prompt", "send exactly one of prompt and messages"),
            ("/tokenize", {"messages": []}, 400, "messages", "messages must not be empty"),
            ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model", "the model `gpt-4` does not exist"),
            ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens", "token ids must be in [0, 49152)"),
            ("/detokenize", {"tokens": ["a"]}, 400, "tokens", "Input should be a valid integer")):
        r = httpx.post(f"{server}{path}", json=body)
        assert r.status_code == status, (path, body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["message"].startswith(message), (path, body, error)
    assert httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=120,
                      json={"prompt": prompt, "max_tokens": 1}).status_code == 200  # still serving
