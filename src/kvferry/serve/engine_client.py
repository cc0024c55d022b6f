"""AsyncEngineClient: the engine loop in its own thread, driven from asyncio.

The engine is not thread-safe, so exactly one thread (the loop thread) ever
calls it. HTTP handlers talk to that thread through a command queue and get
outputs back through per-request asyncio queues::

    event loop (HTTP handlers)                      engine loop thread
    --------------------------                      ------------------
    add_request --AddRequest---> commands --+--> drain all, then:
                <--- accepted / ValueError --+       engine.add_request
    stream.close --AbortRequest-> commands   |       engine.abort_request
    RequestStream <--- one step's outputs ---+--- engine.step()
                       (call_soon_threadsafe)

Why a thread and not a task: a step (a long prefill) can take a second on a
CPU; torch releases the GIL inside kernels, so the event loop keeps serving
other streams, health checks and metrics meanwhile. Why a queue of commands
rather than locks: the loop drains every pending command before each step,
so many arrivals batch into one step, and the engine needs no locking.

The seam is deliberate: a later router puts processes between the HTTP side
and the engine, and only this module changes.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from kvferry.core.scheduler import SchedulerStats
from kvferry.outputs import RequestOutput
from kvferry.sampling import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle loop blocks on the command queue before looking again.
_IDLE_POLL_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down)."""


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_namespace: str
    accepted: asyncio.Future  # resolved on the event loop: None or the add error


@dataclass(slots=True)
class AbortRequest:
    request_ids: list[str]


@dataclass(slots=True)
class Shutdown:
    pass


Command = AddRequest | AbortRequest | Shutdown


class RequestObserver(Protocol):
    """Told about request lifecycle events, on the event loop (for metrics)."""

    def on_first_token(self, stream: "RequestStream", output: RequestOutput, now: float) -> None: ...
    def on_tokens(self, num_tokens: int, gap_s: float | None) -> None: ...
    def on_sequence_finished(self, stream: "RequestStream", output: RequestOutput, now: float) -> None: ...
    def on_request_finished(self, stream: "RequestStream", output: RequestOutput, now: float) -> None: ...
    def on_abort(self, stream: "RequestStream") -> None: ...


class _NullObserver:
    def on_first_token(self, stream, output, now): pass
    def on_tokens(self, num_tokens, gap_s): pass
    def on_sequence_finished(self, stream, output, now): pass
    def on_request_finished(self, stream, output, now): pass
    def on_abort(self, stream): pass


_END = object()  # queued after a request's last sequence finishes


class RequestStream:
    """One request's outputs, in engine order: an async iterator of
    RequestOutput (one per sequence per step), ending after all n sequences
    finish. ``close()`` aborts the request if the engine has not finished it;
    call it in a ``finally`` so a vanished client frees its KV blocks."""

    def __init__(self, client: "AsyncEngineClient", request_id: str, n: int, arrival_time: float) -> None:
        self.client = client
        self.request_id = request_id
        self.n = n
        self.arrival_time = arrival_time  # time.monotonic() when the HTTP request arrived
        self.first_token_time: float | None = None
        self.last_token_time: dict[int, float] = {}  # per sequence index
        self.num_finished = 0
        self.closed = False
        # Outputs, then _END or an exception, which stay at the head once
        # reached so that every later read reports the same end.
        self._items: deque[Any] = deque()
        self._ready = asyncio.Event()

    @property
    def engine_finished(self) -> bool:
        return self.num_finished >= self.n

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        head = self._items[0]
        if head is _END:
            raise StopAsyncIteration
        if isinstance(head, BaseException):
            raise head
        return self._items.popleft()

    def pending(self) -> list[RequestOutput]:
        """Outputs already here (without waiting), for coalescing chunks when
        the client reads slower than the engine steps."""
        items = []
        while self._items and self._items[0] is not _END and not isinstance(self._items[0], BaseException):
            items.append(self._items.popleft())
        return items

    def close(self) -> None:
        """Idempotent. Aborts the request in the engine unless it finished."""
        if self.closed:
            return
        self.closed = True
        if not self.engine_finished:
            self.client._abort_stream(self)

    # -- called by the client on the event loop ----------------------------
    def _push(self, item: Any) -> None:
        self._items.append(item)
        self._ready.set()


