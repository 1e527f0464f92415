"""The outputs of one request on the event loop, as AsyncEngine hands them over.

Pending outputs are merged as they arrive (later outputs carry the cumulative text; only the
deltas join), so a reader that falls behind costs one buffered output, not one per step. A
reader that stays behind for `max_pending` outputs (a streaming client that stopped reading:
its socket's buffers are full) is cut off: its request is aborted, which frees its KV blocks
for clients that do read, and the reader, should it come back, gets an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol

from dspark.outputs import RequestOutput


class StreamOwner(Protocol):
    def abort(self, request_id: str) -> None: ...

    def reader_too_slow(self, request_id: str) -> None: ...


class ReaderTooSlow(Exception):
    """The reader left too many outputs unread; its request was aborted."""

    status = 408
    code = "client_too_slow"


class RequestStream:
    """The outputs of one request, consumed by exactly one reader on the event loop."""

    def __init__(self, request_id: str, owner: StreamOwner, max_pending: int | None = None):
        self.request_id = request_id
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.finished = False
        self.max_pending = max_pending
        self.unread = 0                       # outputs pushed since the reader last took one
        self._owner = owner
        self._buffer: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:                 # until the final output, or an error raised by _next
                output = await self._next()
                self.finished |= output.finished
                yield output
                if output.finished:
                    return
        finally:
            self.close()

    async def _next(self) -> RequestOutput:
        while not self._buffer:
            self._ready.clear()
            await self._ready.wait()
        self.unread = 0
        item = self._buffer.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item

    def push(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput) and self._buffer and isinstance(self._buffer[-1], RequestOutput):
            self._buffer[-1] = _merge(self._buffer[-1], item)
        else:
            self._buffer.append(item)
        self.unread += 1
        self._ready.set()
        if (self.max_pending is not None and self.unread > self.max_pending
                and isinstance(item, RequestOutput) and not item.finished and not self.finished):
            self._cut_off()

    def _cut_off(self) -> None:
        self.finished = True
        self._owner.reader_too_slow(self.request_id)
        self._owner.abort(self.request_id)
        self._buffer.clear()
        self._buffer.append(ReaderTooSlow(f"the client fell {self.unread} outputs behind its stream "
                                          "and was cut off; the request was aborted"))

    def close(self) -> None:
        """Abort in the engine unless finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


def _merge(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Later outputs carry the cumulative text; only the deltas need joining."""
    return dataclasses.replace(later, new_text=earlier.new_text + later.new_text,
                               new_token_ids=earlier.new_token_ids + later.new_token_ids)
