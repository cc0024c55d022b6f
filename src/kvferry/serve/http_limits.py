"""Limits on how clients may hold the server: slow or oversized headers and
bodies (slowloris), plus the X-Request-Id echo.

uvicorn bounds the header bytes (``h11_max_incomplete_event_size``) and
closes idle keep-alive connections (``--timeout-keep-alive``), but waits
forever for a request whose headers or body never finish. Two pieces close
that gap:

- ``header_timeout_protocol(s)``: an h11 protocol class that closes a
  connection (with a 408) when a request's headers are not complete ``s``
  seconds after the connection opened, or after the first bytes of a later
  request arrived on a kept-alive one. Between requests the connection is
  uvicorn's keep-alive timer's to close;
- ``RequestLimitsMiddleware``: an ASGI middleware that rejects too many
  headers (431) and ends a body not fully received in time (408, and the
  connection closes: its remaining bytes are unknown).

The same protocol closes a connection whose request body is still arriving
(a 413 answered before the body was read) with a lingering close
(``lingering_close.py``), so that a client that sends its whole body before
reading gets the answer rather than a connection reset.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvferry.serve.errors import APIError, error_response
from kvferry.serve.lingering_close import LingeringTransport

_REQUEST_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                        b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_HEADER_TIMEOUT_BODY = (b'{"error":{"message":"request headers not received in time","type":'
                        b'"invalid_request_error","param":null,"code":"request_timeout"}}')

# Request ids clients may send: visible ASCII, bounded (they end up in logs and ids).
MAX_REQUEST_ID_CHARS = 256


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol subclass whose header deadline is ``timeout_s``."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _partial_head = False  # bytes of a request head arrived since the timer was armed

        def data_received(self, data: bytes) -> None:
            if isinstance(self.transport, LingeringTransport) and self.transport.lingering:
                self.transport.discard(data)  # the rest of a refused body: never parsed
                return
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()  # the first bytes of the next request on a kept-alive connection
            self._partial_head = True
            super().data_received(data)

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(LingeringTransport(transport, self._body_unfinished, self.loop))
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            if isinstance(self.transport, LingeringTransport) and self.transport.lingering:
                self.transport.close()  # the lingering timer goes with it
            super().connection_lost(exc)

        def _body_unfinished(self) -> bool:
            """The client is still sending a request body (closing now would reset it)."""
            return self.conn.their_state is h11.SEND_BODY

        def on_response_complete(self) -> None:
            # Idle until the next request: uvicorn's keep-alive timer closes
            # the connection. It must outlast the clients' own idle expiry
            # (httpx: 5 s); a server that closes at the same instant races a
            # client sending on the connection, which then fails with no
            # response. The next request's first bytes arm the deadline.
            self._disarm_header_timer()
            self._partial_head = False
            super().on_response_complete()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._partial_head = False
            self._header_timer = self.loop.call_later(timeout_s, self._on_header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            # h11 stays IDLE for the client until a whole request head has
            # arrived; past IDLE the request is the app's to time (body).
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            # An idle connection just closes (as a keep-alive timeout does); a
            # client that began a request head learns why.
            if self._partial_head and self.conn.our_state is h11.IDLE:
                self.transport.write(_REQUEST_TIMEOUT_408 % (len(_HEADER_TIMEOUT_BODY), _HEADER_TIMEOUT_BODY))
            self.transport.close()

    return HeaderTimeoutH11Protocol


class BodyTimeout(APIError):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body was not received within {timeout_s:g} s",
                         code="request_timeout", close_connection=True)


class RequestLimitsMiddleware:
    """Header count limit, body deadline, and X-Request-Id validation/echo."""

    def __init__(self, app: ASGIApp, max_header_count: int, max_header_bytes: int,
                 body_read_timeout_s: float) -> None:
        self.app = app
        self.max_header_count = max_header_count
        # h11 bounds only a head still arriving; one that came whole is checked here.
        self.max_header_bytes = max_header_bytes
        self.body_read_timeout_s = body_read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if len(headers) > self.max_header_count:
            await error_response(431, f"too many request headers ({len(headers)} > {self.max_header_count})",
                                 code="request_header_fields_too_large", close_connection=True)(scope, receive, send)
            return
        size = sum(len(name) + len(value) for name, value in headers)
        if size > self.max_header_bytes:
            await error_response(431, f"request headers too large ({size} > {self.max_header_bytes} bytes)",
                                 code="request_header_fields_too_large", close_connection=True)(scope, receive, send)
            return
        request_id = _request_id(headers)
        if request_id is not None and not _valid_request_id(request_id):
            await error_response(400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters",
                                 param="X-Request-Id")(scope, receive, send)
            return
        await self.app(scope, self._deadline_receive(receive), _echo_request_id(send, request_id))

    def _deadline_receive(self, receive: Receive) -> Receive:
        deadline = time.monotonic() + self.body_read_timeout_s
        body_done = False

        async def wrapped() -> Message:
            nonlocal body_done
            if body_done:  # after the body only a disconnect comes: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise BodyTimeout(self.body_read_timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        return wrapped


def _request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"x-request-id":
            return value.decode("latin-1")
    return None


def _valid_request_id(value: str) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and all("!" <= c <= "~" for c in value)


def _echo_request_id(send: Send, request_id: str | None) -> Send:
    if request_id is None:
        return send

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []),
                                              (b"x-request-id", request_id.encode("ascii"))]}
        await send(message)

    return wrapped


def client_request_id(headers: Any) -> str | None:
    """The X-Request-Id a client sent (already validated by the middleware)."""
    return headers.get("x-request-id")
