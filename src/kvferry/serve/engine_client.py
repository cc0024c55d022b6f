"""AsyncEngineClient: the server's front end, an asyncio client of one or
more engine cores in other processes (engine/core_proc.py), which the
router (kvferry.router) chooses among per request.

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

If a core dies (its process exits, it reports ``engine_error``, or it stops
answering hellos), every open stream on it ends with EngineDeadError and new
requests go to the others (/health: degraded). A core this server started
is started again within a budget (router/supervisor.py); while a role has
no live core and one of its cores restarts, /health and new requests get
EngineRestartingError (503, ``engine_restarting``). A death past that
budget is fatal: the client dies and calls ``on_fatal`` (the server then
exits non-zero, for a supervisor to restart it). With no core left,
``is_alive`` turns False (/health 503) and new requests get EngineDeadError.

The router's parts are objects of kvferry.router, each with one job: who
serves and /health (membership.py), hearing from the cores (listener.py),
where a request goes (routing.py), SLO admission (admission.py), restarts
(supervisor.py) and the disagg prefill/decode pairing (pairing.py). This
client keeps the requests: their streams, and what a core's death ends.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable


import zmq
from msgspec.structs import replace as _replace

from kvferry.config import EngineArgs
from kvferry.core.hashing import CacheScope
from kvferry.core.scheduler import SchedulerStats
from kvferry.engine.core_client import CoreConnection, CoreProcess
from kvferry.engine.input_processor import InputProcessor, load_tokenizer
from kvferry.engine.output_processor import OutputProcessor
from kvferry.messages import (
    EngineCoreAbort, EngineCoreOutputs, EngineCoreReady, EngineCoreShutdown,
)
from kvferry.model.tokenizer import Tokenizer
from kvferry.outputs import RequestOutput
from kvferry.router.admission import Admission, SloRejectedError
from kvferry.router.config import RouterConfig
from kvferry.router.errors import EngineDeadError, EngineRestartingError, KVTransferFailedError
from kvferry.router.listener import WorkerListener
from kvferry.router.membership import HealthMonitor, Membership, restarting_message
from kvferry.router.pairing import Pairing
from kvferry.router.prefix_index import PrefixIndex
from kvferry.router.purges import PurgeBroadcast
from kvferry.router.routing import Router
from kvferry.router.scaling import PoolScaler
from kvferry.router.stats import merge_stats
from kvferry.router.supervisor import RestartSupervisor, start_cores, stop_cores
from kvferry.router.worker import Worker
from kvferry.sampling import SamplingParams
from kvferry.serve.request_stream import _END, RequestObserver, RequestStream, _NullObserver

__all__ = ["AsyncEngineClient", "EngineDeadError", "EngineRestartingError", "KVTransferFailedError", "RequestStream",
           "SloRejectedError"]

logger = logging.getLogger(__name__)

class AsyncEngineClient:
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
        # The first worker: the reference every joining core must match.
        self.connection = connection
        self.ready = ready
        self.process = process
        self.router = router or RouterConfig()
        self.observer: RequestObserver = observer or _NullObserver()
        # Called (on the event loop) with the worker's name once a dead core
        # is back: the server prefills its public prefixes again there.
        self.on_restarted: Callable[[str], None] | None = None
        self.tokenizer = tokenizer
        self.max_model_len: int = ready.max_model_len
        self.input_processor = InputProcessor(tokenizer, ready)
        self.output_processor = OutputProcessor(tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._output_task: asyncio.Task | None = None
        self._stopped = False
        self.purges = PurgeBroadcast()
        self._request_worker: dict[str, Worker] = {}  # parent request id -> its worker
        self._health_task: asyncio.Task | None = None
        # The router (kvferry.router): who serves, where each request goes,
        # whether it is admitted, restarts, and disagg pairing.
        self.members = Membership(self.router.mode, ready)
        self.listener = WorkerListener(self._on_message, self._worker_died)
        self.index = PrefixIndex()
        self.routing = Router(self.members, self.router, self.index)
        self.admission = Admission(self.router.slo)
        self.health_monitor = HealthMonitor(self.members, self.router.health_check_interval_s,
                                            self.router.health_timeout_s, self._worker_died)
        # Restarts only once ``launch`` gives it its options: a client built
        # around cores it did not start leaves a dead core dead.
        self.supervisor = RestartSupervisor(self.router, self.members, stop_reading=self.listener.stop,
                                            adopt=self._adopt, give_up=self._fatal, stopping=lambda: self._stopped)
        self.pairing = Pairing(self.routing, self._fail_child, self.max_model_len)
        # Each pool grown or shrunk while requests run (POST /v1/admin/scale, --autoscale).
        self.scaler = PoolScaler(self.router.mode, self.members, self.supervisor, adopt=self._adopt_new,
                                 leave=self.leave_worker, cpus_of=self.router.cpus_of_role)
        # The --autoscale loop (kvferry.autoscale), when the server runs one: shown by GET /v1/admin/scale.
        self.autoscaler = None
        # Called once, on the event loop, when a core dies past the restart budget.
        self.on_fatal: Callable[[str], None] | None = None
        self.fatal_error: str | None = None
        self.members.add(Worker(name, self.members.role_of(name), address or connection.addresses.input, connection,
                                ready, process))

    @classmethod
    def launch(cls, args: EngineArgs, name: str = "engine-0", check_integrity_when_idle: bool = False,
               ready_timeout_s: float = 600.0, log_level: str = "INFO",
               router: RouterConfig | None = None, ray=None) -> "AsyncEngineClient":
        """Start the engine core processes (``router.data_parallel_size``,
        default 1), connect to the joined addresses, and wait for every
        handshake (blocking: call before the event loop runs). Raises
        EngineCoreStartError (with the core's reason, e.g. a bad model path)
        when a core does not come up. ``ray`` (kvferry.fleet.ray_cores.RayCores):
        the cores are Ray actors on that cluster."""
        router = router or RouterConfig()
        workers, options = start_cores(args, router, check_integrity_when_idle, ready_timeout_s, log_level, ray)
        try:
            first = workers[0]
            client = cls(first.connection, first.ready, load_tokenizer(first.ready), first.process, router=router,
                         name=first.name, address=first.address)
            client.members.add(first)
            for worker in workers[1:]:
                client.members.check_compatible(worker.ready, worker.address)
                client.members.add(worker)
            client.supervisor.launch = options
        except BaseException:
            stop_cores(workers)
            raise
        return client

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        self.listener.attach(asyncio.get_running_loop())
        for worker in self.workers.values():
            self.listener.start(worker)
        # The client-wide task: alive while the client is (is_alive checks it).
        self._health_task = self._output_task = asyncio.create_task(self.health_monitor.run(), name="kvferry-health")

    @property
    def is_alive(self) -> bool:
        # A core being restarted keeps the client alive: requests wait for
        # it with 503 engine_restarting, not engine_unavailable.
        return (self._output_task is not None and self.members.dead_error is None and not self._stopped
                and self.members.any_up())

    @property
    def dead_error(self) -> BaseException | None:
        return self.members.dead_error

    @property
    def workers(self) -> dict[str, Worker]:
        """Every worker by name (the membership's own record)."""
        return self.members.workers

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    @property
    def stats(self) -> SchedulerStats:
        """Every live worker's scheduler counters, summed (one worker: its own)."""
        live = [w.stats for w in self.workers.values() if w.alive] or [next(iter(self.workers.values())).stats]
        return merge_stats(live)

    def health(self) -> dict:
        """See Membership.health."""
        return self.members.health(self.is_alive)

    def describe_workers(self) -> list[dict]:
        return self.members.describe(self.index)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort whatever is left, stop the cores this server owns (a joined
        core is only told to abort our requests) and wait for them to exit."""
        if self._stopped:
            return
        self._stopped = True
        # A joined core outlives us: it must drop our requests (known only until _fail_all).
        leftovers = {w.name: self._children_of(w.requests | {c for c in w.queued_prefill})
                     for w in self.workers.values() if not w.owned}
        self._fail_all(EngineDeadError("the server is shutting down"))
        # No core may be started after this; one half started is stopped by its task.
        await self.supervisor.cancel_all()
        if self._health_task is not None:
            self._health_task.cancel()
        stops = []
        for worker in self.workers.values():
            self.listener.forget_process(worker)
            try:
                if worker.owned:
                    worker.connection.send(EngineCoreShutdown())
                elif leftovers.get(worker.name):
                    worker.connection.send(EngineCoreAbort(request_ids=leftovers[worker.name]))
            except zmq.ZMQError:
                pass
            if worker.process is not None:
                stops.append(asyncio.to_thread(worker.process.stop, timeout_s))
        await asyncio.gather(*stops)
        tasks = [t for t in [*self.listener.tasks, self._health_task] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in self.workers.values():
            worker.connection.close()

    def kill_processes(self) -> None:
        """Kill every core this server started (start-up failed)."""
        for worker in self.workers.values():
            if worker.process is not None and worker.process.is_alive():
                worker.process.process.kill()

    # -- membership (event loop) ------------------------------------------------
    async def join_worker(self, address: str, role: str = "engine", timeout_s: float = 30.0) -> Worker:
        """Connect to a running core (``kvferry engine-core --address A``)
        and route to it from now on. Raises ValueError (bad address, role, a
        different model) or EngineCoreStartError (no answer)."""
        worker = await self.members.join(address, role, timeout_s)
        self.listener.start(worker)
        logger.warning("worker %s joined from %s", worker.name, address)
        return worker

    async def leave_worker(self, name_or_address: str, drain_timeout_s: float = 30.0) -> Worker:
        """Stop routing to a worker, let its requests finish (up to the
        timeout, then they end with an error), and disconnect. Raises
        KeyError when no such worker, ValueError for the last live one."""
        worker = self.members.find(name_or_address)
        await self.supervisor.cancel(worker)  # dead and being restarted: leaving ends the restart
        self.members.check_can_leave(worker)
        worker.accepting = False
        deadline = time.monotonic() + drain_timeout_s
        # Its streams (colocated, decode) and the prefills it still owes (a
        # prefill core: dropped at each sequence's first token).
        while (worker.requests or worker.queued_prefill) and worker.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._worker_died(worker, f"worker {worker.name} left the server", left=True)
        await self.listener.stop(worker)
        if worker.owned:
            with contextlib.suppress(zmq.ZMQError):
                worker.connection.send(EngineCoreShutdown())
            if worker.process is not None:
                await asyncio.to_thread(worker.process.stop, 10.0)
        worker.connection.close()
        self.members.remove(worker)
        logger.warning("worker %s left", worker.name)
        return worker

    def _adopt(self, old: Worker, new: Worker) -> None:
        """A restarted core takes over ``old``'s name (the membership already
        holds it): read it, and let the server prefill its public prefixes again."""
        if self.process is old.process:
            self.process, self.connection = new.process, new.connection
        self.listener.start(new)
        if self.on_restarted is not None:
            self.on_restarted(new.name)

    def _adopt_new(self, worker: Worker) -> None:
        """A core added to a pool (a member already): read it, and prefill
        the server's public prefixes there as on a restarted one."""
        self.listener.start(worker)
        if self.on_restarted is not None:
            self.on_restarted(worker.name)

    def _fatal(self, message: str) -> None:
        """A core died past the restart budget: end everything and tell the server."""
        self.fatal_error = message
        self.abort_all(message)  # aborts what the other cores run, while they are still reachable
        self.members.dead_error = EngineDeadError(message)
        if self.on_fatal is not None:
            self.on_fatal(message)

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

    async def purge_tenant(self, tenant: str, timeout_s: float = 30.0) -> int:
        """Have every live core drop the tenant's unused cached blocks;
        returns how many they dropped. Raises EngineDeadError, or TimeoutError."""
        if not self.is_alive:
            raise self.members.dead_error or EngineDeadError("the engine core is not running")
        if restarting := self.members.restarting():
            # A purge must reach every core (and, through each, the KV store's tiers).
            raise EngineRestartingError(restarting_message(restarting[0].role, restarting))
        return await self.purges.run(self.workers.values(), tenant, timeout_s)

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
    def _on_message(self, worker: Worker, message: EngineCoreOutputs) -> None:
        if message.stats is not None:
            worker.stats = message.stats
        if message.purged:
            self.purges.answered(message.purged)
        if message.kv_events:
            self.index.apply(worker.name, message.kv_events)
        if message.num_scheduled_tokens:
            worker.step_model.observe(message.num_scheduled_tokens, message.step_duration_s)
        if self.pairing:
            message = _replace(message, outputs=self.pairing.outputs(worker, message.outputs))
        for out in message.outputs:
            if out.new_token_ids or out.finished:
                worker.queued_prefill.pop(out.request_id, None)
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
        stream.closed = True
        stream._push(error)

    def _worker_died(self, worker: Worker, reason: str, left: bool = False) -> None:
        """End this worker's requests with EngineDeadError(reason) and route
        no more to it; the client dies with its last worker."""
        if not worker.alive or self._stopped:
            return
        worker.alive = False
        worker.dead_reason = reason
        if not left:
            logger.error("%s", reason)
        self.listener.forget_process(worker)
        self.index.drop(worker.name)
        error = EngineDeadError(reason)
        worker.queued_prefill.clear()
        # Disagg: a prefill core's sequences that have no first token yet
        # are prefilled again elsewhere (the decode core still waits).
        self.pairing.prefill_lost(worker, error)
        for request_id in list(worker.requests):
            self._request_worker.pop(request_id, None)
            for child in self.output_processor.abort_requests([request_id]):
                self.pairing.drop(child)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.closed = True
                stream._push(error)
        worker.requests.clear()
        worker.queued_prefill.clear()
        if not left and self.supervisor.can_restart(worker) and not self.supervisor.restart(worker, reason):
            return  # past the restart budget: the client gave up
        if not self.members.any_up() and not left:
            self.members.dead_error = error
            self._fail_all(error)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted after this step was planned
                continue
            stream.observe(out, now, self.observer)
            stream._push(out)
            if stream.engine_finished:
                del self._streams[out.request_id]
                worker = self._request_worker.pop(out.request_id, None)
                if worker is not None:
                    worker.requests.discard(out.request_id)
                stream._push(_END)

    def _fail_all(self, error: BaseException) -> None:
        self.purges.fail_all(error)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.closed = True
            stream._push(error)
        self._request_worker.clear()
        for worker in self.workers.values():
            worker.requests.clear()
            worker.queued_prefill.clear()

