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
is started again (``RouterConfig.engine_restarts`` times within
``engine_restart_window_s``, after a backoff of 0.5 s doubling to 30 s);
while a role (engine; prefill or decode) has no live core and one of its
cores restarts, /health and new requests get EngineRestartingError (503,
``engine_restarting``), and once the new core's handshake is done it takes
requests again. A death past that budget is fatal: the client dies and
calls ``on_fatal`` (the server then exits non-zero, for a supervisor to
restart it). With no core left, ``is_alive`` turns False (/health 503) and
new requests get EngineDeadError (503).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
import zmq.asyncio
from msgspec.structs import replace as _replace

from kvferry.config import EngineArgs
from kvferry.core.hashing import CacheScope, ChainKeys, extend_block_hashes
from kvferry.core.scheduler import SchedulerStats
from kvferry.engine.core_client import CoreAddresses, CoreConnection, CoreProcess, EngineCoreStartError
from kvferry.engine.input_processor import InputProcessor, load_tokenizer
from kvferry.engine.output_processor import OutputProcessor
from kvferry.messages import (
    CoreOutput, EngineCoreAbort, EngineCoreHello, EngineCoreOutput, EngineCoreOutputs, EngineCorePurgeTenant,
    EngineCoreReady, EngineCoreRequest, EngineCoreShutdown, KVTransferParams, decode,
)
from kvferry.model.tokenizer import Tokenizer
from kvferry.outputs import RequestOutput
from kvferry.router.admission import SloRejectedError, admit, predict
from kvferry.router.config import RouterConfig, check_role, split_worker
from kvferry.router.pairing import MAX_PREFILL_ATTEMPTS, PairedSequence, first_token_finish
from kvferry.router.policy import Candidate, choose_decode, choose_prefill, uncached_tokens
from kvferry.router.prefix_index import PrefixIndex
from kvferry.router.stats import merge_stats
from kvferry.router.worker import Worker
from kvferry.sampling import SamplingParams

__all__ = ["AsyncEngineClient", "EngineDeadError", "EngineRestartingError", "RequestStream", "SloRejectedError"]

logger = logging.getLogger(__name__)

# Backoff before a dead core is started again: doubles with each restart
# still inside the window, so a core that dies at once is not respawned in
# a tight loop (each start loads a model), but the first comes back fast.
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0


class EngineDeadError(RuntimeError):
    """The engine core has stopped (crashed, was killed, or shut down)."""


class EngineRestartingError(EngineDeadError):
    """No core can take the request now, but a dead one is being started
    again: a client may retry shortly (503 ``engine_restarting``)."""


@dataclass(slots=True)
class _LaunchOptions:
    """How ``launch`` started the cores, to start a dead one the same way."""

    args: EngineArgs
    check_integrity_when_idle: bool
    ready_timeout_s: float
    log_level: str
    cpus: dict[str, str | None] = field(default_factory=dict)  # by core name


