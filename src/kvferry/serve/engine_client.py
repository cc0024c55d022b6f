"""AsyncEngineClient: the server's front end, an asyncio client of one or
more engine cores in other processes (engine/core_proc.py). It is the
router client (``router/client.py``: the cores, their health, restarts,
scaling, pairing, purges) plus the requests: their streams and the input
and output processors.

    event loop (HTTP handlers, this process)              engine core process
    ----------------------------------------              -------------------
    add_request: tokenize, validate, fan out --EngineCoreRequest--> step loop
    stream.close / stop string matched       --EngineCoreAbort---->
    output task: detokenize, stop strings    <--EngineCoreOutputs-- one per step
       -> RequestStream of each request          (token deltas + stats)

Text work (tokenization, detokenization, stop strings, SSE, pydantic) runs
here, under this process's GIL; the core's GIL does scheduling and compute
only. Validation uses the core's ready message, so ``add_request`` raises
ValueError at once and a bad request never crosses the socket. What a
core's death does to the requests is here too (``_end_requests``,
``_fail_all``); when and why a core is dead is the router client's.
"""
from __future__ import annotations

import time

from kvferry.core.hashing import CacheScope
from kvferry.engine.core_client import CoreConnection, CoreProcess
from kvferry.engine.input_processor import InputProcessor, load_tokenizer
from kvferry.engine.output_processor import OutputProcessor
from kvferry.messages import EngineCoreAbort, EngineCoreOutputs, EngineCoreReady
from kvferry.model.tokenizer import Tokenizer
from kvferry.outputs import RequestOutput
from kvferry.router.admission import SloRejectedError
from kvferry.router.client import RouterClient
from kvferry.router.config import RouterConfig
from kvferry.router.errors import EngineDeadError, EngineRestartingError, KVTransferFailedError
from kvferry.router.worker import Worker
from kvferry.sampling import SamplingParams
from kvferry.serve.request_stream import RequestObserver, RequestStream, _NullObserver

__all__ = ["AsyncEngineClient", "EngineDeadError", "EngineRestartingError", "KVTransferFailedError", "RequestStream",
           "SloRejectedError"]


