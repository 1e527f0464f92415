"""Graceful shutdown: on SIGTERM or SIGINT the server drains before uvicorn cuts connections.

uvicorn's own shutdown closes the listening socket, then waits a bounded time for open requests
and cuts whatever is left: a streaming client sees its connection drop mid-answer and cannot
tell a deploy from a crash.  Here the drain starts at the signal instead: new requests (also on
kept-alive connections) are refused with a 503 at once, those in flight get the grace period to
finish, and the rest end with an error event naming the shutdown, all before uvicorn would cut
anything.  uvicorn's timeout stays a little above the grace, as a backstop only.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

logger = logging.getLogger(__name__)

BACKSTOP_S = 2.0            # uvicorn's own cut-off, past the grace period: never the normal path


class DrainingServer(uvicorn.Server):
    """A uvicorn server that runs `drain` (an AsyncEngine's, bound to its grace period) from
    the moment it is told to exit, alongside uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self._drain = drain
        self._drain_task: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Like uvicorn's, except that the signal is not raised again once the server is done:
        a drained server exits 0 (a second SIGINT still forces the exit)."""
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        if self._loop is not None:             # a signal handler: the drain starts on the loop
            self._loop.call_soon_threadsafe(self.start_drain)

    def start_drain(self) -> None:
        if self._drain_task is None:
            logger.info("shutting down: draining the requests in flight")
            self._drain_task = asyncio.ensure_future(self._drain_logged())

    async def _drain_logged(self) -> None:
        try:
            await self._drain()
        except Exception:                      # uvicorn's shutdown goes on regardless
            logger.exception("draining the requests in flight failed")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.start_drain()                     # also when told to exit without a signal
        await super().shutdown(sockets)
        if not self._drain_task.done():        # uvicorn's backstop fired first
            self._drain_task.cancel()


def graceful_config(app, grace_s: float, **kwargs) -> uvicorn.Config:
    """uvicorn's config with its cut-off just past the drain's grace period."""
    return uvicorn.Config(app, timeout_graceful_shutdown=grace_s + BACKSTOP_S, **kwargs)
