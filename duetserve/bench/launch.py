"""Start a server process for a benchmark run, wait until it is healthy, and stop it after."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
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
        log_path: file for the server's stdout and stderr; a temporary file when ``None``.
    """

    command: str
    health_url: str
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0
    log_path: Path | None = None


class ServerProcess:
    """Context manager running a server in its own process group.

    ``__enter__`` starts the process and returns once ``health_url`` answers 200; ``__exit__``
    sends SIGTERM to the group, then SIGKILL after ``stop_timeout_s``.

    Raises (from ``__enter__``):
        RuntimeError: something already answers at ``health_url`` before the launch (another
            server on that port), or the process exits before it is healthy (with its exit
            code and the tail of its log).
        TimeoutError: it is not healthy within ``startup_timeout_s``.
        OSError: the command cannot be started.
    """

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.log_path = config.log_path or Path(
            tempfile.mkstemp(prefix="duetserve-bench-server-", suffix=".log")[1]
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def log_tail(self) -> str:
        """The last few thousand characters of the server's log."""
        return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]

    def __enter__(self) -> ServerProcess:
        if self._healthy():  # whatever answers there is not the server this run launches
            raise RuntimeError(f"{self.config.health_url} already answers before the launch: another server is "
                               "running there; stop it or launch on another port (--base-url)")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                shlex.split(self.config.command),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

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