class AsyncEngineClient(RouterClient):
    """Front end of one or more engine cores (workers). Build it with a
    connection whose handshake is done (the first worker), then ``await
    start()`` on the event loop that uses it; ``launch`` starts the cores.

    Each request goes to one worker, chosen by the router policy (KV-aware
    prefill cost) and checked against the SLOs; its n sequences stay there.
    A worker that dies ends only its own requests (EngineDeadError); the
    client is dead when no worker is left."""

    def __init__(self, connection: CoreConnection, ready: EngineCoreReady, tokenizer: Tokenizer,
                 process: CoreProcess | None = None, observer: RequestObserver | None = None,
                 router: RouterConfig | None = None, name: str = "engine-0", address: str | None = None) -> None:
        super().__init__(connection, ready, process, router, name, address)
        self.observer: RequestObserver = observer or _NullObserver()
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(tokenizer, ready)
        self.output_processor = OutputProcessor(tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._request_worker: dict[str, Worker] = {}  # parent request id -> its worker
        # The --autoscale loop (kvferry.autoscale), when the server runs one: shown by GET /v1/admin/scale.
        self.autoscaler = None
        self.ffn_pool = None  # --mode afd: the server's FFN workers (engine/afd_pool.py), resized by a scale

    @classmethod
    def around(cls, first: Worker, router: RouterConfig) -> AsyncEngineClient:
        return cls(first.connection, first.ready, load_tokenizer(first.ready), first.process, router=router,
                   name=first.name, address=first.address)

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    # -- requests (event loop) ------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_namespace: str = "", arrival_time: float | None = None,
                          cache_scope: "CacheScope | None" = None) -> RequestStream:
        """Validate, route and send a request to a worker. ``cache_scope``:
        where its blocks are keyed and whose they are (the server builds it
        per request from the caller's key, or for its own requests, such as
        a public prefix's prefill); it reaches the core unchanged. Without
        one, ``cache_namespace`` keys a private scope (both: ValueError).

        Raises ValueError (bad input, naming the field), SloRejectedError
        (it cannot meet the SLO now) or EngineDeadError.
        """
        if not self.is_alive:
            raise self.members.dead_error or EngineDeadError("the engine core is not running")
        arrival = arrival_time or time.monotonic()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, requests = self.input_processor.process(request_id, prompt, params, cache_namespace, arrival,
                                                      cache_scope)
        disagg = self.router.mode == "disagg"
        await self.supervisor.wait_for_restarts(("prefill", "decode") if disagg else ("engine",))
        if request_id in self.output_processor.parents:  # taken while this one waited
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Colocated: the core that does both phases. Disagg: the decode core
        # owns the stream; the prefill core is chosen (and may change) once
        # the decode core says where the KV goes, so only its estimate is
        # admitted here.
        prefill, new_tokens = self.routing.choose(requests[0], "prefill" if disagg else "engine")
        self.admission.check(prefill, new_tokens)
        worker = self.routing.choose_decode() if disagg else prefill
        self.output_processor.add_request(request_id, text, requests)
        stream = RequestStream(self, request_id, params.n, arrival, requests[0].cache_scope.tenant)
        stream.max_tokens = params.max_tokens  # for vLLM's request_params_max_tokens histogram
        self._streams[request_id] = stream
        self.observer.on_arrival(stream)
        self._request_worker[request_id] = worker
        worker.requests.add(request_id)
        worker.num_routed += 1
        for req in requests:
            if disagg:
                self.pairing.start(req, worker)
            else:
                worker.queued_prefill[req.request_id] = new_tokens
                worker.connection.send(req)
        return stream

    def abort(self, request_id: str) -> None:
        """Abort one request (all its sequences); its stream ends without
        an error. Unknown or finished ids are ignored."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.close()
            stream.end()

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

    def abort_stream(self, stream: RequestStream) -> None:
        """A stream closed before its request finished (its reader went away): abort it."""
        if self._streams.pop(stream.request_id, None) is not None:
            self.observer.on_abort(stream)
        self._abort_in_core([stream.request_id])

    def _abort_in_core(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            worker = self._request_worker.pop(request_id, None)
            child_ids = self.output_processor.abort_requests([request_id])
            if worker is None:
                continue
            worker.requests.discard(request_id)
            for child in child_ids:
                worker.queued_prefill.pop(child, None)
                self.pairing.drop(child)
            if child_ids and worker.alive and self.is_alive:
                worker.connection.send(EngineCoreAbort(request_ids=child_ids))

    def _children_of(self, request_ids: set[str]) -> list[str]:
        return [child for parent in request_ids
                for child in (self.output_processor.parents[parent].child_ids
                              if parent in self.output_processor.parents else [parent])]

    # -- outputs (event loop) ---------------------------------------------------
    def _deliver(self, worker: Worker, message: EngineCoreOutputs) -> None:
        processed = self.output_processor.process(message)
        if processed.stopped_by_string:
            worker.connection.send(EngineCoreAbort(request_ids=processed.stopped_by_string))
        self._dispatch(processed.outputs, time.monotonic())

    def _fail_child(self, child: str, error: BaseException) -> None:
        """End the whole request of this sequence with ``error``."""
        state = self.output_processor.seqs.get(child)
        parent = state.parent_id if state is not None else child
        stream = self._streams.pop(parent, None)
        if stream is None:
            return
        self.observer.on_abort(stream)
        self._abort_in_core([parent])
        stream.end(error)

    def _end_requests(self, worker: Worker, error: BaseException) -> None:
        for request_id in list(worker.requests):
            self._request_worker.pop(request_id, None)
            for child in self.output_processor.abort_requests([request_id]):
                self.pairing.drop(child)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.end(error)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted after this step was planned
                continue
            stream.observe(out, now, self.observer)
            stream.push(out)
            if stream.engine_finished:
                del self._streams[out.request_id]
                worker = self._request_worker.pop(out.request_id, None)
                if worker is not None:
                    worker.requests.discard(out.request_id)
                stream.end()

    def _fail_all(self, error: BaseException) -> None:
        self.purges.fail_all(error)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.end(error)
        self._request_worker.clear()
        for worker in self.workers.values():
            worker.requests.clear()
            worker.queued_prefill.clear()

