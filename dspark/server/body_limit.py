"""The request body limit, checked before anything parses the body."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException

from dspark.server.errors import APIError

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class BodyLimit:
    """Pure ASGI middleware: a body over the limit is refused with 413 before it is parsed,
    by its Content-Length or, for a chunked body, as soon as the bytes read pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        read = 0

        async def counted() -> dict:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.max_bytes:
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes"

    async def _refuse(self, scope: dict, receive: Callable, send: Callable) -> None:
        response = APIError(413, self._message(), code="request_too_large").response()
        await response(scope, receive, send)