class KVTransferFailedError(EngineDeadError):
    """A disaggregated request's KV did not arrive intact and the decode core
    was told to fail rather than recompute (--kv-transfer-failure fail)."""


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
        # Set (and replaced) whenever a restart ends, well or not: requests
        # held while their role's cores restart wake up on it.
        self._restart_ended = asyncio.Event()
        self.tokenizer = tokenizer
        self.max_model_len: int = ready.max_model_len
        self.input_processor = InputProcessor(tokenizer, ready)
        self.output_processor = OutputProcessor(tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._output_task: asyncio.Task | None = None
        self._dead_error: EngineDeadError | None = None
        self._stopped = False
        # Purges sent to the cores, by purge id, until each answers.
        self._purges: dict[str, asyncio.Future[int]] = {}
        self.workers: dict[str, Worker] = {}
        self.index = PrefixIndex()
        self._worker_tasks: dict[str, asyncio.Task] = {}
        self._request_worker: dict[str, Worker] = {}  # parent request id -> its worker
        self._num_choices = 0
        self._rng = random.Random(0)
        self._health_task: asyncio.Task | None = None
        self._paired: dict[str, PairedSequence] = {}  # disagg: child request id -> its two cores
        # Restarts (set by ``launch``; None: a dead core stays dead, as for a
        # client built around cores it did not start).
        self._launch: _LaunchOptions | None = None
        self._restart_times: deque[float] = deque()  # when each restart inside the window began
        self._restart_tasks: dict[str, asyncio.Task] = {}  # by worker name
        # Called once, on the event loop, when a core dies past the restart budget.
        self.on_fatal: Callable[[str], None] | None = None
        self.fatal_error: str | None = None
        role = "engine" if self.router.mode == "colocated" else name.rsplit("-", 1)[0]
        self._add_worker(Worker(name, role, address or connection.addresses.input, connection, ready, process))

    @classmethod
    def launch(cls, args: EngineArgs, name: str = "engine-0", check_integrity_when_idle: bool = False,
               ready_timeout_s: float = 600.0, log_level: str = "INFO",
               router: RouterConfig | None = None) -> "AsyncEngineClient":
        """Start the engine core processes (``router.data_parallel_size``,
        default 1), connect to the joined addresses, and wait for every
        handshake (blocking: call before the event loop runs). Raises
        EngineCoreStartError (with the core's reason, e.g. a bad model path)
        when a core does not come up."""
        router = router or RouterConfig()
        specs = router.core_specs()
        # Started together, so that N cores load their models in parallel.
        processes = [CoreProcess.start(_core_config(args, role), name, check_integrity_when_idle, log_level,
                                       cpus=cpus) for name, role, cpus in specs]
        connections: list[CoreConnection] = []
        try:
            workers = []
            for (name, role, _), process in zip(specs, processes):
                connections.append(CoreConnection(process.addresses))
                ready = connections[-1].wait_ready(ready_timeout_s, process)
                workers.append(Worker(name, role, process.addresses.input, connections[-1], ready, process))
            for entry in router.worker_addresses:
                role, address = split_worker(entry, router.mode)
                connections.append(CoreConnection(CoreAddresses.from_address(address)))
                ready = connections[-1].wait_ready(ready_timeout_s)
                index = sum(w.role == role for w in workers)
                workers.append(Worker(f"{role}-{index}", role, address, connections[-1], ready, owned=False))
            first = workers[0]
            client = cls(first.connection, first.ready, load_tokenizer(first.ready), first.process, router=router,
                         name=first.name, address=first.address)
            client.workers[first.name] = first
            for worker in workers[1:]:
                _check_compatible(first.ready, worker.ready, worker.address, disagg=router.mode == "disagg")
                client._add_worker(worker)
            client._launch = _LaunchOptions(args, check_integrity_when_idle, ready_timeout_s, log_level,
                                            {name: cpus for name, _, cpus in specs})
        except BaseException:
            for conn in connections:
                conn.close()
            for process in processes:
                process.stop(timeout_s=0)
            raise
        return client

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for worker in self.workers.values():
            self._start_worker(worker)
        # The client-wide task: alive while the client is (is_alive checks it).
        self._health_task = self._output_task = asyncio.create_task(self._health_loop(), name="kvferry-health")

    @property
    def is_alive(self) -> bool:
        # A core being restarted keeps the client alive: requests wait for
        # it with 503 engine_restarting, not engine_unavailable.
        return (self._output_task is not None and self._dead_error is None and not self._stopped
                and any(w.alive or w.restarting for w in self.workers.values()))

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    @property
    def stats(self) -> SchedulerStats:
        """Every live worker's scheduler counters, summed (one worker: its own)."""
        live = [w.stats for w in self.workers.values() if w.alive] or [next(iter(self.workers.values())).stats]
        return merge_stats(live)

    def health(self) -> dict:
        """{"status": "ok" | "degraded", "workers": {name: alive}} (one
        worker: {"status": "ok"}, as before there was a router) while every
        role has a live core; else {"status": "restarting" | "unavailable",
        "reason": ...}: a role with no live core cannot serve any request
        (disagg: no decode core means no request gets through), so that is
        never "degraded"."""
        if not self.is_alive:
            reason = str(self._dead_error) if self._dead_error else "the engine core is not running"
            return {"status": "unavailable", "reason": reason}
        roles = ("engine",) if self.router.mode == "colocated" else ("prefill", "decode")
        for role in roles:
            members = [w for w in self.workers.values() if w.role == role]
            if any(w.alive and w.accepting for w in members):
                continue
            restarting = [w for w in members if w.restarting]
            if restarting:
                return {"status": "restarting", "reason": self._restarting_message(role, restarting)}
            why = "; ".join(w.dead_reason for w in members if w.dead_reason)
            return {"status": "unavailable", "reason": f"no {role} core is running" + (f": {why}" if why else "")}
        alive = {name: w.alive for name, w in self.workers.items()}
        if len(alive) == 1:
            return {"status": "ok"}
        health: dict = {"status": "ok" if all(alive.values()) else "degraded", "workers": alive}
        if restarting := [w.name for w in self.workers.values() if w.restarting]:
            health["restarting"] = restarting
        return health

    @staticmethod
    def _restarting_message(role: str, workers: list[Worker]) -> str:
        names = ", ".join(w.name for w in workers)
        why = workers[0].dead_reason
        return f"no {role} core is up: {names} restarting" + (f" (after: {why})" if why else "")

    def describe_workers(self) -> list[dict]:
        return [w.describe(self.index.num_blocks(w.name)) for w in self.workers.values()]

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
        restarts = list(self._restart_tasks.values())
        for task in restarts:
            task.cancel()
        await asyncio.gather(*restarts, return_exceptions=True)
        if self._health_task is not None:
            self._health_task.cancel()
        stops = []
        for worker in self.workers.values():
            self._remove_process_reader(worker)
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
        tasks = [t for t in [*self._worker_tasks.values(), self._health_task] if t is not None]
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
        check_role(role, self.router.mode)
        addresses = CoreAddresses.from_address(address)
        if any(w.address == address and w.alive for w in self.workers.values()):
            raise ValueError(f"address {address!r} is already a worker")
        connection = CoreConnection(addresses)
        # The handshake's thread uses the sockets until it returns. If this
        # coroutine is cancelled first, closing them now would close them
        # under that thread (libzmq aborts): close them once it is done.
        handshake = asyncio.ensure_future(asyncio.to_thread(connection.wait_ready, timeout_s))
        try:
            ready = await asyncio.shield(handshake)
        except asyncio.CancelledError:
            handshake.add_done_callback(lambda f: (f.cancelled() or f.exception(), connection.close()))
            raise
        except BaseException:
            connection.close()
            raise
        try:
            _check_compatible(self.ready, ready, address, disagg=self.router.mode == "disagg")
        except BaseException:
            connection.close()
            raise
        index = sum(1 for w in self.workers.values() if w.role == role)
        name = f"{role}-{index}"
        while name in self.workers:
            index += 1
            name = f"{role}-{index}"
        worker = Worker(name, role, address, connection, ready, owned=False)
        self._add_worker(worker)
        self._start_worker(worker)
        logger.warning("worker %s joined from %s", name, address)
        return worker

    async def leave_worker(self, name_or_address: str, drain_timeout_s: float = 30.0) -> Worker:
        """Stop routing to a worker, let its requests finish (up to the
        timeout, then they end with an error), and disconnect. Raises
        KeyError when no such worker, ValueError for the last live one."""
        worker = self._find_worker(name_or_address)
        restart = self._restart_tasks.pop(worker.name, None)
        if restart is not None:  # dead and being restarted: leaving ends the restart
            restart.cancel()
            await asyncio.gather(restart, return_exceptions=True)
            worker.restarting = False
        peers = [w for w in self.workers.values() if w.role == worker.role and w.alive and w.accepting]
        if peers == [worker]:
            raise ValueError(f"cannot remove the last live {worker.role} worker")
        worker.accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while worker.requests and worker.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._worker_died(worker, f"worker {worker.name} left the server", left=True)
        task = self._worker_tasks.pop(worker.name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if worker.owned:
            with contextlib.suppress(zmq.ZMQError):
                worker.connection.send(EngineCoreShutdown())
            if worker.process is not None:
                await asyncio.to_thread(worker.process.stop, 10.0)
        worker.connection.close()
        del self.workers[worker.name]
        logger.warning("worker %s left", worker.name)
        return worker

    def _find_worker(self, name_or_address: str) -> Worker:
        for worker in self.workers.values():
            if name_or_address in (worker.name, worker.address):
                return worker
        raise KeyError(name_or_address)

    def _add_worker(self, worker: Worker) -> None:
        self.workers[worker.name] = worker

    def _start_worker(self, worker: Worker) -> None:
        assert self._loop is not None
        # One socket, two faces: the handshake used it blocking; now asyncio reads it.
        output = zmq.asyncio.Socket.shadow(worker.connection.output.underlying)
        self._worker_tasks[worker.name] = asyncio.create_task(self._output_loop(worker, output),
                                                              name=f"kvferry-{worker.name}-outputs")
        if worker.process is not None:
            self._loop.add_reader(worker.process.sentinel, self._on_process_exit, worker)

    def _remove_process_reader(self, worker: Worker) -> None:
        if self._loop is not None and worker.process is not None:
            self._loop.remove_reader(worker.process.sentinel)

    async def _health_loop(self) -> None:
        """Ask every live joined worker for a hello each interval; one that
        stays silent past the timeout (unreachable, or its host is gone) is
        dead. A core this server started is watched by its process sentinel
        instead: a long step may hold its GIL (a C++ kernel) for seconds,
        which must not read as death."""
        interval, timeout = self.router.health_check_interval_s, self.router.health_timeout_s
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for worker in list(self.workers.values()):
                if not worker.alive or worker.process is not None:
                    continue
                if now - worker.last_heard > timeout:
                    self._worker_died(worker, f"worker {worker.name} ({worker.address}) did not answer for "
                                              f"{now - worker.last_heard:.0f} s")
                    continue
                with contextlib.suppress(zmq.ZMQError):
                    worker.connection.send(EngineCoreHello())

    # -- requests (event loop) ------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_namespace: str = "", arrival_time: float | None = None,
                          cache_scope: "CacheScope | None" = None) -> RequestStream:
        """Validate, route and send a request to a worker. ``cache_scope``:
        the server's own scope for a request it makes (a public prefix's
        prefill); else the cache policy's.

        Raises ValueError (bad input, naming the field), SloRejectedError
        (it cannot meet the SLO now) or EngineDeadError.
        """
        if not self.is_alive:
            raise self._dead_error or EngineDeadError("the engine core is not running")
        arrival = arrival_time or time.monotonic()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, requests = self.input_processor.process(request_id, prompt, params, cache_namespace, arrival,
                                                      cache_scope)
        disagg = self.router.mode == "disagg"
        await self._wait_for_restarts(("prefill", "decode") if disagg else ("engine",))
        if request_id in self.output_processor.parents:  # taken while this one waited
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Colocated: the core that does both phases. Disagg: the decode core
        # owns the stream; the prefill core is chosen (and may change) once
        # the decode core says where the KV goes, so only its estimate is
        # admitted here.
        prefill, new_tokens = self._choose_worker(requests[0], "prefill" if disagg else "engine")
        self._admit(prefill, new_tokens)
        worker = self._choose_decode() if disagg else prefill
        self.output_processor.add_request(request_id, text, requests)
        stream = RequestStream(self, request_id, params.n, arrival, requests[0].tenant)
        self._streams[request_id] = stream
        self._request_worker[request_id] = worker
        worker.requests.add(request_id)
        worker.num_routed += 1
        for req in requests:
            if disagg:
                self._paired[req.request_id] = PairedSequence(req, worker)
                worker.connection.send(_replace(req, kv_transfer=KVTransferParams(role="decode")))
            else:
                worker.queued_prefill[req.request_id] = new_tokens
                worker.connection.send(req)
        return stream

    async def purge_tenant(self, tenant: str, timeout_s: float = 30.0) -> int:
        """Have every live core drop the tenant's unused cached blocks;
        returns how many they dropped. Raises EngineDeadError, or TimeoutError."""
        if not self.is_alive:
            raise self._dead_error or EngineDeadError("the engine core is not running")
        if restarting := [w for w in self.workers.values() if w.restarting]:
            # A purge must reach every core (and, through each, the KV store's tiers).
            raise EngineRestartingError(self._restarting_message(restarting[0].role, restarting))
        loop = asyncio.get_running_loop()
        sent: list[str] = []
        try:
            for worker in self.workers.values():
                if not worker.alive:
                    continue
                purge_id = f"purge-{uuid.uuid4().hex}"
                self._purges[purge_id] = loop.create_future()
                sent.append(purge_id)
                worker.connection.send(EngineCorePurgeTenant(purge_id=purge_id, tenant=tenant))
            counts = await asyncio.wait_for(asyncio.gather(*(self._purges[p] for p in sent)), timeout_s)
            return sum(counts)
        finally:
            for purge_id in sent:
                self._purges.pop(purge_id, None)

    def _choose_decode(self) -> Worker:
        live = [w for w in self.workers.values() if w.alive and w.accepting and w.role == "decode"]
        if not live:
            self._raise_restarting("decode")
            raise EngineDeadError("no decode core is accepting requests")
        best = choose_decode([Candidate(w.name, 0, 0, 0, len(w.requests), w.kv_usage, w.stats.num_running)
                              for w in live], self._rng)
        return self.workers[best.name]

    def _choose_worker(self, request: EngineCoreRequest, role: str = "engine") -> tuple[Worker, int]:
        """The worker (of ``role``) to compute this prompt, and the prompt
        tokens it will compute."""
        live = [w for w in self.workers.values() if w.alive and w.accepting and w.role == role]
        if not live:
            if self._dead_error is None:
                self._raise_restarting(role)
            raise self._dead_error or EngineDeadError(f"no {role} core is accepting requests")
        num_prompt = len(request.prompt_token_ids)
        block_size = self.ready.block_size
        if len(live) == 1 and not self.router.slo.enabled:
            chosen = live[0]  # nothing to weigh: skip hashing (today's single-core speed)
            return chosen, uncached_tokens(num_prompt, 0, block_size)
        hashes = self._block_hashes(request)
        candidates = [Candidate(
            name=w.name, cached_blocks=self.index.overlap_blocks(w.name, hashes),
            queued_prefill_tokens=w.queued_prefill_tokens, active_kv_tokens=w.stats.kv_blocks_used * block_size,
            num_in_flight=len(w.requests), kv_usage=w.kv_usage, num_running=w.stats.num_running,
            last_chosen=w.last_chosen) for w in live]
        best = choose_prefill(candidates, num_prompt, block_size, self.router.overlap_weight)
        chosen = self.workers[best.name]
        self._num_choices += 1
        chosen.last_chosen = self._num_choices
        return chosen, uncached_tokens(num_prompt, best.cached_blocks, block_size)

    async def _wait_for_restarts(self, roles: tuple[str, ...]) -> None:
        """Hold a new request while every core of one of its roles is being
        restarted, up to engine_restart_wait_s: then it runs on the new core,
        or (still restarting) _choose_worker answers engine_restarting."""
        deadline = time.monotonic() + self.router.engine_restart_wait_s
        while any(self._only_restarting(role) for role in roles):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ended = self._restart_ended
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), left)
            if self._dead_error is not None or self._stopped:
                raise self._dead_error or EngineDeadError("the server is stopping")

    def _only_restarting(self, role: str) -> bool:
        workers = [w for w in self.workers.values() if w.role == role]
        return not any(w.alive and w.accepting for w in workers) and any(w.restarting for w in workers)

    def _notify_restart_ended(self) -> None:
        self._restart_ended.set()
        self._restart_ended = asyncio.Event()

    def _raise_restarting(self, role: str) -> None:
        restarting = [w for w in self.workers.values() if w.role == role and w.restarting]
        if restarting:
            raise EngineRestartingError(self._restarting_message(role, restarting))

    def _block_hashes(self, request: EngineCoreRequest) -> list[bytes]:
        """The request's own chain, keyed exactly as its core keys it: rooted
        in its namespace, so only its own tenant's (and public) blocks match."""
        scope = CacheScope(request.cache_namespace, request.public_cache_namespace, request.num_public_blocks)
        keys = ChainKeys.of(scope, self.ready.model_fingerprint, self.ready.kv_dtype)
        hashes: list[bytes] = []
        extend_block_hashes(hashes, request.prompt_token_ids, self.ready.block_size, keys)
        return hashes

    def _admit(self, worker: Worker, new_tokens: int) -> None:
        if not self.router.slo.enabled:
            return
        prediction = predict(worker.step_model, worker.queued_prefill_tokens, new_tokens,
                             worker.stats.num_running, worker.ready.max_num_batched_tokens)
        admit(self.router.slo, prediction)

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
                seq = self._paired.pop(child, None)
                if seq is not None:
                    self._release_prefill(seq, child, abort=True)
            if child_ids and worker.alive and self.is_alive:
                worker.connection.send(EngineCoreAbort(request_ids=child_ids))

    def _children_of(self, request_ids: set[str]) -> list[str]:
        return [child for parent in request_ids
                for child in (self.output_processor.parents[parent].child_ids
                              if parent in self.output_processor.parents else [parent])]

    # -- outputs (event loop) ---------------------------------------------------
    async def _output_loop(self, worker: Worker, output: zmq.asyncio.Socket) -> None:
        # The asyncio shadow registers the socket's fd with the event loop on
        # its first recv and unregisters it only in its own close(), which is
        # never called (it would zmq_close the handle that the connection's
        # own close() then closes again). Unregister it when this loop ends,
        # before the connection is closed: a stale registration outlives the
        # closed fd (epoll drops it, asyncio's selector map does not), and
        # the next socket given that fd number (a restarted core's output
        # socket, an HTTP connection) is then "added" by asyncio without
        # ever reaching epoll, so it is never read (requests hang forever).
        fd = output.FD
        try:
            await self._read_outputs(worker, output)
        finally:
            asyncio.get_running_loop().remove_reader(fd)

    async def _read_outputs(self, worker: Worker, output: zmq.asyncio.Socket) -> None:
        try:
            while True:
                message = decode(await output.recv(), CoreOutput)
                worker.last_heard = time.monotonic()
                if isinstance(message, EngineCoreReady):
                    continue  # a hello's answer
                self._on_message(worker, message)
                if message.engine_error:
                    self._worker_died(worker, message.engine_error)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a front end bug: never leave clients hanging
            logger.exception("engine output handler of %s died", worker.name)
            self._worker_died(worker, f"the engine output handler died: {exc!r}")

    def _on_message(self, worker: Worker, message: EngineCoreOutputs) -> None:
        if message.stats is not None:
            worker.stats = message.stats
        for purge_id, count in (message.purged or {}).items():
            future = self._purges.get(purge_id)
            if future is not None and not future.done():
                future.set_result(count)
        if message.kv_events:
            self.index.apply(worker.name, message.kv_events)
        if message.num_scheduled_tokens:
            worker.step_model.observe(message.num_scheduled_tokens, message.step_duration_s)
        if self._paired:
            message = _replace(message, outputs=self._pair_outputs(worker, message.outputs))
        for out in message.outputs:
            if out.new_token_ids or out.finished:
                worker.queued_prefill.pop(out.request_id, None)
        processed = self.output_processor.process(message)
        if processed.stopped_by_string:
            worker.connection.send(EngineCoreAbort(request_ids=processed.stopped_by_string))
        self._dispatch(processed.outputs, time.monotonic())

    # -- disagg: one sequence on a decode and a prefill core (router/pairing.py) --------
    def _pair_outputs(self, worker: Worker, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """The outputs of paired sequences as the client must see them."""
        result: list[EngineCoreOutput] = []
        for out in outputs:
            seq = self._paired.get(out.request_id)
            if seq is None:
                result.append(out)
            elif worker is seq.decode:
                result.extend(self._from_decode(seq, out))
            elif worker is seq.prefill:
                result.extend(self._from_prefill(seq, out))
            # else: a prefill core this sequence has moved away from
        return result

    def _from_decode(self, seq: PairedSequence, out: EngineCoreOutput) -> list[EngineCoreOutput]:
        child = out.request_id
        if out.kv_destination is not None:
            seq.dest = out.kv_destination
            self._send_prefill(seq, child)
            out = _replace(out, kv_destination=None)
        if out.kv_transfer_error:
            logger.warning("request %s: %s", child, out.kv_transfer_error)
            self._release_prefill(seq, child, abort=True)
            if out.finished:  # --kv-transfer-failure fail
                self._paired.pop(child, None)
                self._fail_child(child, KVTransferFailedError(out.kv_transfer_error))
                return []
            # D kept P's first token if P's Done reached it (only the KV was
            # bad: then P has reported, or soon reports, that token, and D's
            # outputs start at the second). After a timeout D samples the first
            # token itself. The router cannot see which; it goes by whether
            # P's token has come: P reports it as it sends Done, so a token
            # already here means Done was sent, and none yet means P is stuck.
            if not seq.first_token_seen:
                seq.recomputing = True  # D's own first token comes next; P's is dropped
        waiting_first = not seq.first_token_seen and not seq.recomputing
        if waiting_first and (out.new_token_ids or out.finish_reason in ("stop", "length")):
            # Overtook the prefill core's first token (which D already has:
            # it may even have ended the sequence): after it, in order.
            seq.held.append(out)
            return []
        if out.finished:
            self._paired.pop(child, None)
            self._release_prefill(seq, child, abort=True)
        elif not out.new_token_ids:
            return []
        if seq.held:
            held, seq.held = seq.held, []
            return [*held, out]
        return [out]

    def _from_prefill(self, seq: PairedSequence, out: EngineCoreOutput) -> list[EngineCoreOutput]:
        child = out.request_id
        if out.finish_reason != "prefilled":
            if out.finished:  # P could not take it (refused, aborted): another one may
                self._release_prefill(seq, child, abort=False)
                self._retry_prefill(seq, child, f"the prefill core ended it ({out.finish_reason})")
            return []
        self._release_prefill(seq, child, abort=False)
        if seq.recomputing or seq.first_token_seen:
            return []
        seq.first_token_seen = True
        finish = first_token_finish(seq.request, out.new_token_ids[0], self.max_model_len) if out.new_token_ids else None
        first = _replace(out, finish_reason=finish[0] if finish else None, stop_reason=finish[1] if finish else None)
        if finish is not None:  # D ends it too; its word is no longer needed
            self._paired.pop(child, None)
            return [first]
        held, seq.held = seq.held, []
        if any(o.finished for o in held):
            self._paired.pop(child, None)
        return [first, *held]

    def _send_prefill(self, seq: PairedSequence, child: str) -> None:
        seq.attempts += 1
        try:
            worker, new_tokens = self._choose_worker(seq.request, "prefill")
        except EngineDeadError as exc:
            # No prefill core: the decode core's lease ends it (recompute or fail).
            logger.error("request %s: %s; the decode core's lease decides", child, exc)
            return
        seq.prefill = worker
        worker.queued_prefill[child] = new_tokens
        worker.num_routed += 1
        worker.connection.send(_replace(seq.request, kv_transfer=KVTransferParams(role="prefill", dest=seq.dest)))

    def _retry_prefill(self, seq: PairedSequence, child: str, reason: str) -> None:
        if seq.dest is None:
            return  # not sent to a prefill core yet: it goes when D reports
        if seq.attempts >= MAX_PREFILL_ATTEMPTS or time.monotonic() >= seq.dest.deadline:
            logger.error("request %s: %s; no retry left, the decode core's lease decides", child, reason)
            return
        logger.warning("request %s: %s; prefilling it on another core", child, reason)
        self._send_prefill(seq, child)

    def _release_prefill(self, seq: PairedSequence, child: str, abort: bool) -> None:
        worker, seq.prefill = seq.prefill, None
        if worker is None:
            return
        worker.queued_prefill.pop(child, None)
        if abort and worker.alive:
            with contextlib.suppress(zmq.ZMQError):
                worker.connection.send(EngineCoreAbort(request_ids=[child]))

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

    def _on_process_exit(self, worker: Worker) -> None:
        assert self._loop is not None and worker.process is not None
        self._loop.remove_reader(worker.process.sentinel)
        worker.process.process.join(1)  # reap it, so exitcode is known
        self._worker_died(worker, f"the engine core process {worker.name} exited with code {worker.process.exitcode}")

    def _worker_died(self, worker: Worker, reason: str, left: bool = False) -> None:
        """End this worker's requests with EngineDeadError(reason) and route
        no more to it; the client dies with its last worker."""
        if not worker.alive or self._stopped:
            return
        worker.alive = False
        worker.dead_reason = reason
        if not left:
            logger.error("%s", reason)
        self._remove_process_reader(worker)
        self.index.drop(worker.name)
        error = EngineDeadError(reason)
        # Disagg: a prefill core's sequences that have no first token yet
        # are prefilled again elsewhere (the decode core still waits).
        retry = [(child, seq) for child, seq in self._paired.items() if seq.prefill is worker]
        worker.queued_prefill.clear()
        for child, seq in retry:
            seq.prefill = None
            if any(o.finished for o in seq.held):
                # D finished from this core's KV, but its first token died with it.
                self._paired.pop(child, None)
                self._fail_child(child, error)
            elif not seq.first_token_seen and not seq.recomputing:
                self._retry_prefill(seq, child, reason)
        for request_id in list(worker.requests):
            self._request_worker.pop(request_id, None)
            for child in self.output_processor.abort_requests([request_id]):
                seq = self._paired.pop(child, None)
                if seq is not None:
                    self._release_prefill(seq, child, abort=True)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.closed = True
                stream._push(error)
        worker.requests.clear()
        worker.queued_prefill.clear()
        if not left and self._launch is not None and worker.owned and worker.process is not None:
            delay = self._next_restart_delay()
            if delay is None:
                self._give_up(worker, reason)
                return
            worker.restarting = True
            self._restart_tasks[worker.name] = asyncio.get_running_loop().create_task(
                self._restart(worker, delay), name=f"kvferry-{worker.name}-restart")
        if not any(w.alive or w.restarting for w in self.workers.values()) and not left:
            self._dead_error = error
            self._fail_all(error)

    # -- restarts (event loop) ------------------------------------------------------
    def _next_restart_delay(self) -> float | None:
        """Counts one more restart and returns its backoff; None when the
        budget (``engine_restarts`` within the window) is spent."""
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > self.router.engine_restart_window_s:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.router.engine_restarts:
            return None
        self._restart_times.append(now)
        return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (len(self._restart_times) - 1))

    def _give_up(self, worker: Worker, reason: str) -> None:
        """A core died past the restart budget: end everything and tell the
        server (which exits non-zero: a supervisor restarts the whole process)."""
        message = (f"{reason}; no engine restart left ({self.router.engine_restarts} within "
                   f"{self.router.engine_restart_window_s:.0f} s), the server stops")
        logger.critical("%s", message)
        self.fatal_error = message
        self.abort_all(message)  # aborts what the other cores run, while they are still reachable
        self._dead_error = EngineDeadError(message)
        if self.on_fatal is not None:
            self.on_fatal(message)

    async def _restart(self, old: Worker, delay: float) -> None:
        """Start a dead core's process again, after ``delay``, and route to
        it once its handshake is done; a start that fails is retried with a
        longer backoff while the budget lasts."""
        name = old.name
        try:
            while True:
                logger.error("restarting engine core %s in %.1f s (restart %d of at most %d within %.0f s)",
                             name, delay, len(self._restart_times), self.router.engine_restarts,
                             self.router.engine_restart_window_s)
                await asyncio.sleep(delay)
                # Nothing reads the dead core's socket any more, and its process is reaped.
                task = self._worker_tasks.pop(name, None)
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                if old.process is not None:
                    await asyncio.to_thread(old.process.stop, 0)
                try:
                    new = await self._start_core(old)
                    break
                except (EngineCoreStartError, ValueError, OSError) as exc:
                    reason = f"engine core {name} failed to restart: {exc}"
                    logger.error("%s", reason)
                    old.dead_reason = reason
                    next_delay = self._next_restart_delay()
                    if next_delay is None:
                        old.restarting = False
                        self._give_up(old, reason)
                        return
                    delay = next_delay
            if self._stopped or self._dead_error is not None or self.workers.get(name) is not old:
                # Given up (another core's death) or removed meanwhile.
                with contextlib.suppress(zmq.ZMQError):
                    new.connection.send(EngineCoreShutdown())
                await asyncio.to_thread(new.process.stop, 10.0)
                new.connection.close()
                return
            self.workers[name] = new
            if self.process is old.process:
                self.process, self.connection = new.process, new.connection
            old.connection.close()
            self._start_worker(new)
            logger.warning("engine core %s restarted (pid %s, restart %d of this core)", name, new.ready.pid,
                           new.num_restarts)
            if self.on_restarted is not None:
                self.on_restarted(name)
        finally:
            # Registered until here, so that a shutdown waits for any core this task started.
            if self._restart_tasks.get(name) is asyncio.current_task():
                del self._restart_tasks[name]
            self._notify_restart_ended()

    async def _start_core(self, old: Worker) -> Worker:
        """A fresh process for ``old``'s name and role, handshake done."""
        opts = self._launch
        assert opts is not None
        process = CoreProcess.start(_core_config(opts.args, old.role), old.name, opts.check_integrity_when_idle,
                                    opts.log_level, cpus=opts.cpus.get(old.name))
        connection = CoreConnection(process.addresses)
        # The handshake's thread uses the sockets until it returns: on any
        # failure (a cancel at shutdown too) kill the process, which ends
        # the handshake within its 0.1 s poll, and only then close them.
        handshake = asyncio.ensure_future(asyncio.to_thread(connection.wait_ready, opts.ready_timeout_s, process))
        try:
            ready = await asyncio.shield(handshake)
            _check_compatible(self.ready, ready, old.name, disagg=self.router.mode == "disagg")
        except BaseException:
            if process.is_alive():
                process.process.kill()
            await asyncio.wait([handshake])
            if not handshake.cancelled():
                handshake.exception()  # retrieved: the failure that matters is the one raised below
            connection.close()
            await asyncio.to_thread(process.stop, 5.0)
            raise
        return Worker(old.name, old.role, process.addresses.input, connection, ready, process,
                      num_restarts=old.num_restarts + 1)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted after this step was planned
                continue
            self._observe(stream, out, now)
            stream._push(out)
            if stream.engine_finished:
                del self._streams[out.request_id]
                worker = self._request_worker.pop(out.request_id, None)
                if worker is not None:
                    worker.requests.discard(out.request_id)
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
        self._request_worker.clear()
        for worker in self.workers.values():
            worker.requests.clear()
            worker.queued_prefill.clear()


def _core_config(args: EngineArgs, role: str):
    """The engine config of a core with this role: prefill and decode cores
    get a KV transfer socket (a free loopback port unless one was given)."""
    config = args.create_engine_config()
    if role != "engine" and not config.kv_transfer.kv_transfer_address:
        config.kv_transfer.kv_transfer_address = "tcp://127.0.0.1:0"
    return config


def _check_compatible(first: EngineCoreReady, other: EngineCoreReady, address: str, disagg: bool = False) -> None:
    """Every worker must serve the same model with the same block keys, or
    the router's hashes and validation would be wrong for it. In disagg
    mode prefill and decode cores must also speculate alike: a prefill core
    ships what the decode core's drafter needs (kvferry.spec.speculation_signature)."""
    names = ("model_fingerprint", "block_size", "kv_dtype", "vocab_size", "eos_token_ids")
    for name in names + (("speculative",) if disagg else ()):
        if getattr(first, name) != getattr(other, name):
            raise ValueError(f"the core at {address!r} differs in {name}: {getattr(other, name)!r} "
                             f"(the server's: {getattr(first, name)!r})")
