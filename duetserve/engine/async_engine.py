"""The engine loop beside an asyncio event loop.

``EngineLoop`` runs an ``LLMEngine``: it takes commands (add, abort, abort all, stop), runs the
engine's iterations while work exists, and sends what they make (each part's outputs, an
iteration's stats) to an ``Events`` sink. ``EngineFront`` is the asyncio side: one stream a
request, and the ``Events`` applied to them and to the metrics' observer. ``AsyncEngine`` runs the
loop on a thread of the server's process; ``duetserve.engine.engine_process.EngineProcess`` runs
it in a process of its own, so that the engine's Python does not share a GIL with the event loop
(docs/design.md section 2, "Host time and the GIL").
"""
from __future__ import annotations

import abc
import asyncio
import functools
import logging
import multiprocessing.process
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from duetserve.engine.engine import LLMEngine, RequestLimits, RequestOutput, StepStats, check_request
from duetserve.planner.cost_model import CostModel
from duetserve.sampling import SamplingParams

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 5e-4
"""GIL switch interval while serving (seconds; ``AsyncEngine.start``)."""
IDLE_POLL_S = 0.05
"""How long an idle ``EngineLoop`` waits for a command before it looks again (seconds)."""


class EngineError(RuntimeError):
    """The engine failed while running this request; the request was dropped."""


class StepObserver(Protocol):
    """Receives every iteration's stats and outputs (e.g. Prometheus metrics); all calls come
    from one thread (the engine thread, or an engine process's reader), so an observer needs no
    locking."""

    def on_step(self, stats: StepStats | None, outputs: list[RequestOutput], now: float) -> None:
        """``outputs`` delivered at ``now`` (monotonic seconds); ``stats`` once per iteration,
        with its last part's outputs (None with the parts before)."""

    def on_arrival(self, request_id: str, now: float) -> None: ...

    def forget(self, request_id: str) -> None:
        """``request_id`` was aborted before it finished."""


class Commands(Protocol):
    """Where an ``EngineLoop`` takes its commands from: tuples ``("add", request_id, prompt token
    ids, SamplingParams, arrival monotonic seconds)``, ``("abort", request_id)``,
    ``("abort_all",)`` and ``("stop",)``."""

    def get(self, timeout: float | None) -> tuple | None:
        """The next command, waiting up to ``timeout`` seconds (None: not waiting); None if none came."""

    def pending(self) -> bool:
        """Whether a command waits (a multi-step decode then starts no further step)."""


class Events(Protocol):
    """Where an ``EngineLoop`` sends what it makes, in the order it makes it."""

    def deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """One request's output, or the exception that ended it."""

    def part(self, outputs: list[RequestOutput], stats: StepStats | None, now: float) -> None:
        """One part of an iteration: its outputs, made at ``now``, and with the last part the
        iteration's stats (``StepObserver.on_step``)."""

    def arrival(self, request_id: str, now: float) -> None:
        """``request_id`` reached the engine; it arrived at ``now`` (``StepObserver.on_arrival``)."""

    def forget(self, request_id: str) -> None:
        """``request_id`` was aborted (``StepObserver.forget``)."""


class EngineLoop:
    """Runs ``engine`` (an ``LLMEngine``): applies ``commands`` and runs iterations while work
    exists, sending their outputs to ``events``. An exception inside an iteration fails the
    requests in flight (each gets ``EngineError``) and the loop goes on serving new ones. After
    ``("abort_all",)`` a request that reaches it is not started: it ends at once, with no tokens."""

    def __init__(self, engine: LLMEngine, commands: Commands, events: Events):
        self.engine, self.commands, self.events = engine, commands, events
        self.closing = False
        engine.set_interrupt(commands.pending)  # new work ends a multi-step decode

    def run(self) -> None:
        """Until a ``("stop",)`` command (a step in flight finishes first)."""
        engine = self.engine
        while True:
            command = self.commands.get(None if engine.has_unfinished() else IDLE_POLL_S)
            while command is not None:
                if command[0] == "stop":
                    return
                try:
                    self._handle(command)
                except Exception:  # never let one command end the loop
                    log.exception("engine command %s failed", command[0])
                command = self.commands.get(None)
            if not engine.has_unfinished():
                continue
            try:
                for outputs in engine.step_parts():  # a look-ahead plan's steps, one by one
                    self.events.part(outputs, engine.last_stats, time.monotonic())  # stats with the last part
            except Exception as exc:
                log.exception("engine step failed; failing the requests in flight")
                for request_id in engine.request_ids():
                    engine.abort(request_id)
                    self.events.deliver(request_id, EngineError(f"engine step failed: {exc}"))

    def _handle(self, command: tuple) -> None:
        """Apply an ``add``, ``abort`` or ``abort_all``."""
        engine, events = self.engine, self.events
        if command[0] == "add":
            _, request_id, prompt, params, arrival = command
            if self.closing:  # counted as aborted (metrics), as those abort_all ended
                events.arrival(request_id, arrival)
                events.forget(request_id)
                events.deliver(request_id, RequestOutput(request_id, [], "", True, "abort", len(prompt), 0))
                return
            try:
                engine.add_request(request_id, prompt, params)
            except Exception as exc:  # validated before queuing; a race (duplicate id) lands here
                events.deliver(request_id, exc)
                return
            events.arrival(request_id, arrival)
            return
        if command[0] == "abort_all":
            self.closing = True
        for request_id in engine.request_ids() if command[0] == "abort_all" else [command[1]]:
            out = engine.abort(request_id)
            events.forget(request_id)
            if out is not None:
                events.deliver(request_id, out)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)


