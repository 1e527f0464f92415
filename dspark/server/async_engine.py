"""An asyncio front for the (single-threaded) Engine.

The Engine is not thread-safe and its step is long, blocking CPU/device work, so one dedicated
thread owns it: it applies queued commands (add, abort), runs `step()` while there is work and
sleeps on a condition variable when idle.  Running steps off the event loop keeps the HTTP side
responsive (new requests, disconnects, /metrics) while the model computes.

Outputs travel back to the loop in one `call_soon_threadsafe` per step and land in per-request
buffers; a reader that falls behind gets the pending outputs merged into one, so slow clients
cost no extra work.  Nothing here knows about HTTP: errors are typed exceptions the API layer
maps to status codes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from dspark.engine.engine import Engine, EngineStopped
from dspark.engine.parallel_sampling import request_ids
from dspark.outputs import RequestOutput, SpecStats
from dspark.sampling_params import SamplingParams
from dspark.server.engine_thread import EngineThread
from dspark.server.request_stream import RequestStream
from dspark.server.watchdog import StepWatchdog

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests are waiting than the server admits; the client should retry later."""


class EngineNotRunning(RuntimeError):
    """The engine thread is not started, or has stopped (shutdown)."""


class ServerShuttingDown(EngineNotRunning):
    """The server is draining before it exits: it admits nothing new and ends, after the grace
    period, what is still running (a deliberate stop, not an engine failure)."""


class RequestFailed(Exception):
    """The engine failed while running this request (the server itself keeps serving)."""


@dataclass
class StepReport:
    """What one engine step did, for metrics (computed in the engine thread)."""
    seconds: float
    outputs: list[RequestOutput]
    spec: SpecStats                      # counters added by this step only


@dataclass
class EngineState:
    waiting: int                         # queued in the server or the scheduler, not yet running
    running: int
    kv_usage: float
    free_blocks: int
    num_blocks: int
    runner: dict[str, int]               # the runner's counters so far (RunnerStats.counters)


