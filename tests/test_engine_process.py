"""EngineProcess: the engine loop in a child process (CPU, the tiny random Qwen3)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from duetserve.config import EngineConfig
from duetserve.engine.async_engine import EngineError
from duetserve.engine.engine import LLMEngine
from duetserve.engine.engine_process import EngineProcess
from duetserve.sampling import ParamError, SamplingParams
from duetserve.server.api import create_app
from duetserve.server.metrics import ServerMetrics


class Recorder:
    """A ``StepObserver`` that keeps every call (the process's reader thread makes them)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def on_arrival(self, request_id, now):
        self.calls.append(("arrival", request_id))

    def on_step(self, stats, outputs, now):
        self.calls.append(("step", stats, {o.request_id: len(o.new_token_ids) for o in outputs}))

    def forget(self, request_id):
        self.calls.append(("forget", request_id))


def config(folder, **kw) -> EngineConfig:
    return EngineConfig(model=str(folder), max_num_batched_tokens=64, num_kv_blocks=64, block_size=16, **kw)


async def collect(front, request_id, prompt, params) -> list[int]:
    return [t for out in [o async for o in front.generate(request_id, prompt, params)] for t in out.new_token_ids]


def test_tokens_metrics_and_gauges_as_with_the_engine_in_this_process(tiny_qwen3_folder):
    """Greedy tokens of three concurrent requests equal the in-process engine's; the observer
    hears each arrival before that request's outputs and gets every iteration's stats with the
    scheduled (q, c) but no sequences; the gauges read the engine's last counts."""
    prompts = [[5, 9, 13], list(range(3, 40)), [7] * 20]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = LLMEngine(config(tiny_qwen3_folder)).generate(prompts, params)
    observer = Recorder()
    front = EngineProcess(config(tiny_qwen3_folder), observer)
    front.start()
    try:
        assert front.is_alive and front.max_model_len == 512 and front.vocab_size == 320
        assert front.tokenizer is None and front.cost_model.shape.hidden == 64

        async def main():
            return await asyncio.gather(*(collect(front, str(i), p, params) for i, p in enumerate(prompts)))

        assert asyncio.run(main()) == expected
    finally:
        assert front.shutdown(timeout_s=30) is True
    assert not front.is_alive
    steps = [c for c in observer.calls if c[0] == "step"]
    assert [sum(c[2].get(str(i), 0) for c in steps) for i in range(3)] == [12, 12, 12]  # every token told
    for i in range(3):  # arrival first
        first_out = next(k for k, c in enumerate(observer.calls) if c[0] == "step" and str(i) in c[2])
        assert observer.calls.index(("arrival", str(i))) < first_out
    stats = [c[1] for c in steps if c[1] is not None]
    assert stats and all(s.seq is None and s.num_new_tokens >= 1 for st in stats for s in st.scheduled)
    assert sum(st.num_prefill_tokens for st in stats) == sum(len(p) for p in prompts)
    assert (front.num_running(), front.num_waiting(), front.kv_usage()) == (0, 0, 0.0)


def test_bad_requests_are_refused_in_the_server(tiny_qwen3_folder):
    """``check_request`` runs in this process against the engine's limits: the request never
    reaches the engine (no arrival)."""
    observer = Recorder()
    front = EngineProcess(config(tiny_qwen3_folder), observer)
    front.start()
    try:
        async def main(prompt, params):
            return await collect(front, "r", prompt, params)

        with pytest.raises(ParamError, match=r"prompt token ids must be in \[0, 320\)") as err:
            asyncio.run(main([1, 320], SamplingParams(max_tokens=2)))
        assert err.value.param == "prompt"
        with pytest.raises(ParamError, match="exceeds the maximum context length of 512"):
            asyncio.run(main([1, 2], SamplingParams(max_tokens=511)))
    finally:
        front.shutdown(timeout_s=30)
    assert observer.calls == []


def test_an_engine_that_cannot_start_names_the_reason(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        EngineProcess(EngineConfig(model=str(tmp_path)))


def test_a_dead_engine_process_fails_its_streams_and_new_requests(tiny_qwen3_folder, caplog):
    """The engine process killed mid-request: the open stream ends with EngineError, the server
    logs it, the front says it is not alive and its gauges read 0, a new request fails at once
    instead of waiting (HTTP 500 from the app, /health 500 too), and ``on_death`` is told once."""
    front = EngineProcess(config(tiny_qwen3_folder))
    front.start()
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main():
        stream = front.generate("long", [5, 6, 7], params)
        await anext(stream)
        front._process.kill()
        with pytest.raises(EngineError, match="engine process has ended"):
            async for _ in stream:
                pass
        assert not front.is_alive and (front.num_running(), front.kv_usage()) == (0, 0.0)
        with pytest.raises(EngineError, match="engine process has ended"):
            await asyncio.wait_for(collect(front, "new", [5], SamplingParams(max_tokens=2)), 5)
        # and the server, until it has shut itself down (``on_death``), answers 500 at once
        app = create_app(front, ServerMetrics("tiny"), "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
            assert (await client.get("/health")).status_code == 500
            r = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2}), 5)
            assert r.status_code == 500 and r.json()["error"]["message"] == "the engine process has ended"

    deaths = []
    front.on_death = lambda: deaths.append(front.is_alive)  # told once, the process gone
    asyncio.run(asyncio.wait_for(main(), 60))
    front._starts.join(10)  # the reader ends after telling
    assert deaths == [False]
    assert front.shutdown(timeout_s=5) is True
    assert [r.levelname for r in caplog.records if "engine process has ended" in r.getMessage()] == ["ERROR"]


