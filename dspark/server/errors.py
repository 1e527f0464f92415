"""OpenAI-style error bodies for every failure the server reports.

Clients written against OpenAI read `error.message` / `error.param` and branch on the status, so
every path out of the server (our own checks, pydantic validation, unknown routes, unexpected
exceptions) answers with the same `{"error": {message, type, param, code}}` shape.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.server.protocol import FIELD_HINTS, ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A failure with the status and OpenAI error fields it should be reported with."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        message = printable(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def printable(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (a lone surrogate a client sent and a message
    quotes) escaped, so an error body can always be written."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def describe_validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message naming the first bad field (a union reports one error per member)."""
    if not errors:
        return "invalid request", None
    loc = [str(part) for part in errors[0].get("loc", ()) if part != "body"]
    if not loc:
        return f"invalid request body: {errors[0].get('msg', 'malformed')}", None
    param = loc[0]
    same_field = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == [param]]
    valued = next((e for e in same_field if e.get("type") == "value_error"), None)
    if valued is not None:           # a union member of the right type with a wrong value says more
        where = ".".join(str(p) for p in valued.get("loc", ()) if p != "body")
        return f"'{where}': {valued.get('msg', 'invalid value')}", param
    leaf = next((part for part in reversed(loc) if part in FIELD_HINTS), param)
    if len(same_field) > 1 and leaf in FIELD_HINTS:
        return f"'{param}' has the wrong type: expected {FIELD_HINTS[leaf]}", param
    where = ".".join(loc)
    return f"'{where}': {errors[0].get('msg', 'invalid value')}", param


async def _validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if errors and errors[0].get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json").response()
    message, param = describe_validation_error(errors)
    return APIError(400, message, param=param, code=_error_code(errors)).response()


def _error_code(errors: list[dict[str, Any]]) -> str:
    kind = str(errors[0].get("type", "")) if errors else ""
    if kind == "missing":
        return "missing_required_parameter"
    if kind.endswith("_type") or len(errors) > 1:       # several errors: every union member failed
        return "invalid_type"
    return "invalid_value"


async def _api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    if exc.status >= 500:
        logger.error("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
    return exc.response()


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if exc.status_code == 404 else None
    return APIError(exc.status_code, str(exc.detail), code=code).response()


async def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
