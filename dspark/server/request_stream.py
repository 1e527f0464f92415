"""The outputs of one request on the event loop, as AsyncEngine hands them over.

A reader that falls behind gets the pending outputs merged into one (later outputs carry the
cumulative text; only the deltas join), so slow clients cost no extra work.
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


class RequestStream:
    """The outputs of one request, consumed by exactly one reader on the event loop."""

    def __init__(self, request_id: str, owner: StreamOwner):
        self.request_id = request_id
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.finished = False
        self._owner = owner
        self._buffer: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                output = await self._next()
                self.finished = output.finished
                yield output
        finally:
            self.close()

    async def _next(self) -> RequestOutput:
        while not self._buffer:
            self._ready.clear()
            await self._ready.wait()
        item = self._buffer.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        while self._buffer and isinstance(self._buffer[0], RequestOutput):
            item = _merge(item, self._buffer.popleft())
        return item

    def push(self, item: RequestOutput | BaseException) -> None:
        self._buffer.append(item)
        self._ready.set()

    def close(self) -> None:
        """Abort in the engine unless finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


def _merge(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Later outputs carry the cumulative text; only the deltas need joining."""
    return dataclasses.replace(later, new_text=earlier.new_text + later.new_text,
                               new_token_ids=earlier.new_token_ids + later.new_token_ids)


def _merge(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Later outputs carry the cumulative text; only the deltas need joining."""
    return dataclasses.replace(later, new_text=earlier.new_text + later.new_text,
                               new_token_ids=earlier.new_token_ids + later.new_token_ids)