@dataclass
class EngineInfo:
    """What the server reads of an engine: its name, tokenizer (Hugging Face, or None), the
    limits requests are checked against, and its cost model (the iteration log's predictions).
    Plain data, so an engine in another process can send it (``EngineProcess``)."""

    model_name: str
    tokenizer: Any
    limits: RequestLimits
    cost_model: CostModel | None

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(engine.model_name, engine.tokenizer, engine.limits, engine.cost_model)


class EngineFront(abc.ABC):
    """The asyncio side of an engine loop: each request's stream, fed by the loop's ``Events``
    (this class implements them), and the ``observer`` (metrics) told of every part. Subclasses
    say where the loop runs (``_send`` takes a command to it) and what the server may read of the
    engine (``info``, and the gauges ``num_running``, ``num_waiting``, ``kv_usage``)."""

    def __init__(self, observer: StepObserver | None = None):
        self.observer = observer
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    # Set by subclasses: the thread or process that runs the engine loop, and the thread that
    # ``start`` starts (the loop's own thread, or the reader of an engine process's events).
    _loop_runner: threading.Thread | multiprocessing.process.BaseProcess
    _starts: threading.Thread

    def start(self) -> None:
        """Start the engine's side. Also lowers the interpreter's thread switch interval to
        ``SWITCH_INTERVAL_S`` (process-wide): with Python's 5 ms default, the event loop
        (streaming every request's tokens) could keep the GIL up to 5 ms after the device
        finished a step, while the thread that hands the step's outputs over (and on a thread,
        launches the next step) waited for it."""
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._starts.start()

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Stop the engine loop; wait up to ``timeout_s`` seconds for its thread or process (a
        step in flight finishes first). True when it has ended."""
        self._send(("stop",))
        self._loop_runner.join(timeout=timeout_s)
        return not self._loop_runner.is_alive()

    @property
    def is_alive(self) -> bool:
        """Whether the engine loop's thread or process runs."""
        return self._loop_runner.is_alive()

    @abc.abstractmethod
    def _send(self, command: tuple) -> None:
        """Take ``command`` (``Commands``) to the engine loop, thread-safe, without waiting."""

    @property
    @abc.abstractmethod
    def info(self) -> EngineInfo:
        """The engine as the server reads it."""

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """``duetserve.engine.engine.check_request`` against the engine's limits (raises ``ParamError``)."""
        check_request(self.info.limits, prompt_token_ids, params)

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def tokenizer(self):
        return self.info.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.info.limits.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.limits.vocab_size

    @property
    def cost_model(self) -> CostModel | None:
        return self.info.cost_model

    @abc.abstractmethod
    def num_running(self) -> int:
        """Requests in the running batch (the ``vllm:num_requests_running`` gauge)."""

    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Requests waiting to be scheduled."""

    @abc.abstractmethod
    def kv_usage(self) -> float:
        """KV-cache usage, 0 to 1."""

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until it finishes.

        Raises:
            ParamError: the request is invalid (raised before anything is queued).
            EngineError: the engine failed while running it.
        The request is aborted if the consumer stops iterating (e.g. the client disconnected).
        """
        self.check_request(prompt_token_ids, params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send(("add", request_id, prompt_token_ids, params, time.monotonic()))
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
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        """End every request now (thread-safe, returns at once): each stream gets a last output
        with ``finish_reason`` ``abort``, so clients see the response end (``serve``'s shutdown
        timeout). From then on a request that reaches the engine loop (e.g. one that was still
        being tokenized) is not started: it gets that last output at once, with no tokens."""
        self._send(("abort_all",))

    # --- Events ------------------------------------------------------------------------

    def deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the event loop is closed (shutting down)
                self._streams.pop(request_id, None)

    def part(self, outputs: list[RequestOutput], stats: StepStats | None, now: float) -> None:
        """Hand one part's outputs to their streams with one wake-up per event loop (not one
        per request: at 64 streams those wake-ups cost the engine thread milliseconds a step),
        then tell the observer."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed (shutting down)
                for _, out in items:
                    self._streams.pop(out.request_id, None)
        if self.observer:
            try:
                self.observer.on_step(stats, outputs, now)
            except Exception:  # metrics must never stop the engine
                log.exception("metrics update failed")

    def arrival(self, request_id: str, now: float) -> None:
        if self.observer:
            self.observer.on_arrival(request_id, now)

    def forget(self, request_id: str) -> None:
        if self.observer:
            self.observer.forget(request_id)


class _QueueCommands:
    """``Commands`` from a thread-safe queue (``AsyncEngine``)."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()

    def put(self, command: tuple) -> None:
        self._queue.put(command)

    def get(self, timeout: float | None) -> tuple | None:
        try:
            return self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()
        except queue.Empty:
            return None

    def pending(self) -> bool:
        return not self._queue.empty()


class AsyncEngine(EngineFront):
    """``EngineFront`` whose loop runs ``engine`` on a thread of this process (``start``)."""

    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None):
        super().__init__(observer)
        self.engine = engine
        self._commands = _QueueCommands()
        self._loop_runner = self._starts = threading.Thread(target=EngineLoop(engine, self._commands, self).run,
                                                            name="duetserve-engine", daemon=True)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)

    @functools.cached_property
    def info(self) -> EngineInfo:
        return EngineInfo.of(self.engine)

    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    def kv_usage(self) -> float:
        return self.engine.block_manager.usage
