"""Runs the engine loop on its own thread beside an asyncio event loop."""
from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Protocol

from duetserve.engine.engine import LLMEngine, RequestOutput, StepStats
from duetserve.sampling import SamplingParams

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 5e-4
"""GIL switch interval while serving (seconds; ``AsyncEngine.start``)."""


class EngineError(RuntimeError):
    """The engine failed while running this request; the request was dropped."""


class StepObserver(Protocol):
    """Receives every iteration's stats and outputs (e.g. Prometheus metrics); every call comes
    from the engine thread, so an observer needs no locking."""

    def on_step(self, stats: StepStats | None, outputs: list[RequestOutput], now: float) -> None:
        """``outputs`` delivered at ``now`` (monotonic seconds); ``stats`` once per iteration,
        with its last part's outputs (None with the parts before)."""

    def on_arrival(self, request_id: str, now: float) -> None: ...

    def forget(self, request_id: str) -> None:
        """``request_id`` was aborted before it finished."""


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)


class AsyncEngine:
    """Thread-safe front of ``LLMEngine`` for asyncio code.

    One background thread owns the engine: it takes new requests and aborts from a queue,
    runs ``step()`` while work exists, and hands each ``RequestOutput`` to the request's
    ``asyncio.Queue`` on the event loop. An exception inside ``step()`` fails the requests
    in flight (they receive ``EngineError``) and the loop goes on serving new ones.
    """

    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None):
        self.engine = engine
        self.observer = observer
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._closing = threading.Event()  # set by abort_all: requests that reach the engine after it end at once
        self._thread = threading.Thread(target=self._run, name="duetserve-engine", daemon=True)
        engine.set_interrupt(lambda: not self._commands.empty())  # new work ends a multi-step decode

    def start(self) -> None:
        """Start the engine thread. Also lowers the interpreter's thread switch interval to
        ``SWITCH_INTERVAL_S`` (process-wide): with Python's 5 ms default, the event loop
        (streaming every request's tokens) could keep the GIL up to 5 ms after the device
        finished a step, and the engine thread would launch the next step that much later."""
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Stop the engine thread; wait up to ``timeout_s`` seconds for it (a step in flight
        finishes first). True when it has ended."""
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until it finishes.

        Raises:
            ParamError: the request is invalid (raised before anything is queued).
            EngineError: the engine failed while running it.
        The request is aborted if the consumer stops iterating (e.g. the client disconnected).
        """
        self.engine.check_request(prompt_token_ids, params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(("add", request_id, prompt_token_ids, params, time.monotonic()))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if finished:
                self._streams.pop(request_id, None)
            else:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request (thread-safe, returns at once); its KV blocks are freed by the engine loop."""
        self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """End every request now (thread-safe, returns at once): each stream gets a last output
        with ``finish_reason`` ``abort``, so clients see the response end (``serve``'s shutdown
        timeout). From this call on, a request that reaches the engine thread (e.g. one that was
        still being tokenized) is not started: it gets that last output at once, with no tokens."""
        self._closing.set()
        self._commands.put(("abort_all",))

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the event loop is closed (shutting down)
                self._streams.pop(request_id, None)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """Hand one part's outputs to their streams with one wake-up per event loop (not one
        per request: at 64 streams those wake-ups cost the engine thread milliseconds a step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed (shutting down)
                for stream, out in items:
                    self._streams.pop(out.request_id, None)

    def _handle(self, command) -> None:
        """Apply an ``add``, ``abort`` or ``abort_all`` on the engine thread (the only thread
        touching the engine and the observer)."""
        if command[0] == "add":
            _, request_id, prompt, params, arrival = command
            if self._closing.is_set():  # counted as aborted (metrics), as those abort_all ended
                if self.observer:
                    self.observer.on_arrival(request_id, arrival)
                    self.observer.forget(request_id)
                self._deliver(request_id, RequestOutput(request_id, [], "", True, "abort", len(prompt), 0))
                return
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception as exc:  # validated before queuing; a race (duplicate id) lands here
                self._deliver(request_id, exc)
                return
            if self.observer:
                self.observer.on_arrival(request_id, arrival)
        else:
            for request_id in self.engine.request_ids() if command[0] == "abort_all" else [command[1]]:
                out = self.engine.abort(request_id)
                if self.observer:
                    self.observer.forget(request_id)
                if out is not None:
                    self._deliver(request_id, out)

    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            try:
                command = self._commands.get(timeout=0.05) if idle else self._commands.get_nowait()
            except queue.Empty:
                command = None
            while command is not None:
                try:
                    self._handle(command)
                except Exception:  # never let one command end the loop
                    log.exception("engine command %s failed", command[0])
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                for outputs in self.engine.step_parts():  # a look-ahead plan's steps, one by one
                    self._deliver_all(outputs)
                    self._observe(self.engine.last_stats, outputs)  # stats with the last part only
            except Exception as exc:
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)

    def _observe(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        if self.observer:
            try:
                self.observer.on_step(stats, outputs, time.monotonic())
            except Exception:  # metrics must never stop the engine
                log.exception("metrics update failed")

    def _fail_all(self, exc: Exception) -> None:
        for request_id in self.engine.request_ids():
            self.engine.abort(request_id)
            self._deliver(request_id, EngineError(f"engine step failed: {exc}"))
