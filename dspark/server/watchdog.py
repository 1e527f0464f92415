"""A step that never returns must not hang the server.

Under data parallelism every collective has a timeout, so a peer that stalls surfaces as an
error on rank 0. Rank 0's own step has no such guard: if it hangs in its own compute, nothing
inside it will time out. This thread watches the step's start time from outside and, past the
limit, declares the engine dead (the server then answers 503 and exits non-zero).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class StepWatchdog:
    def __init__(self, limit_s: float, step_started: Callable[[], float | None],
                 on_stall: Callable[[float], None]):
        self.limit_s = limit_s
        self.step_started = step_started          # perf_counter() of the running step, or None
        self.on_stall = on_stall                  # called once, with the step's age in seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dspark-watchdog", daemon=True)

    def start(self) -> "StepWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        poll = min(1.0, self.limit_s / 8)
        while not self._stop.wait(poll):
            started = self.step_started()
            if started is not None and time.perf_counter() - started > self.limit_s:
                age = time.perf_counter() - started
                logger.error("the engine step has run %.1f s, past the %.0f s limit", age, self.limit_s)
                self.on_stall(age)
                return
