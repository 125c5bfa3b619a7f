"""AsyncEngine: the engine thread hands each part's outputs to the event loop (CPU, fake engine)."""
from __future__ import annotations

import asyncio
import sys
import time

from duetserve.engine.async_engine import SWITCH_INTERVAL_S, AsyncEngine
from duetserve.engine.engine import RequestLimits, RequestOutput
from duetserve.sampling import SamplingParams


class FakeEngine:
    """Runs every added request for ``steps`` iterations of two parts each (a look-ahead step,
    then the prefill part), one token per request per part."""

    model_name, tokenizer, cost_model = "fake", None, None
    limits = RequestLimits(vocab_size=100, max_model_len=8192, block_size=16, num_blocks=1024)

    def __init__(self, steps: int):
        self.steps, self.requests, self.last_stats = steps, {}, None

    def set_interrupt(self, fn) -> None:
        pass

    def add_request(self, request_id, prompt, params) -> None:
        self.requests[request_id] = 0

    def abort(self, request_id) -> RequestOutput | None:
        n = self.requests.pop(request_id, None)
        return None if n is None else RequestOutput(request_id, [], "", True, "abort", 1, n)

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step_parts(self):
        for part in range(2):
            outs = []
            for rid in list(self.requests):
                n = self.requests[rid] = self.requests[rid] + 1
                done = n == 2 * self.steps
                outs.append(RequestOutput(rid, [n], f"{n} ", done, "length" if done else None, 1, n))
                if done:
                    del self.requests[rid]
            yield outs


def test_outputs_in_order_one_wakeup_per_part():
    engine = FakeEngine(steps=3)
    front = AsyncEngine(engine)
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counting(cb, *args):
            calls.append(cb)
            return original(cb, *args)

        loop.call_soon_threadsafe = counting

        async def one(rid):
            return [o.new_token_ids[0] async for o in front.generate(rid, [1, 2], SamplingParams(max_tokens=6))]

        tasks = [asyncio.create_task(one(str(i))) for i in range(4)]
        await asyncio.sleep(0.01)  # all four queued before the engine thread starts: one batch
        front.start()
        return await asyncio.gather(*tasks)

    interval = sys.getswitchinterval()
    try:
        results = asyncio.run(main())
        lowered = sys.getswitchinterval()
    finally:
        front.shutdown()
        sys.setswitchinterval(interval)  # process-wide: leave the rest of the session as it was
    assert results == [[1, 2, 3, 4, 5, 6]] * 4
    assert lowered <= SWITCH_INTERVAL_S
    assert len(calls) == 6  # 24 outputs in 6 parts: one wake-up of the loop per part, not per request


class SilentEngine(FakeEngine):
    """Its requests never produce an output (a prefill that takes forever)."""

    def step_parts(self):
        time.sleep(0.005)
        yield []


def test_cancelling_the_wait_for_the_first_output_aborts_the_request():
    """The server cancels a handler's wait when its client goes away before the first token: the
    request leaves the engine (it was queued or prefilling) on its next iteration."""
    engine = SilentEngine(steps=1)
    front = AsyncEngine(engine)
    front.start()

    async def main():
        stream = front.generate("r1", [1, 2], SamplingParams(max_tokens=4))
        waiting = asyncio.ensure_future(anext(stream))
        while "r1" not in engine.requests:
            await asyncio.sleep(0.001)
        waiting.cancel()
        await asyncio.wait((waiting,))
        start = time.monotonic()
        while "r1" in engine.requests and time.monotonic() - start < 2:
            await asyncio.sleep(0.001)
        return waiting.cancelled(), time.monotonic() - start

    interval = sys.getswitchinterval()
    try:
        cancelled, elapsed = asyncio.run(main())
    finally:
        front.shutdown()
        sys.setswitchinterval(interval)
    assert cancelled and engine.requests == {} and front._streams == {}
    assert elapsed < 0.5


def test_abort_all_ends_every_stream_with_abort():
    """``serve``'s shutdown timeout: every running request gets a last output (``abort``, no new
    tokens), so its stream ends, and the engine holds none."""
    engine = SilentEngine(steps=1)
    front = AsyncEngine(engine)
    front.start()

    async def drain(rid):
        return [(o.finish_reason, o.finished) async for o in front.generate(rid, [1], SamplingParams(max_tokens=4))]

    async def main():
        tasks = [asyncio.ensure_future(drain(f"r{i}")) for i in range(3)]
        while len(engine.requests) < 3:
            await asyncio.sleep(0.001)
        front.abort_all()
        return await asyncio.wait_for(asyncio.gather(*tasks), 5)

    try:
        results = asyncio.run(main())
    finally:
        front.shutdown()
    assert results == [[("abort", True)]] * 3
    assert engine.requests == {} and front._streams == {}


def test_requests_after_abort_all_end_at_once_without_tokens():
    """A request that reaches the engine after ``abort_all`` (at shutdown, one still being
    tokenized) is not started: its stream gets one last output, ``abort``, no tokens, its
    prompt counted; the engine never sees it."""
    added = []

    class Recording(SilentEngine):
        def add_request(self, request_id, prompt, params) -> None:
            added.append(request_id)
            super().add_request(request_id, prompt, params)

    class Observer:
        def __init__(self):
            self.calls = []

        def on_arrival(self, request_id, now):
            self.calls.append(("arrival", request_id))

        def forget(self, request_id):
            self.calls.append(("forget", request_id))

        def on_step(self, stats, outputs, now):
            pass

    engine, observer = Recording(steps=1), Observer()
    front = AsyncEngine(engine, observer)
    front.start()

    async def main():
        front.abort_all()
        return [(o.new_token_ids, o.finished, o.finish_reason, o.num_prompt_tokens, o.num_output_tokens)
                async for o in front.generate("late", [1, 2, 3], SamplingParams(max_tokens=4))]

    try:
        outputs = asyncio.run(asyncio.wait_for(main(), 5))
    finally:
        front.shutdown()
    assert outputs == [([], True, "abort", 3, 0)]
    assert added == [] and engine.requests == {} and front._streams == {}
    assert observer.calls == [("arrival", "late"), ("forget", "late")]  # metrics count it as aborted


def test_shutdown_says_whether_the_engine_thread_ended():
    """A step still running after the wait (here a step that blocks until released, 0.1 s of
    wait): False, then True once it has finished; ``serve`` logs which."""
    import threading

    release, inside = threading.Event(), threading.Event()

    class SlowStep(FakeEngine):
        def step_parts(self):
            inside.set()
            release.wait(5)
            yield from super().step_parts()

    front = AsyncEngine(SlowStep(steps=1))
    front.start()
    front._commands.put(("add", "r", [1], SamplingParams(max_tokens=1), time.monotonic()))
    assert inside.wait(5)  # the engine thread is inside the step
    assert front.shutdown(timeout_s=0.1) is False
    release.set()
    assert front.shutdown(timeout_s=5) is True