class EngineObserver(Protocol):
    def on_step(self, report: StepReport) -> None: ...

    def on_state(self, state: EngineState) -> None: ...

    def on_abort(self, request_id: str) -> None: ...

    def on_slow_reader(self, request_id: str) -> None: ...


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: Engine, max_queue: int | None = 256,
                 observers: Sequence[EngineObserver] = (),
                 on_fatal: Callable[[BaseException], None] | None = None,
                 max_pending_outputs: int | None = None, thread: EngineThread | None = None):
        self.engine = engine
        self._worker = thread                # the thread that built the engine, if one did
        self.max_pending_outputs = max_pending_outputs   # a streaming reader's allowance (request_stream.py)
        self.on_fatal = on_fatal             # the server's exit, when the engine cannot go on
        self.fatal: BaseException | None = None
        self._step_started: float | None = None
        self._watchdog: StepWatchdog | None = None
        self.max_queue = max_queue
        self.observers = list(observers)
        self._cond = threading.Condition()
        self._inbox: list[_Add | _Abort] = []
        self._inbox_adds = 0             # guarded by _cond, like the two counters below
        self._in_transit = 0             # adds taken from the inbox, not yet in the scheduler
        self._engine_waiting = 0
        self._stopped = False
        self.draining = False                # set by `drain`: new requests are refused
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_done: concurrent.futures.Future | None = None

    # ---- lifecycle (event loop side) ------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = False
        self._worker = self._worker or EngineThread()
        self._loop_done = self._worker.submit(self._run)
        limit = self.engine.step_limit_s
        if limit is not None:
            self._watchdog = StepWatchdog(limit, lambda: self._step_started, self._stalled).start()

    def _stalled(self, age_s: float) -> None:
        self._die(self.engine.stalled(age_s))

    async def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._loop_done is not None:     # a stalled engine thread is left behind (daemon)
            await asyncio.to_thread(concurrent.futures.wait, [self._loop_done],
                                    None if self.fatal is None else 5.0)
            self._worker.close()
            self._worker = None              # a later start runs on a thread of its own
        for stream in list(self._streams.values()):
            if not stream.accepted.done():
                stream.accepted.set_exception(EngineNotRunning("the server is shutting down"))
            stream.push(RequestFailed("the server is shutting down"))
        self._streams.clear()

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, give those in flight `grace_s` seconds, then end the rest with
        ServerShuttingDown, aborted in the engine: called as the server starts shutting down, so
        clients get an answer or a clear error before their connections close, not a cut."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        logger.info("draining: %d request(s) in flight, up to %g s to finish", len(self._streams), grace_s)
        while self._streams and self.is_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._streams)
        if not left or self.fatal is not None:     # an engine failure answered them already
            return
        logger.warning("ending %d request(s) still running after the %g s grace period", len(left), grace_s)
        error = ServerShuttingDown(f"the server is shutting down; the request did not finish "
                                   f"within the {grace_s:g} s grace period")
        self._deliver([(request_id, error) for request_id in left])
        for request_id in left:
            self.abort(request_id)

    @property
    def is_running(self) -> bool:
        return self._loop_done is not None and not self._loop_done.done() and self.fatal is None

    @property
    def num_waiting(self) -> int:
        with self._cond:
            return self._waiting_locked()

    def _waiting_locked(self) -> int:
        return self._engine_waiting + self._inbox_adds + self._in_transit

    # ---- requests (event loop side) -------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """Queue a request (n = 1) without waiting; raises QueueFull when too many are waiting."""
        if params.n != 1:
            raise ValueError("a request with n > 1 has one stream per completion: use submit_n")
        return self.submit_n(prompt, params, request_id)[0]

    def submit_n(self, prompt: str | list[int], params: SamplingParams,
                 request_id: str | None = None) -> list[RequestStream]:
        """Queue a request without waiting: one stream per completion (`params.n`, the engine's
        child ids, in index order); raises QueueFull when too many are waiting."""
        if not self.is_running:
            raise EngineNotRunning("the engine is not running")
        if self.draining:
            raise ServerShuttingDown("the server is shutting down and admits no new requests")
        request_id = request_id or uuid.uuid4().hex
        streams = [RequestStream(i, self, self.max_pending_outputs) for i in request_ids(request_id, params.n)]
        with self._cond:
            if self.max_queue is not None and self._waiting_locked() >= self.max_queue:
                raise QueueFull(f"{self._waiting_locked()} requests are already waiting "
                                f"(max_queue={self.max_queue}); retry later")
            for stream in streams:
                self._streams[stream.request_id] = stream
            self._inbox.append(_Add(request_id, prompt, params, time.perf_counter()))
            self._inbox_adds += 1
            self._cond.notify()
        return streams

    async def add(self, prompt: str | list[int], params: SamplingParams,
                  request_id: str | None = None) -> RequestStream:
        """Submit and wait until the engine accepted the request (ValueError/TypeError if not)."""
        stream = self.submit(prompt, params, request_id)
        try:
            await stream.accepted
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs as the engine produces them; leaving early aborts the request at once."""
        stream = await self.add(prompt, params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Free the request's KV blocks at the engine's next turn (it is mid-step now or idle)."""
        self._streams.pop(request_id, None)
        with self._cond:
            self._inbox.append(_Abort(request_id))
            self._cond.notify()

    def reader_too_slow(self, request_id: str) -> None:
        """A reader fell too far behind (request_stream.py); its abort follows at once."""
        logger.warning("request %s: the client stopped reading its stream; aborting it", request_id)
        self._notify(lambda obs: obs.on_slow_reader(request_id))

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException | None]]) -> None:
        """On the loop: hand engine results to their streams (acceptances carry None)."""
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue                                      # aborted meanwhile
            if not stream.accepted.done():
                if isinstance(item, BaseException):
                    stream.finished = True
                    self._streams.pop(request_id, None)
                    stream.accepted.set_exception(item)
                    continue
                stream.accepted.set_result(None)
            if item is None:
                continue
            stream.push(item)
            if isinstance(item, BaseException) or item.finished:
                self._streams.pop(request_id, None)

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        logger.info("engine loop started")
        while True:
            commands = self._take(block=not self.engine.has_unfinished)
            if commands is None:
                break
            try:
                if not commands and not self.engine.has_unfinished:
                    self.engine.heartbeat()                   # idle for heartbeat_s: check peers
                    continue
                self._apply(commands)
                if self.engine.has_unfinished:
                    self._step()
                self._publish_state()
            except EngineStopped as exc:                      # e.g. a data-parallel rank failed
                self._die(exc)
                break
            except Exception:                                 # never let the loop die silently
                logger.exception("unexpected error in the engine loop")
                self._fail_in_flight(RequestFailed("internal error in the engine loop"))
        logger.info("engine loop stopped")

    def _take(self, block: bool) -> list[_Add | _Abort] | None:
        """The queued commands (None once stopped). An idle wait ends after the engine's
        `heartbeat_s` with no commands, so that a data-parallel group checks its ranks even
        while no request comes."""
        with self._cond:
            if block:
                self._cond.wait_for(lambda: self._inbox or self._stopped, self.engine.heartbeat_s)
            if self._stopped:
                return None
            commands, self._inbox = self._inbox, []
            self._in_transit, self._inbox_adds = self._inbox_adds, 0
            return commands

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        results: list[tuple[str, RequestOutput | BaseException | None]] = []
        for command in commands:
            if isinstance(command, _Abort):
                if self.engine.abort(command.request_id):
                    self._notify(lambda obs: obs.on_abort(command.request_id))
                continue
            ids = request_ids(command.request_id, command.params.n)     # the request's streams
            try:
                self.engine.add_request(command.prompt, command.params, command.request_id,
                                        arrival_time=command.arrival_time)
                results += [(i, None) for i in ids]
            except (ValueError, TypeError) as exc:
                results += [(i, exc) for i in ids]
            except Exception as exc:
                logger.exception("adding request %s failed", command.request_id)
                results += [(i, RequestFailed(f"could not add the request: {exc}")) for i in ids]
        with self._cond:
            self._in_transit = 0
            self._engine_waiting = self.engine.load().waiting
        self._send(results)

    def _step(self) -> None:
        before = dataclasses.replace(self.engine.spec_stats,
                                     accepted_per_position=list(self.engine.spec_stats.accepted_per_position))
        start = self._step_started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except EngineStopped:
            raise
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in the engine")
            self._fail_in_flight(RequestFailed(f"the engine failed while running this request: {exc}"))
            return
        finally:
            self._step_started = None
        report = StepReport(time.perf_counter() - start, outputs, self.engine.spec_stats.since(before))
        self._send([(out.request_id, RequestFailed(out.error) if out.error else out) for out in outputs])
        self._notify(lambda obs: obs.on_step(report))

    def _die(self, exc: BaseException) -> None:
        """Answer everything in flight with 503 (the engine is gone, not the request's fault),
        refuse new work, and let the server exit non-zero (told first, so that whoever sees a
        503 also sees the server going down)."""
        with self._cond:                 # the engine thread and the watchdog may both get here
            if self.fatal is not None:
                return
            self.fatal = exc
            self._stopped = True
        logger.error("the engine cannot continue: %s", exc)
        if self.on_fatal is not None:
            self.on_fatal(exc)
        error = EngineNotRunning(str(exc))
        if self._loop is not None:
            try:          # the streams belong to the loop: fail them there
                self._loop.call_soon_threadsafe(
                    lambda: self._deliver([(request_id, error) for request_id in list(self._streams)]))
            except RuntimeError:                              # the loop is closed already
                pass

    def _fail_in_flight(self, error: RequestFailed) -> None:
        """Abort (and free) every request in the engine: after a failed step its state is suspect.

        Failing the waiting requests too keeps a persistent fault from looping: an empty engine
        sleeps until the next request, which then gets its own answer.
        """
        failed = list(self.engine.requests)
        for request_id in failed:
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("aborting %s after a failure failed too", request_id)
        self._send([(request_id, error) for request_id in failed])

    def _publish_state(self) -> None:
        load = self.engine.load()
        with self._cond:
            self._engine_waiting = load.waiting
            waiting = self._waiting_locked()
        state = EngineState(waiting, load.running, load.kv_usage, load.free_blocks, load.num_blocks,
                            load.runner)
        self._notify(lambda obs: obs.on_state(state))

    def _notify(self, call: Callable[[EngineObserver], None]) -> None:
        for observer in self.observers:
            try:
                call(observer)
            except Exception:
                logger.exception("engine observer %r failed", observer)

    def _send(self, items: list[tuple[str, RequestOutput | BaseException | None]]) -> None:
        if not items or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, items)
        except RuntimeError:                                  # the loop is closed: shutting down
            logger.debug("dropping %d results after the event loop closed", len(items))


__all__ = ["AsyncEngine", "EngineNotRunning", "EngineObserver", "EngineState", "QueueFull",
           "RequestFailed", "RequestStream", "ServerShuttingDown", "StepReport"]
