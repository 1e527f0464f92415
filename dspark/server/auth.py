"""`--api-key`: the API routes answer 401 unless the request carries `Authorization: Bearer KEY`.

As in vLLM, only the API is guarded (/v1/*, /tokenize, /detokenize): /health, /metrics and
/version stay open for load balancers and scrapers, and CORS preflights (OPTIONS) pass.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from dspark.server.errors import APIError

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
GUARDED_PATHS = ("/tokenize", "/detokenize")


def is_guarded(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in GUARDED_PATHS


class ApiKeyAuth:
    """Pure ASGI middleware (no body wrapping, so streaming and disconnect detection are
    untouched).  The key is compared in constant time, so response timing reveals nothing
    about how much of a guess was right."""

    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self.key = api_key.encode("utf-8")

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or not is_guarded(scope.get("path", ""))):
            await self.app(scope, receive, send)
            return
        problem = self._problem(dict(scope.get("headers") or []).get(b"authorization"))
        if problem is None:
            await self.app(scope, receive, send)
            return
        response = APIError(401, problem, code="invalid_api_key").response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _problem(self, header: bytes | None) -> str | None:
        """Why the request is refused, or None when it carries the key."""
        if not header:
            return "missing API key: send it as the header 'Authorization: Bearer <key>'"
        scheme, _, token = header.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return "the Authorization header must use the Bearer scheme: 'Authorization: Bearer <key>'"
        if not hmac.compare_digest(token.strip(), self.key):
            return "invalid API key"
        return None
