"""What one request may ask of the server, so that no client can make it slow for the others.

Each limit bounds work that is paid outside the request's own share of the engine: the request
body is read and parsed on the event loop, every stop string is scanned on every step of the
engine thread, and a batch of prompts takes that many places in the queue at once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.exceptions import HTTPException

from dspark.server.errors import APIError


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 8 * 1024 * 1024     # request body; larger ones get 413
    max_prompts: int = 64                        # prompts in one /v1/completions request
    max_stop: int = 16                           # stop strings, and stop token ids, per request
    max_stop_chars: int = 256                    # characters in one stop string
    max_pending_outputs: int = 256               # engine outputs a streaming reader may leave unread

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check_stop(self, stop: list[str], stop_token_ids: list[int]) -> None:
        if len(stop) > self.max_stop:
            raise APIError(400, f"'stop' has {len(stop)} strings, more than this server's limit of "
                           f"{self.max_stop}", param="stop", code="too_many_stop_strings")
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_chars:
            raise APIError(400, f"a stop string has {longest} characters, more than this server's "
                           f"limit of {self.max_stop_chars}", param="stop", code="stop_string_too_long")
        if len(stop_token_ids) > self.max_stop:
            raise APIError(400, f"'stop_token_ids' has {len(stop_token_ids)} ids, more than this "
                           f"server's limit of {self.max_stop}", param="stop_token_ids",
                           code="too_many_stop_token_ids")

    def check_prompts(self, count: int) -> None:
        if count > self.max_prompts:
            raise APIError(400, f"'prompt' holds {count} prompts, more than this server's limit of "
                           f"{self.max_prompts} per request", param="prompt", code="too_many_prompts")


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
