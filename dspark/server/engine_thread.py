"""The one thread that builds the server's engine and then runs its loop.

torch's CPU threading state belongs to the thread that set it up: an engine built on one thread
and stepped on another stepped at about half speed on a 2-core CPU (docs/measurements.md), so
the server builds its engine on the thread that will step it.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable


class EngineThread:
    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="dspark-engine", daemon=True)
        self.thread.start()      # a daemon: a stalled engine step never holds the process

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run fn(*args) on the thread, after what was submitted before."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args))
        return future

    def close(self) -> None:
        """The thread ends after what was submitted before."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            try:
                future.set_result(fn(*args))
            except BaseException as exc:           # noqa: BLE001 (handed to the caller)
                future.set_exception(exc)


__all__ = ["EngineThread"]
