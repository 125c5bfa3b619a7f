"""uvicorn's server with the shutdown ``duetserve serve`` promises: running requests end on time."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn's server; the requests still running ``shutdown_timeout`` seconds after its shutdown
    begins (at the first exit signal), or at a second Ctrl-C, are ended (``abort_all``), so their
    responses finish before uvicorn closes the connections (give ``config`` a
    ``timeout_graceful_shutdown`` a few seconds longer). A third Ctrl-C forces uvicorn out, as its
    second did (streams cut off, tracebacks logged).

    Args:
        config: uvicorn's configuration.
        abort_all: ends every running request (``AsyncEngine.abort_all``); called on the server's
            event loop.
        shutdown_timeout: seconds the shutdown waits for running requests before ``abort_all``.
    """

    def __init__(self, config: uvicorn.Config, abort_all: Callable[[], None], shutdown_timeout: float):
        super().__init__(config)
        self.abort_all = abort_all
        self.shutdown_timeout = shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's loop, set as it starts
        self.ended_early = False
        self.exit_signal: int | None = None  # the first exit signal received

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    async def shutdown(self, sockets=None) -> None:
        asyncio.get_running_loop().call_later(self.shutdown_timeout, self.abort_all)
        await super().shutdown(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.exit_signal is None:
            self.exit_signal = sig
        # A second Ctrl-C, whether or not the loop has begun the shutdown the first one asked for
        # (uvicorn looks every 0.1 s): waiting for the shutdown to begin let one that came sooner
        # force uvicorn out.
        if sig == signal.SIGINT and self.should_exit and self.loop is not None and not self.ended_early:
            self.ended_early = True
            self.loop.call_soon_threadsafe(self.abort_all)
            return
        super().handle_exit(sig, frame)
