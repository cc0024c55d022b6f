"""A request's outputs as the server's handlers read them: ``RequestStream``
(an async iterator the engine client feeds on the event loop) and the
``RequestObserver`` hooks that metrics hang on it."""
from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from kvferry.outputs import RequestOutput

if TYPE_CHECKING:
    from kvferry.serve.engine_client import AsyncEngineClient


class RequestObserver(Protocol):
    """Told about request lifecycle events, on the event loop (for metrics)."""

    def on_arrival(self, stream: "RequestStream") -> None: ...
    def on_first_token(self, stream: "RequestStream", output: RequestOutput, now: float) -> None: ...
    def on_tokens(self, stream: "RequestStream", num_tokens: int, gap_s: float | None) -> None: ...
    def on_sequence_finished(self, stream: "RequestStream", output: RequestOutput, now: float) -> None: ...
    def on_request_finished(self, stream: "RequestStream", output: RequestOutput, now: float) -> None: ...
    def on_abort(self, stream: "RequestStream") -> None: ...


class _NullObserver:
    def on_arrival(self, stream): pass
    def on_first_token(self, stream, output, now): pass
    def on_tokens(self, stream, num_tokens, gap_s): pass
    def on_sequence_finished(self, stream, output, now): pass
    def on_request_finished(self, stream, output, now): pass
    def on_abort(self, stream): pass


class ObserverGroup:
    """Several observers told the same events, in order (the metrics, the autoscaler's window)."""

    def __init__(self, *observers: RequestObserver) -> None:
        self.observers = observers

    def on_arrival(self, stream):
        for o in self.observers:
            o.on_arrival(stream)

    def on_first_token(self, stream, output, now):
        for o in self.observers:
            o.on_first_token(stream, output, now)

    def on_tokens(self, stream, num_tokens, gap_s):
        for o in self.observers:
            o.on_tokens(stream, num_tokens, gap_s)

    def on_sequence_finished(self, stream, output, now):
        for o in self.observers:
            o.on_sequence_finished(stream, output, now)

    def on_request_finished(self, stream, output, now):
        for o in self.observers:
            o.on_request_finished(stream, output, now)

    def on_abort(self, stream):
        for o in self.observers:
            o.on_abort(stream)


END = object()  # queued after the last output: the reader stops there


class OutputQueue:
    """Outputs queued by the engine's side and read by one async reader;
    ``END`` or an exception ends the queue, and stays at its head once
    reached so that every later read reports the same end."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._ready = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        head = self._items[0]
        if head is END:
            raise StopAsyncIteration
        if isinstance(head, BaseException):
            raise head
        return self._items.popleft()

    def pending(self) -> list[RequestOutput]:
        """Outputs already here (without waiting), for coalescing chunks when
        the client reads slower than the engine steps."""
        items = []
        while self._items and self._items[0] is not END and not isinstance(self._items[0], BaseException):
            items.append(self._items.popleft())
        return items

    def _push(self, item: Any) -> None:
        self._items.append(item)
        self._ready.set()


class RequestStream(OutputQueue):
    """One request's outputs, in engine order: an async iterator of
    RequestOutput (one per sequence per step), ending after all n sequences
    finish. ``close()`` aborts the request if the engine has not finished it;
    call it in a ``finally`` so a vanished client frees its KV blocks."""

    def __init__(self, client: "AsyncEngineClient", request_id: str, n: int, arrival_time: float,
                 tenant: str = "") -> None:
        self.client = client
        self.request_id = request_id
        self.tenant = tenant  # the authenticated tenant ("" without tenants), for per-tenant metrics
        self.n = n
        self.arrival_time = arrival_time  # time.monotonic() when the HTTP request arrived
        self.first_token_time: float | None = None
        self.last_token_time: dict[int, float] = {}  # per sequence index
        self.num_finished = 0
        self.closed = False
        OutputQueue.__init__(self)

    @property
    def engine_finished(self) -> bool:
        return self.num_finished >= self.n

    def close(self) -> None:
        """Idempotent. Aborts the request in the engine unless it finished."""
        if self.closed:
            return
        self.closed = True
        if not self.engine_finished:
            self.client.abort_stream(self)

    # -- called by the client on the event loop ----------------------------
    def observe(self, out: RequestOutput, now: float, observer: RequestObserver) -> None:
        """Token timings of an output about to be pushed, told to ``observer``."""
        index = out.outputs[0].index
        num_new = len(out.new_token_ids)
        if num_new:
            if self.first_token_time is None:
                self.first_token_time = now
                observer.on_first_token(self, out, now)
            last = self.last_token_time.get(index)
            # Several tokens in one step (speculation) share the gap.
            observer.on_tokens(self, num_new, None if last is None else (now - last) / num_new)
            self.last_token_time[index] = now
        if out.finished:
            self.num_finished += 1
            observer.on_sequence_finished(self, out, now)
            if self.engine_finished:
                observer.on_request_finished(self, out, now)

    def push(self, output: RequestOutput) -> None:
        """One more output for the reader."""
        self._push(output)

    def end(self, error: BaseException | None = None) -> None:
        """No more outputs: the reader stops after those queued, or, with
        ``error``, raises it there (the request is then closed: a later
        ``close()`` aborts nothing)."""
        if error is not None:
            self.closed = True
        self._push(END if error is None else error)
