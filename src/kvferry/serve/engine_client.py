"""AsyncEngineClient: the server's front end, an asyncio client of an engine
core in another process (engine/core_proc.py).

    event loop (HTTP handlers, this process)              engine core process
    ----------------------------------------              -------------------
    add_request: tokenize, validate, fan out --EngineCoreRequest--> step loop
    stream.close / stop string matched       --EngineCoreAbort---->
    output task: detokenize, stop strings    <--EngineCoreOutputs-- one per step
       -> RequestStream of each request          (token deltas + stats)

Text work (tokenization, detokenization, stop strings, SSE, pydantic) runs
here, under this process's GIL; the core's GIL does scheduling and compute
only. Validation uses the core's ready message, so ``add_request`` raises
ValueError at once and a bad request never crosses the socket.

If the core dies (its process exits, or it reports ``engine_error``), every
open stream ends with EngineDeadError, ``is_alive`` turns False (/health
503) and new requests get EngineDeadError (503).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from typing import Any, Protocol

import zmq
import zmq.asyncio

from kvferry.config import EngineArgs
from kvferry.core.scheduler import SchedulerStats
from kvferry.engine.core_client import CoreConnection, CoreProcess
from kvferry.engine.input_processor import InputProcessor, load_tokenizer
from kvferry.engine.output_processor import OutputProcessor
from kvferry.messages import (
    CoreOutput, EngineCoreAbort, EngineCorePurgeTenant, EngineCoreReady, EngineCoreShutdown, decode,
)
from kvferry.model.tokenizer import Tokenizer
from kvferry.outputs import RequestOutput
from kvferry.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core has stopped (crashed, was killed, or shut down)."""


class RequestObserver(Protocol):
    """Told about request lifecycle events, on the event loop (for metrics)."""

    def on_first_token(self, stream: "RequestStream", output: RequestOutput, now: float) -> None: ...
    def on_tokens(self, stream: "RequestStream", num_tokens: int, gap_s: float | None) -> None: ...
    def on_sequence_finished(self, stream: "RequestStream", output: RequestOutput, now: float) -> None: ...
    def on_request_finished(self, stream: "RequestStream", output: RequestOutput, now: float) -> None: ...
    def on_abort(self, stream: "RequestStream") -> None: ...


class _NullObserver:
    def on_first_token(self, stream, output, now): pass
    def on_tokens(self, stream, num_tokens, gap_s): pass
    def on_sequence_finished(self, stream, output, now): pass
    def on_request_finished(self, stream, output, now): pass
    def on_abort(self, stream): pass


_END = object()  # queued after a request's last sequence finishes


