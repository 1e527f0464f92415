"""`X-Request-Id` on every response: the client's own, or a fresh one, so a client and the
server's logs can name the same request."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
HEADER = b"x-request-id"


class RequestIdHeader:
    """Pure ASGI middleware (streaming bodies pass untouched).  The id is also left in the
    request's state (`request.state.request_id`) for the routes."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(HEADER, b"").strip()
        request_id = given or uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = request_id.decode("latin-1")

        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, tagged)
