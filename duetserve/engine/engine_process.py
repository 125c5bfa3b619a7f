"""The engine loop in a process of its own (``serve --engine-process``).

In one process the engine thread and the HTTP event loop share the GIL, and PyTorch releases it
in every op, so each launch of an eager pass can wait for the event loop: on the H200 a busy
second thread stretched such passes 1.3-2.7x (docs/benchmarks.md, thirty-third session). vLLM
(its engine core process) and SGLang (its scheduler process) keep the engine loop apart from the
server; so does ``EngineProcess``. Served on the H200 (thirty-fourth session, Azure code QPS 16),
it cut the GPU's wait for the host from 4.7% to 3.6% of the wall time and served 1.02x the
requests of the thread; the served eager passes' GPU time stayed 1.16x the cost model's.

The server process keeps the requests' streams, the metrics and the tokenizer; the engine
process (started with ``spawn``: CUDA cannot be forked) builds the ``LLMEngine`` and runs
``EngineLoop``. One ``multiprocessing`` pipe carries, to the engine, the loop's commands
(``async_engine.Commands``) and, back, first ``("ready", EngineInfo)`` (or ``("error",
message)`` when the engine cannot start), then the loop's events in order: ``("part", outputs,
stats, now, gauges)``, ``("deliver", request_id, output or exception, gauges)``, ``("arrival",
request_id, now, gauges)``, ``("forget", request_id, gauges)``, the gauges (running and waiting
requests, KV usage) as they stand after the event. An iteration crosses once, whatever its number
of requests. If the engine process dies, the server logs it, fails the open requests and every new
one (HTTP 500), ``/health`` answers 500, and ``on_death`` is called (``serve``: shut the server
down and exit with status 1, as vLLM's server does, so that a supervisor restarts it). Times are
``time.monotonic()`` seconds, one clock for both processes on Linux.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from duetserve.config import EngineConfig
from duetserve.engine.async_engine import EngineError, EngineFront, EngineInfo, EngineLoop, StepObserver
from duetserve.engine.engine import LLMEngine, RequestOutput, StepStats
from duetserve.engine.scheduler import ScheduledSeq

log = logging.getLogger(__name__)


class EngineProcess(EngineFront):
    """``EngineFront`` whose loop runs ``LLMEngine(config)`` in a child process.

    The constructor starts the process and waits until the engine is up (the model loaded, its
    graphs recorded); ``start`` then starts the thread that reads the engine's events.
    ``on_death`` (attribute, None at first): called on that thread once the engine process has
    ended without ``shutdown`` and its streams have failed.

    Raises:
        ValueError: the engine could not start (the child's ``ValueError``, ``FileNotFoundError``
            or ``KeyError`` message, e.g. a flag that does not fit the model or the GPU).
        RuntimeError: the engine process failed otherwise, or ended before it was up.
    """

    def __init__(self, config: EngineConfig, observer: StepObserver | None = None):
        super().__init__(observer)
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_run_engine, args=(config, child, logging.getLogger().level),
                                        name="duetserve-engine", daemon=True)
        self._process.start()
        child.close()
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join()
            kind, payload = "failed", f"the engine process ended before it was up (exit code {self._process.exitcode})"
        if kind != "ready":
            self._process.join()
            raise (ValueError if kind == "error" else RuntimeError)(payload)
        self._info: EngineInfo = payload
        self._gauges: tuple[int, int, float] = (0, 0, 0.0)  # running, waiting, KV usage: the last event's
        self._lock = threading.Lock()  # a pipe end takes one sender at a time
        self._ended = threading.Event()  # the engine process is gone: streams fail, new requests too
        self._stopping = False  # shutdown asked the loop to stop (its end is no failure)
        self.on_death: Callable[[], None] | None = None
        self._loop_runner = self._process
        self._starts = threading.Thread(target=self._read, name="duetserve-engine-events", daemon=True)

    def _send(self, command: tuple) -> None:
        if not self._ended.is_set():
            try:
                with self._lock:
                    self._conn.send(command)
                return
            except OSError:  # the process is gone; the reader fails the streams
                pass
        if command[0] == "add":
            self.deliver(command[1], EngineError("the engine process has ended"))

    def _read(self) -> None:
        """Apply the engine's events until its process ends; then fail every open stream. Each
        event carries the engine's gauges as they stand after it."""
        try:
            while True:
                event = self._conn.recv()
                self._gauges = event[-1]
                if event[0] == "part":
                    self.part(*event[1:4])
                elif event[0] == "deliver":
                    self.deliver(event[1], event[2])
                elif event[0] == "arrival":
                    self.arrival(event[1], event[2])
                else:
                    self.forget(event[1])
        except (EOFError, OSError):
            pass
        self._ended.set()
        if not self._stopping:
            self._process.join(timeout=5)  # its pipe closes as it dies: wait for its exit code
        if self._streams or not self._stopping:
            log.error("the engine process has ended (exit code %s); failing %d open requests, and every new one",
                      self._process.exitcode, len(self._streams))
        self._gauges = (0, 0, 0.0)
        for request_id in list(self._streams):
            self.deliver(request_id, EngineError("the engine process has ended"))
        if not self._stopping and self.on_death is not None:
            self.on_death()

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """``EngineFront.shutdown``; the process's end is then no failure to log."""
        self._stopping = True
        return super().shutdown(timeout_s)

    @property
    def info(self) -> EngineInfo:
        return self._info

    def num_running(self) -> int:
        return self._gauges[0]

    def num_waiting(self) -> int:
        return self._gauges[1]

    def kv_usage(self) -> float:
        return self._gauges[2]


