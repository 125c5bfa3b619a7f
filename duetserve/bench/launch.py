"""Start a server process for a benchmark run, wait until it is healthy, and stop it after."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

_POLL_S = 0.5
_LOG_TAIL_CHARS = 4000


@dataclass
class LaunchConfig:
    """How to run the server.

    Attributes:
        command: shell-style command line, e.g. ``"duetserve serve --model M --port 8000"``
            (split with :func:`shlex.split`, run without a shell).
        health_url: polled until it answers HTTP 200.
        startup_timeout_s: longest wait for health, seconds.
        stop_timeout_s: wait after SIGTERM before SIGKILL, seconds.
        log_path: file for the server's stdout and stderr; when ``None``, a temporary file that is
            deleted after a run in which the server stayed up and nothing failed (else kept, and its
            path printed or in the error).
    """

    command: str
    health_url: str
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0
    log_path: Path | None = None


DEFAULT_PORT = 8000
"""Port of a launched server without ``--port``: ``duetserve serve``'s and ``vllm serve``'s default."""
_LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}  # a wildcard address, reached here


def launched_base_url(command: str) -> str:
    """``http://HOST:PORT``, where the server that ``command`` starts listens: the command's ``--host``
    and ``--port`` (``--flag VALUE`` or ``--flag=VALUE``, the last one counting, as with argparse),
    by default 127.0.0.1 and ``DEFAULT_PORT``; a wildcard host (0.0.0.0, ::) is reached at loopback.

    Raises:
        ValueError: a ``--port`` that is no port number, or 0 (a free port, which no one is told).
    """
    found = {"--host": "127.0.0.1", "--port": str(DEFAULT_PORT)}
    words = shlex.split(command)
    for i, word in enumerate(words):
        flag, eq, value = word.partition("=")
        if flag in found and (eq or i + 1 < len(words)):
            found[flag] = value if eq else words[i + 1]
    host, port = _LOOPBACK.get(found["--host"], found["--host"]), found["--port"]
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"its --port {port} is not a port to reach the server at; give --base-url")
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


_LIVE: set[ServerProcess] = set()  # launched and not yet stopped (stop_servers_on_sigterm)


def stop_servers_on_sigterm(hard: bool = False) -> None:
    """Make SIGTERM (``timeout``, a CI cancel, ``kill``) stop every launched server before this
    process exits with status 143: the servers run in their own sessions, so the signal does
    not reach them, and Python's default exit skips ``__exit__``. Call from the main thread.
    ``hard``: exit at once after that (``os._exit``), for a process whose other threads would
    go on launching servers. SIGINT needs none of this (KeyboardInterrupt unwinds ``__exit__``)."""
    def handler(signum: int, _frame) -> None:
        for server in list(_LIVE):
            server.stop()
        if hard:
            os._exit(128 + signum)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


class ServerProcess:
    """Context manager running a server in its own process group.

    ``__enter__`` starts the process and returns once ``health_url`` answers 200; ``__exit__``
    sends SIGTERM to the group, then SIGKILL after ``stop_timeout_s``, and deletes a temporary log
    (no ``log_path``) unless the server exited on its own or the run raised (Ctrl-C is no failure):
    then it prints the log's path to stderr.

    Raises (from ``__enter__``):
        RuntimeError: something already answers at ``health_url`` before the launch (another
            server on that port), or the process exits before it is healthy (with its exit
            code and the tail of its log).
        TimeoutError: it is not healthy within ``startup_timeout_s``.
        OSError: the command cannot be started.
    """

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        # The server's log: without config.log_path, a temporary file that __enter__ creates.
        self.log_path: Path | None = config.log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def log_tail(self) -> str:
        """The last few thousand characters of the server's log ("" before it is started)."""
        return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:] if self.log_path else ""

    def __enter__(self) -> ServerProcess:
        if self._healthy():  # whatever answers there is not the server this run launches
            raise RuntimeError(f"{self.config.health_url} already answers before the launch: another server is "
                               "running there; stop it or launch on another port (--base-url)")
        if self._temporary_log:
            fd, name = tempfile.mkstemp(prefix="duetserve-bench-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        try:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    shlex.split(self.config.command),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            _LIVE.add(self)
        except OSError:  # nothing was logged
            if self._temporary_log:
                self.log_path.unlink(missing_ok=True)
            raise
        try:
            self._wait_healthy()
        except BaseException as exc:
            self.stop()
            if isinstance(exc, KeyboardInterrupt) and self._temporary_log:  # stopped by the user: no failure
                self.log_path.unlink(missing_ok=True)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        exited = self.proc is not None and self.proc.poll() is not None  # on its own, during the run
        self.stop()
        if not self._temporary_log:
            return
        if (exc_type is None or issubclass(exc_type, KeyboardInterrupt)) and not exited:
            self.log_path.unlink(missing_ok=True)
        else:
            why = f"it exited with code {self.proc.returncode} during the run" if exited else "the run failed"
            print(f"duetserve bench: server log kept ({why}): {self.log_path}", file=sys.stderr)

    @property
    def _temporary_log(self) -> bool:
        return self.config.log_path is None

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise self._exited(code)
            if self._healthy():
                return
            time.sleep(_POLL_S)
        raise TimeoutError(
            f"server not healthy at {self.config.health_url} after "
            f"{self.config.startup_timeout_s:g} s (log: {self.log_path}):\n{self.log_tail()}"
        )

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.config.health_url, timeout=2.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def _exited(self, code: int) -> RuntimeError:
        """The error for a launched command that exited with ``code`` during startup."""
        return RuntimeError(f"the launched command exited with code {code} before becoming healthy "
                            f"(log: {self.log_path}):\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL if it does not exit."""
        _LIVE.discard(self)
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(self.config.stop_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