class AsyncEngineClient:
    """Owns the engine loop thread. Construct it with a built engine, then
    ``await start()`` on the event loop that will use it."""

    def __init__(self, engine: Any, observer: RequestObserver | None = None,
                 check_integrity_when_idle: bool = False) -> None:
        self.engine = engine
        self.observer: RequestObserver = observer or _NullObserver()
        self.check_integrity_when_idle = check_integrity_when_idle
        # Read-only facts the HTTP side needs; safe to read from any thread.
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # event-loop side only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead_error: BaseException | None = None
        self._idle_checked = False  # loop thread only
        # Latest engine stats, replaced (never mutated) by the loop thread.
        self.stats: SchedulerStats = engine.stats()

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvferry-engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead_error is None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort whatever is left, stop the loop thread and wait for it."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(Shutdown())
            await asyncio.to_thread(self._thread.join, timeout_s)
            if self._thread.is_alive():
                logger.warning("engine loop did not stop within %.1f s", timeout_s)
        self._fail_all(EngineDeadError("the server is shutting down"))

    # -- requests (event loop) ------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_namespace: str = "", arrival_time: float | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it.

        Raises ValueError (the engine rejected the input), EngineDeadError, or
        CancelledError (the caller went away; the request is then aborted).
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        assert self._loop is not None
        stream = RequestStream(self, request_id, params.n, arrival_time or time.monotonic())
        accepted = self._loop.create_future()
        # Registered before the command is sent: outputs of the first step
        # may arrive right behind the acceptance.
        self._streams[request_id] = stream
        self._commands.put(AddRequest(request_id, prompt, params, cache_namespace, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            stream.close()  # FIFO: the abort lands after the add
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            stream.closed = True
            raise
        return stream

    def abort_all(self, reason: str) -> int:
        """End every open request now: abort it in the engine and raise
        EngineDeadError(reason) in its handler (which then reports it
        properly: a 503, or an error event and ``[DONE]`` on a stream).
        Used when a graceful shutdown runs out of time."""
        streams = list(self._streams.values())
        for stream in streams:
            self.observer.on_abort(stream)
        if streams:
            self._commands.put(AbortRequest([s.request_id for s in streams]))
        self._fail_all(EngineDeadError(reason))
        return len(streams)

    def _abort_stream(self, stream: RequestStream) -> None:
        if self._streams.pop(stream.request_id, None) is not None:
            self.observer.on_abort(stream)
        self._commands.put(AbortRequest([stream.request_id]))

    # -- delivery (event loop) ------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted after this step was planned
                continue
            self._observe(stream, out, now)
            stream._push(out)
            if stream.engine_finished:
                del self._streams[out.request_id]
                stream._push(_END)

    def _observe(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        index = out.outputs[0].index
        num_new = len(out.new_token_ids)
        if num_new:
            if stream.first_token_time is None:
                stream.first_token_time = now
                self.observer.on_first_token(stream, out, now)
            last = stream.last_token_time.get(index)
            # Several tokens in one step (speculation) share the gap.
            self.observer.on_tokens(num_new, None if last is None else (now - last) / num_new)
            stream.last_token_time[index] = now
        if out.finished:
            stream.num_finished += 1
            self.observer.on_sequence_finished(stream, out, now)
            if stream.engine_finished:
                self.observer.on_request_finished(stream, out, now)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.closed = True
            stream._push(error)

    # -- the loop thread --------------------------------------------------------
    def _post(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    def _run(self) -> None:
        # request_id -> sequences not yet finished; only this thread touches it.
        live: dict[str, int] = {}
        try:
            while self._iterate(live):
                pass
        except BaseException as exc:  # a crashed step: report it, never hang clients
            logger.exception("engine loop died")
            self._dead_error = exc
            self._post(self._fail_all, EngineDeadError(f"the engine loop died: {exc!r}"))

    def _iterate(self, live: dict[str, int]) -> bool:
        """One loop turn: apply every pending command, then one step if there
        is work. Returns False on shutdown."""
        busy = self.engine.has_unfinished_requests()
        commands = self._take_commands(block=not busy)
        for command in commands:
            if isinstance(command, Shutdown):
                self.engine.abort_request(list(live))
                live.clear()
                self.stats = self.engine.stats()
                return False
            self._apply(command, live)
        if self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            now = time.monotonic()
            for out in outputs:
                if out.finished and out.request_id in live:
                    live[out.request_id] -= 1
                    if live[out.request_id] == 0:
                        del live[out.request_id]
            if outputs:
                self._post(self._dispatch, outputs, now)
        if commands or busy:
            self._idle_checked = False
        if self.check_integrity_when_idle and not self._idle_checked and not self.engine.has_unfinished_requests():
            self.engine.check_integrity()  # once per busy -> idle transition
            self._idle_checked = True
        self.stats = self.engine.stats()
        return True

    def _take_commands(self, block: bool) -> list[Command]:
        commands: list[Command] = []
        if block:
            try:
                commands.append(self._commands.get(timeout=_IDLE_POLL_S))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: Command, live: dict[str, int]) -> None:
        if isinstance(command, AbortRequest):
            self.engine.abort_request(command.request_ids)
            for request_id in command.request_ids:
                live.pop(request_id, None)
            return
        assert isinstance(command, AddRequest)
        if command.accepted.cancelled():
            return  # the caller is gone; its abort follows in the queue
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.cache_namespace)
        except Exception as exc:  # ValueError: bad input; anything else: a bug, reported as 500
            if not isinstance(exc, ValueError):
                logger.exception("add_request failed for %s", command.request_id)
            self._post(_resolve, command.accepted, exc)
            return
        live[command.request_id] = command.params.n
        self._post(_resolve, command.accepted, None)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # cancelled by a vanished caller
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