class RequestStream:
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
    """Front end of one engine core. Build it with a connection whose
    handshake is done, then ``await start()`` on the event loop that uses it."""

    def __init__(self, connection: CoreConnection, ready: EngineCoreReady, tokenizer: Tokenizer,
                 process: CoreProcess | None = None, observer: RequestObserver | None = None) -> None:
        self.connection = connection
        self.ready = ready
        self.process = process
        self.observer: RequestObserver = observer or _NullObserver()
        self.tokenizer = tokenizer
        self.max_model_len: int = ready.max_model_len
        self.input_processor = InputProcessor(tokenizer, ready)
        self.output_processor = OutputProcessor(tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._output_task: asyncio.Task | None = None
        self._dead_error: EngineDeadError | None = None
        self._stopped = False
        # Purges sent to the core, by purge id, until it answers.
        self._purges: dict[str, asyncio.Future[int]] = {}
        # Latest core stats, replaced by each message from the core.
        self.stats = SchedulerStats(kv_blocks_total=ready.num_kv_blocks)

    @classmethod
    def launch(cls, args: EngineArgs, name: str = "engine-0", check_integrity_when_idle: bool = False,
               ready_timeout_s: float = 600.0, log_level: str = "INFO") -> "AsyncEngineClient":
        """Start an engine core process and wait for its handshake (blocking:
        call before the event loop runs). Raises EngineCoreStartError (with
        the core's reason, e.g. a bad model path) when the core does not
        come up."""
        process = CoreProcess.start(args.create_engine_config(), name, check_integrity_when_idle, log_level)
        connection = CoreConnection(process.addresses)
        try:
            ready = connection.wait_ready(ready_timeout_s, process)
            tokenizer = load_tokenizer(ready)
        except BaseException:
            connection.close()
            process.stop(timeout_s=0)
            raise
        return cls(connection, ready, tokenizer, process)

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # One socket, two faces: the handshake used it blocking; now asyncio reads it.
        output = zmq.asyncio.Socket.shadow(self.connection.output.underlying)
        self._output_task = asyncio.create_task(self._output_loop(output), name="kvferry-core-outputs")
        if self.process is not None:
            self._loop.add_reader(self.process.sentinel, self._on_process_exit)

    @property
    def is_alive(self) -> bool:
        return (self._output_task is not None and self._dead_error is None and not self._stopped
                and (self.process is None or self.process.is_alive()))

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort whatever is left, stop the core and wait for it to exit."""
        if self._stopped:
            return
        self._stopped = True
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self._loop is not None and self.process is not None:
            self._loop.remove_reader(self.process.sentinel)
        try:
            self.connection.send(EngineCoreShutdown())
        except zmq.ZMQError:
            pass
        if self.process is not None:
            await asyncio.to_thread(self.process.stop, timeout_s)
        if self._output_task is not None:
            self._output_task.cancel()
            await asyncio.gather(self._output_task, return_exceptions=True)
        self.connection.close()

    # -- requests (event loop) ------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_namespace: str = "", arrival_time: float | None = None) -> RequestStream:
        """Validate and send a request to the core.

        Raises ValueError (bad input, naming the field) or EngineDeadError.
        """
        if not self.is_alive:
            raise self._dead_error or EngineDeadError("the engine core is not running")
        arrival = arrival_time or time.monotonic()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, requests = self.input_processor.process(request_id, prompt, params, cache_namespace, arrival)
        self.output_processor.add_request(request_id, text, requests)
        stream = RequestStream(self, request_id, params.n, arrival, requests[0].tenant)
        self._streams[request_id] = stream
        for req in requests:
            self.connection.send(req)
        return stream

    async def purge_tenant(self, tenant: str, timeout_s: float = 30.0) -> int:
        """Have the core drop the tenant's unused cached blocks; returns how
        many it dropped. Raises EngineDeadError, or TimeoutError."""
        if not self.is_alive:
            raise self._dead_error or EngineDeadError("the engine core is not running")
        purge_id = f"purge-{uuid.uuid4().hex}"
        future = self._purges[purge_id] = asyncio.get_running_loop().create_future()
        try:
            self.connection.send(EngineCorePurgeTenant(purge_id=purge_id, tenant=tenant))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._purges.pop(purge_id, None)

    def abort(self, request_id: str) -> None:
        """Abort one request (all its sequences); its stream ends without
        an error. Unknown or finished ids are ignored."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.close()
            stream._push(_END)

    def abort_all(self, reason: str) -> int:
        """End every open request now: abort it in the core and raise
        EngineDeadError(reason) in its handler (which then reports it
        properly: a 503, or an error event and ``[DONE]`` on a stream).
        Used when a graceful shutdown runs out of time."""
        streams = list(self._streams.values())
        for stream in streams:
            self.observer.on_abort(stream)
        self._abort_in_core([s.request_id for s in streams])
        self._fail_all(EngineDeadError(reason))
        return len(streams)

    def _abort_stream(self, stream: RequestStream) -> None:
        if self._streams.pop(stream.request_id, None) is not None:
            self.observer.on_abort(stream)
        self._abort_in_core([stream.request_id])

    def _abort_in_core(self, request_ids: list[str]) -> None:
        child_ids = self.output_processor.abort_requests(request_ids)
        if child_ids and self.is_alive:
            self.connection.send(EngineCoreAbort(request_ids=child_ids))

    # -- outputs (event loop) ---------------------------------------------------
    async def _output_loop(self, output: zmq.asyncio.Socket) -> None:
        try:
            while True:
                message = decode(await output.recv(), CoreOutput)
                if isinstance(message, EngineCoreReady):
                    continue
                if message.stats is not None:
                    self.stats = message.stats
                for purge_id, count in (message.purged or {}).items():
                    future = self._purges.get(purge_id)
                    if future is not None and not future.done():
                        future.set_result(count)
                processed = self.output_processor.process(message)
                if processed.stopped_by_string:
                    self.connection.send(EngineCoreAbort(request_ids=processed.stopped_by_string))
                self._dispatch(processed.outputs, time.monotonic())
                if message.engine_error:
                    self._on_dead(message.engine_error)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a front end bug: never leave clients hanging
            logger.exception("engine output handler died")
            self._on_dead(f"the engine output handler died: {exc!r}")

    def _on_process_exit(self) -> None:
        assert self._loop is not None and self.process is not None
        self._loop.remove_reader(self.process.sentinel)
        self.process.process.join(1)  # reap it, so exitcode is known
        self._on_dead(f"the engine core process exited with code {self.process.exitcode}")

    def _on_dead(self, reason: str) -> None:
        if self._dead_error is not None or self._stopped:
            return
        logger.error("%s", reason)
        self._dead_error = EngineDeadError(reason)
        self.output_processor.abort_requests(list(self._streams))
        self._fail_all(self._dead_error)

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
            self.observer.on_tokens(stream, num_new, None if last is None else (now - last) / num_new)
            stream.last_token_time[index] = now
        if out.finished:
            stream.num_finished += 1
            self.observer.on_sequence_finished(stream, out, now)
            if stream.engine_finished:
                self.observer.on_request_finished(stream, out, now)

    def _fail_all(self, error: BaseException) -> None:
        for future in self._purges.values():
            if not future.done():
                future.set_exception(error)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.closed = True
            stream._push(error)