class _PipeCommands:
    """``async_engine.Commands`` read from the pipe (in the engine process)."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def get(self, timeout: float | None) -> tuple | None:
        return self.conn.recv() if self.conn.poll(timeout or 0) else None

    def pending(self) -> bool:
        return self.conn.poll()


class _ServerGone(BaseException):
    """The server's end of the pipe closed: the engine process ends (not an engine failure, which
    ``EngineLoop`` would report and go on from)."""


class _PipeEvents:
    """``async_engine.Events`` written to the pipe (in the engine process), each with the engine's
    gauges (running and waiting requests, KV usage) as they stand after it."""

    def __init__(self, conn: Connection, engine: LLMEngine):
        self.conn, self.engine = conn, engine

    def _send(self, *event) -> None:
        scheduler = self.engine.scheduler
        try:
            self.conn.send((*event, (len(scheduler.running), len(scheduler.waiting), self.engine.block_manager.usage)))
        except OSError as exc:
            raise _ServerGone from exc

    def deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._send("deliver", request_id, item)

    def part(self, outputs: list[RequestOutput], stats: StepStats | None, now: float) -> None:
        if stats is not None:  # the metrics read (q, c) of the scheduled sequences, not the sequences
            stats = dataclasses.replace(stats, scheduled=[ScheduledSeq(None, s.num_new_tokens, s.num_cached_tokens,
                                                                       s.max_steps) for s in stats.scheduled])
        self._send("part", outputs, stats, now)

    def arrival(self, request_id: str, now: float) -> None:
        self._send("arrival", request_id, now)

    def forget(self, request_id: str) -> None:
        self._send("forget", request_id)


def _run_engine(config: EngineConfig, conn: Connection, log_level: int) -> None:
    """The engine process: build the engine, say so, run its loop until told to stop (or until
    the server's end of the pipe closes)."""
    # The server handles Ctrl-C and SIGTERM, drains its requests, then stops this loop. A signal
    # to the whole process group (a terminal's Ctrl-C, systemd's default KillMode, a launcher's
    # killpg) must not end the engine under that drain; if the server dies, the pipe's close does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(config)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        conn.send(("error", str(exc)))
        return
    except BaseException as exc:
        conn.send(("failed", f"the engine did not start: {type(exc).__name__}: {exc}"))
        raise
    conn.send(("ready", EngineInfo.of(engine)))
    gc.collect()  # what start-up left leaves the collector's view, as ``serve`` does in its process
    gc.freeze()
    try:
        EngineLoop(engine, _PipeCommands(conn), _PipeEvents(conn, engine)).run()
    except (EOFError, OSError, _ServerGone):  # the server went away
        pass
