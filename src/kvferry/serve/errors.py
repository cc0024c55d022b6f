"""OpenAI-style errors: one exception type, one JSON body, one set of handlers.

Every failure the server reports, bad input or not, has the body
``{"error": {"message", "type", "param", "code"}}`` that the ``openai``
client parses, so clients see the same shape for a bad field, an unknown
route and an overloaded server.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)

# OpenAI's "type" strings, by status.
_ERROR_TYPE = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """Raised anywhere in a handler; turned into an OpenAI error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 close_connection: bool = False, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers  # extra response headers (e.g. Retry-After on a 429)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # For errors after which the connection's state is unknown (a body
        # not read to its end): tell the client not to reuse it.
        self.close_connection = close_connection


class ErrorJSONResponse(JSONResponse):
    """Error bodies echo client input (a model name, a field path). Escaping
    to ASCII keeps any string encodable, even one holding a lone surrogate,
    so that rendering an error can never fail in turn."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPE.get(status, "invalid_request_error" if status < 500 else "internal_server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   close_connection: bool = False) -> JSONResponse:
    # A 5xx means our state is suspect: the client must not reuse the connection.
    close = close_connection or status >= 500 and status != 503
    headers = {"Connection": "close"} if close else None
    return ErrorJSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    response = error_response(exc.status, exc.message, exc.param, exc.code, exc.close_connection)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    # The router's own 404 (unknown route) and 405 (wrong method).
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = exc.detail
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    response = error_response(exc.status_code, message, code=code)
    if exc.headers:  # e.g. Allow on a 405
        response.headers.update(exc.headers)
    return response


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal server error: {type(exc).__name__}", code="internal_error")


EXCEPTION_HANDLERS = {
    APIError: _api_error,
    HTTPException: _http_error,
    Exception: _internal_error,
}
