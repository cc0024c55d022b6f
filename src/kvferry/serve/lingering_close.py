"""Lingering close: a connection closed while its request body is still
arriving reads and discards the rest for a while before it closes.

A server that answers before reading a body (a 413 for a declared 9.5 MB
body, a 401) and then closes its socket with unread bytes in it makes the
kernel send a reset. A client that sends its whole body before reading
(urllib, httpx, curl without ``Expect``) then fails with "connection reset
by peer" and never sees the answer, which was already on its way. nginx's
answer is the lingering close, done here the same way:

1. the response is flushed and the write side shut down (FIN: the client
   can read the whole answer);
2. what still arrives is read and thrown away, without parsing, for at most
   ``LINGER_TIME_S`` in all, ``LINGER_TIMEOUT_S`` without data, and
   ``LINGER_MAX_BYTES``;
3. then the socket closes (the client has read by then, or gave up).

``LingeringTransport`` wraps the connection's transport for uvicorn's h11
protocol: its ``close()`` lingers when the protocol says a request body is
unfinished, and closes at once otherwise.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

LINGER_TIME_S = 30.0  # nginx's lingering_time
LINGER_TIMEOUT_S = 5.0  # nginx's lingering_timeout
LINGER_MAX_BYTES = 64 * 1024 * 1024


class LingeringTransport:
    """An asyncio transport whose ``close()`` lingers while
    ``body_unfinished()``; everything else goes to the real transport."""

    def __init__(self, transport: asyncio.Transport, body_unfinished: Callable[[], bool],
                 loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._body_unfinished = body_unfinished
        self._loop = loop
        self.lingering = False
        self._discarded = 0
        self._started = 0.0
        self._deadline: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        if self.lingering or self._transport.is_closing() or not self._body_unfinished():
            self._close_now()
            return
        self.lingering = True
        self._started = self._loop.time()
        if self._transport.can_write_eof():
            self._transport.write_eof()  # after the buffered response: the client reads it, then EOF
        self._transport.resume_reading()  # flow control may have paused it while the app did not read
        self._arm(LINGER_TIMEOUT_S)

    def discard(self, data: bytes) -> None:
        """Bytes that arrived while lingering: counted and dropped."""
        self._discarded += len(data)
        if self._discarded > LINGER_MAX_BYTES:
            self._close_now()
            return
        self._arm(LINGER_TIMEOUT_S)

    def eof_received(self) -> None:
        """The client finished sending: nothing left to drain."""
        self._close_now()

    def _arm(self, timeout_s: float) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        left = self._started + LINGER_TIME_S - self._loop.time()
        self._deadline = self._loop.call_later(max(0.0, min(timeout_s, left)), self._close_now)

    def _close_now(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._transport.close()
