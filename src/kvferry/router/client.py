"""RouterClient: the router behind the front end. It owns the engine
cores as workers and everything about keeping them: who serves and
/health (membership.py, HealthMonitor), hearing from the cores
(listener.py), where a request goes (routing.py), SLO admission
(admission.py), restarts (supervisor.py), growing and shrinking pools
(scaling.py), the disagg prefill/decode pairing (pairing.py), tenant purges
and public-prefix drops (purges.py), and what a core's death does to the router.

The front end (``serve/engine_client.py`` ``AsyncEngineClient``) is a
RouterClient that also keeps the requests: their streams and the
input/output processors. The router reaches the requests only through the
hooks at the end of this class (``_deliver``, ``_end_requests``,
``_fail_all``, ``_fail_child``, ``_children_of``, ``abort_all``), which the
front end implements.

If a core dies (its process exits, it reports ``engine_error``, or it stops
answering hellos), every open stream on it ends with EngineDeadError and new
requests go to the others (/health: degraded). A core this server started
is started again within a budget (router/supervisor.py); while a role has
no live core and one of its cores restarts, /health and new requests get
EngineRestartingError (503, ``engine_restarting``). A death past that
budget is fatal: the client dies and calls ``on_fatal`` (the server then
exits non-zero, for a supervisor to restart it). With no core left,
``is_alive`` turns False (/health 503) and new requests get EngineDeadError.
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
from kvferry.engine.core_client import CoreConnection, CoreProcess
from kvferry.messages import (
    EngineCoreAbort, EngineCoreDropPublicBlocks, EngineCoreOutputs, EngineCorePurgeTenant, EngineCoreReady,
    EngineCoreShutdown,
)
from kvferry.router.admission import Admission
from kvferry.router.config import RouterConfig
from kvferry.router.errors import EngineDeadError, EngineRestartingError
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
from kvferry.types.stats import SchedulerStats

logger = logging.getLogger(__name__)


class RouterClient:
    """The engine cores (workers) behind the front end. Build it with a
    connection whose handshake is done (the first worker), then ``await
    start()`` on the event loop that uses it; ``launch`` starts the cores.

    A worker that dies ends only its own requests (EngineDeadError); the
    client is dead when no worker is left."""

    def __init__(self, connection: CoreConnection, ready: EngineCoreReady, process: CoreProcess | None = None,
                 router: RouterConfig | None = None, name: str = "engine-0", address: str | None = None) -> None:
        # The first worker: the reference every joining core must match.
        self.connection = connection
        self.ready = ready
        self.process = process
        self.router = router or RouterConfig()
        # Called (on the event loop) with the worker's name once a dead core
        # is back: the server prefills its public prefixes again there.
        self.on_restarted: Callable[[str], None] | None = None
        self.max_model_len: int = ready.max_model_len
        self._output_task: asyncio.Task | None = None
        self._stopped = False
        self.purges = PurgeBroadcast()
        self._health_task: asyncio.Task | None = None
        # The router (kvferry.router): who serves, where each request goes,
        # whether it is admitted, restarts, and disagg pairing.
        self.members = Membership(self.router.mode, ready)
        self.listener = WorkerListener(self._on_message, self._worker_died)
        self.index = PrefixIndex()
        self.routing = Router(self.members, self.router, self.index)
        self.admission = Admission(self.router.slo)
        self.health_monitor = HealthMonitor(self.members, self.router.health_check_interval_s,
                                            self.router.health_timeout_s, self._worker_died,
                                            self.router.engine_heartbeat_timeout_s)
        # Restarts only once ``launch`` gives it its options: a client built
        # around cores it did not start leaves a dead core dead.
        self.supervisor = RestartSupervisor(self.router, self.members, stop_reading=self.listener.stop,
                                            adopt=self._adopt, give_up=self._fatal, stopping=lambda: self._stopped)
        self.pairing = Pairing(self.routing, self._fail_child, self.max_model_len)
        # Each pool grown or shrunk while requests run (POST /v1/admin/scale, --autoscale).
        self.scaler = PoolScaler(self.router.mode, self.members, self.supervisor, adopt=self._adopt_new,
                                 leave=self.leave_worker, cpus_of=self.router.cpus_of_role)
        # Called once, on the event loop, when a core dies past the restart budget.
        self.on_fatal: Callable[[str], None] | None = None
        self.fatal_error: str | None = None
        self.members.add(Worker(name, self.members.role_of(name), address or connection.addresses.input, connection,
                                ready, process))

    @classmethod
    def around(cls, first: Worker, router: RouterConfig) -> RouterClient:
        """A client around ``first``, a core whose handshake is done."""
        return cls(first.connection, first.ready, first.process, router=router, name=first.name,
                   address=first.address)

    @classmethod
    def launch(cls, args: EngineArgs, name: str = "engine-0", check_integrity_when_idle: bool = False,
               ready_timeout_s: float = 600.0, log_level: str = "INFO",
               router: RouterConfig | None = None, ray=None,
               spawned: list[CoreProcess] | None = None) -> "RouterClient":
        """Start the engine core processes (``router.data_parallel_size``,
        default 1), connect to the joined addresses, and wait for every
        handshake (blocking: call before the event loop runs). Raises
        EngineCoreStartError (with the core's reason, e.g. a bad model path)
        when a core does not come up. ``ray`` (kvferry.fleet.ray_cores.RayCores):
        the cores are Ray actors on that cluster. ``spawned``: the processes
        ``router.supervisor.spawn_cores`` started already (the server spawns
        them before it imports its web modules)."""
        router = router or RouterConfig()
        workers, options = start_cores(args, router, check_integrity_when_idle, ready_timeout_s, log_level, ray,
                                       spawned)
        try:
            first = workers[0]
            client = cls.around(first, router)
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

    # -- the tenants' blocks on every core -----------------------------------------
    async def purge_tenant(self, tenant: str, timeout_s: float = 30.0) -> int:
        """Have every live core drop the tenant's unused cached blocks;
        returns how many they dropped. Raises EngineDeadError, or TimeoutError."""
        if not self.is_alive:
            raise self.members.dead_error or EngineDeadError("the engine core is not running")
        if restarting := self.members.restarting():
            # A purge must reach every core (and, through each, the KV store's tiers).
            raise EngineRestartingError(restarting_message(restarting[0].role, restarting))
        return await self.purges.run(self.workers.values(),
                                     lambda pid: EngineCorePurgeTenant(purge_id=pid, tenant=tenant), timeout_s)

    async def drop_public_blocks(self, public_namespace: str, token_ids: list[int], first_block: int,
                                 timeout_s: float = 30.0) -> int:
        """Have every live core drop a deleted public prefix's own blocks
        (``token_ids``' whole blocks from ``first_block`` on); returns how
        many they dropped. A core that is down or dies meanwhile needs no
        word: it comes back with an empty device pool, and the server
        prefills only the declarations left then. Raises EngineDeadError
        (no core at all), or TimeoutError."""
        if not self.is_alive:
            raise self.members.dead_error or EngineDeadError("the engine core is not running")
        return await self.purges.run(
            self.workers.values(),
            lambda pid: EngineCoreDropPublicBlocks(purge_id=pid, public_namespace=public_namespace,
                                                   token_ids=token_ids, first_block=first_block),
            timeout_s, void_on_death=True)

    # -- outputs and deaths (event loop) -----------------------------------------------
    def _on_message(self, worker: Worker, message: EngineCoreOutputs) -> None:
        if message.stats is not None:
            worker.stats = message.stats
        if message.purged:
            self.purges.answered(message.purged)
        if message.kv_events:
            self.index.apply(worker.name, message.kv_events)
        if message.num_scheduled_tokens:
            worker.step_model.observe(message.num_scheduled_tokens, message.step_duration_s)
        if self.router.mode == "disagg":  # even with no sequence paired: a decode core may ask about an ended one
            message = _replace(message, outputs=self.pairing.outputs(worker, message.outputs))
        for out in message.outputs:
            if out.new_token_ids or out.finished:
                worker.queued_prefill.pop(out.request_id, None)
        self._deliver(worker, message)

    def _worker_died(self, worker: Worker, reason: str, left: bool = False) -> None:
        """End this worker's requests with EngineDeadError(reason) (the front
        end's ``_end_requests``) and route no more to it; restart it if this
        client owns it; the client dies with its last worker."""
        if not worker.alive or self._stopped:
            return
        worker.alive = False
        worker.dead_reason = reason
        if not left:
            logger.error("%s", reason)
        self.listener.forget_process(worker)
        self.index.drop(worker.name)
        self.purges.worker_died(worker.name)
        error = EngineDeadError(reason)
        worker.queued_prefill.clear()
        # Disagg: a prefill core's sequences that have no first token yet
        # are prefilled again elsewhere (the decode core still waits).
        self.pairing.prefill_lost(worker, error)
        self._end_requests(worker, error)
        worker.requests.clear()
        worker.queued_prefill.clear()
        if not left and self.supervisor.can_restart(worker) and not self.supervisor.restart(worker, reason):
            return  # past the restart budget: the client gave up
        if not self.members.any_up() and not left:
            self.members.dead_error = error
            self._fail_all(error)

    # -- the front end's side (hooks it implements) ---------------------------------
    def _deliver(self, worker: Worker, message: EngineCoreOutputs) -> None:
        """A core's outputs, after the router's part (stats, events, pairing)."""
        raise NotImplementedError

    def _end_requests(self, worker: Worker, error: BaseException) -> None:
        """End the requests ``worker`` runs with ``error`` (it died)."""
        raise NotImplementedError

    def _fail_child(self, child: str, error: BaseException) -> None:
        """End the whole request of this sequence with ``error``."""
        raise NotImplementedError

    def _fail_all(self, error: BaseException) -> None:
        """End every request and purge with ``error``."""
        raise NotImplementedError

    def _children_of(self, request_ids: set[str]) -> list[str]:
        """The sequence ids (sent to the cores) of these requests."""
        raise NotImplementedError

    def abort_all(self, reason: str) -> int:
        """End every open request now (see the front end's)."""
        raise NotImplementedError