def test_a_sigterm_to_the_process_group_leaves_the_engine_to_the_server(tiny_qwen3_folder, caplog):
    """SIGTERM reaches the engine process too when it is sent to the server's process group (as
    the serving benchmark's launcher and systemd do): the engine keeps running, so the request
    under the server's drain gets all its tokens, and its end at shutdown logs no error. (Before
    the fix, the engine died at once and the drain failed its requests.)"""
    front = EngineProcess(config(tiny_qwen3_folder))
    front.start()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def main():
        stream = front.generate("r", [5, 6, 7], params)
        tokens = list((await anext(stream)).new_token_ids)
        os.kill(front._process.pid, signal.SIGTERM)
        async for out in stream:
            tokens += out.new_token_ids
        return tokens

    front.on_death = lambda: pytest.fail("a shutdown is no death")
    try:
        assert len(asyncio.run(asyncio.wait_for(main(), 60))) == 40
        assert front.is_alive
    finally:
        assert front.shutdown(timeout_s=30) is True
    front._starts.join(10)  # the reader has seen the pipe close
    assert front._process.exitcode == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_abort_all_ends_every_stream_with_abort(tiny_qwen3_folder):
    front = EngineProcess(config(tiny_qwen3_folder))
    front.start()
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main():
        streams = [front.generate(str(i), [5, 6, 7 + i], params) for i in range(2)]
        for s in streams:
            await anext(s)
        front.abort_all()
        lasts = []
        for s in streams:
            async for out in s:
                last = out
            lasts.append((last.finished, last.finish_reason))
        return lasts

    try:
        assert asyncio.run(asyncio.wait_for(main(), 60)) == [(True, "abort"), (True, "abort")]
        # the gauges come with every event: the aborts' (no iteration ran after them)
        assert (front.num_running(), front.num_waiting(), front.kv_usage()) == (0, 0, 0.0)
    finally:
        front.shutdown(timeout_s=30)


def test_the_engine_process_ends_quietly_when_the_server_goes(tiny_qwen3_folder, capfd):
    """The server's end of the pipe closed mid-request (the server killed): the engine process
    exits with status 0 and no traceback, whether it notices on a command or on an event (the
    event path alone is checked deterministically below). Nothing reads the events here: closing
    the pipe under a reading thread is not what a dying server does."""
    front = EngineProcess(config(tiny_qwen3_folder))
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    front._send(("add", "long", [5, 6, 7], params, time.monotonic()))
    assert front._conn.poll(30)  # its first events are out: the request runs
    front._conn.close()
    front._process.join(30)
    assert front._process.exitcode == 0
    assert "Traceback" not in capfd.readouterr().err


def test_events_to_a_closed_pipe_end_the_loop_instead_of_failing_a_step():
    """What the engine process's loop does when the server's end of the pipe is gone: sending an
    event raises ``_ServerGone``, which ``EngineLoop`` does not take for a failed step (that would
    be logged with a traceback, and the loop would go on), so the loop ends."""
    from multiprocessing import Pipe
    from types import SimpleNamespace

    from duetserve.engine.async_engine import EngineLoop
    from duetserve.engine.engine import RequestOutput
    from duetserve.engine.engine_process import _PipeEvents, _ServerGone

    class OneRequest:
        scheduler = SimpleNamespace(running=[], waiting=[])
        block_manager = SimpleNamespace(usage=0.0)
        last_stats = None

        def set_interrupt(self, fn):
            pass

        def add_request(self, request_id, prompt, params):
            self.added = request_id

        def has_unfinished(self):
            return True

        def request_ids(self):
            return [self.added]

        def step_parts(self):
            yield [RequestOutput(self.added, [5], "x", False, None, 1, 1)]

    class Commands:
        def __init__(self):
            self.queue = [("add", "r", [1], SamplingParams(max_tokens=2), 0.0)]

        def get(self, timeout):
            return self.queue.pop(0) if self.queue else None

        def pending(self):
            return bool(self.queue)

    ours, theirs = Pipe()
    theirs.close()
    engine = OneRequest()
    with pytest.raises(_ServerGone):
        EngineLoop(engine, Commands(), _PipeEvents(ours, engine)).run()
