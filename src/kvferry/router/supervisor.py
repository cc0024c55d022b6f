"""Starting the engine core processes this server owns, and starting a dead
one again.

A core this server started is restarted when it dies (``RouterConfig.
engine_restarts`` times within ``engine_restart_window_s``, all cores
together, after a backoff of 0.5 s doubling to 30 s); one more death is
fatal: the server gives up so that a supervisor of its own restarts the
whole process. While every core of a role restarts, a new request waits for
one (up to ``engine_restart_wait_s``) rather than fail at once.

On a Ray cluster (``--ray``) each core is an actor that Ray restarts; the
supervisor then waits for the actor's next incarnation and re-joins it by
its new addresses (kvferry.fleet.ray_cores) instead of spawning a process,
within the same budget.

The supervisor owns the restart budget and the restart tasks; the client
owns the sockets it reads and the requests, so it is reached through four
hooks (see ``RestartSupervisor``).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from kvferry.config import EngineArgs
from kvferry.engine.core_client import CoreAddresses, CoreConnection, CoreProcess, EngineCoreStartError
from kvferry.messages import EngineCoreShutdown
from kvferry.router.config import RouterConfig, split_worker
from kvferry.router.core_spawn import core_config, spawn_cores
from kvferry.router.errors import EngineDeadError
from kvferry.router.membership import Membership
from kvferry.router.worker import Worker

if TYPE_CHECKING:  # ray is imported only with --ray
    from kvferry.fleet.ray_cores import RayCores

logger = logging.getLogger(__name__)

# Backoff before a dead core is started again: doubles with each restart
# still inside the window, so a core that dies at once is not respawned in
# a tight loop (each start loads a model), but the first comes back fast.
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0


@dataclass(slots=True)
class LaunchOptions:
    """How the cores were started, to start a dead one the same way."""

    args: EngineArgs
    check_integrity_when_idle: bool
    ready_timeout_s: float
    log_level: str
    cpus: dict[str, str | None] = field(default_factory=dict)  # by core name
    # The cores are Ray actors (--ray): a dead one is restarted by Ray and re-joined.
    ray: RayCores | None = None
    # by role: (--prefill-tp, --prefill-pp) / (--decode-tp, --decode-pp)
    tp: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)


def start_cores(args: EngineArgs, router: RouterConfig, check_integrity_when_idle: bool, ready_timeout_s: float,
                log_level: str, ray: RayCores | None = None,
                spawned: list[CoreProcess] | None = None) -> tuple[list[Worker], LaunchOptions]:
    """Start the cores ``router`` names (local processes, or Ray actors
    with ``ray``; ``spawned``: the local processes ``spawn_cores`` started
    already), connect to its joined addresses, and wait for every handshake
    (blocking). On any failure what was started is stopped again before the
    error propagates."""
    specs = router.core_specs()
    # Started together, so that N cores load their models in parallel.
    if ray is not None:
        processes = ray.start([(name, role, core_config(args, role, *router.layout_of_role(role)), cpus)
                               for name, role, cpus in specs],
                              check_integrity_when_idle, log_level, ready_timeout_s)
    else:
        processes = spawned if spawned is not None else spawn_cores(args, router, check_integrity_when_idle,
                                                                    log_level)
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
    except BaseException:
        _stop(connections, processes)
        raise
    options = LaunchOptions(args, check_integrity_when_idle, ready_timeout_s, log_level,
                            {name: cpus for name, _, cpus in specs}, ray=ray,
                            tp={role: router.layout_of_role(role) for role in ("prefill", "decode")})
    return workers, options


def stop_cores(workers: list[Worker]) -> None:
    """Undo ``start_cores`` (a later start-up step failed): close every
    connection, then kill every started process at once."""
    _stop([w.connection for w in workers], [w.process for w in workers if w.process is not None])


def _stop(connections: list[CoreConnection], processes: list[CoreProcess]) -> None:
    for conn in connections:
        conn.close()
    for process in processes:
        process.stop(timeout_s=0)


class RestartSupervisor:
    """Restarts dead cores this server started, within the budget.

    Hooks into the client:

    - ``stop_reading(worker)``: stop reading the dead core's outputs (awaited
      before its process is reaped and a new one started);
    - ``adopt(old, new)``: route to the new core (``members`` already holds
      it): read its outputs, and tell whoever cares that it is back;
    - ``give_up(message)``: a death past the budget: end everything, fatally;
    - ``stopping()``: whether the client is shutting down.
    """

    def __init__(self, config: RouterConfig, members: Membership, *,
                 stop_reading: Callable[[Worker], Awaitable[None]], adopt: Callable[[Worker, Worker], None],
                 give_up: Callable[[str], None], stopping: Callable[[], bool]) -> None:
        self.config = config
        self.members = members
        self.stop_reading = stop_reading
        self.adopt = adopt
        self.give_up = give_up
        self.stopping = stopping
        # None: a dead core stays dead (the client was built around cores it did not start).
        self.launch: LaunchOptions | None = None
        self._restart_times: deque[float] = deque()  # when each restart inside the window began
        self._tasks: dict[str, asyncio.Task] = {}  # by worker name
        # Set (and replaced) whenever a restart ends, well or not: requests
        # held while their role's cores restart wake up on it.
        self._ended = asyncio.Event()

    def can_restart(self, worker: Worker) -> bool:
        return self.launch is not None and worker.owned and worker.process is not None

    def restart(self, worker: Worker, reason: str) -> bool:
        """Start ``worker`` again in the background (on the event loop), after
        the backoff; False when the budget is spent (then it gave up)."""
        delay = self.next_delay()
        if delay is None:
            self._give_up(reason)
            return False
        worker.restarting = True
        self._tasks[worker.name] = asyncio.get_running_loop().create_task(
            self._restart(worker, delay), name=f"kvferry-{worker.name}-restart")
        return True

    async def cancel(self, worker: Worker) -> None:
        """End ``worker``'s restart, if one runs (it is leaving)."""
        task = self._tasks.pop(worker.name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            worker.restarting = False

    async def cancel_all(self) -> None:
        """End every restart; a core half started is stopped by its task."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait_for_restarts(self, roles: tuple[str, ...]) -> None:
        """Hold a new request while every core of one of its roles is being
        restarted, up to engine_restart_wait_s: then it runs on the new core,
        or (still restarting) routing answers engine_restarting."""
        deadline = time.monotonic() + self.config.engine_restart_wait_s
        while any(self.members.only_restarting(role) for role in roles):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ended = self._ended
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), left)
            if self.members.dead_error is not None or self.stopping():
                raise self.members.dead_error or EngineDeadError("the server is stopping")

    def next_delay(self) -> float | None:
        """Counts one more restart and returns its backoff; None when the
        budget (``engine_restarts`` within the window) is spent."""
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > self.config.engine_restart_window_s:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.config.engine_restarts:
            return None
        self._restart_times.append(now)
        return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (len(self._restart_times) - 1))

    def _give_up(self, reason: str) -> None:
        """A core died past the restart budget: the client ends everything and
        tells the server (which exits non-zero: a supervisor restarts the whole process)."""
        message = (f"{reason}; no engine restart left ({self.config.engine_restarts} within "
                   f"{self.config.engine_restart_window_s:.0f} s), the server stops")
        logger.critical("%s", message)
        self.give_up(message)

    def _notify_ended(self) -> None:
        self._ended.set()
        self._ended = asyncio.Event()

    async def _restart(self, old: Worker, delay: float) -> None:
        """Start a dead core's process again, after ``delay``, and route to
        it once its handshake is done; a start that fails is retried with a
        longer backoff while the budget lasts."""
        name = old.name
        try:
            while True:
                logger.error("restarting engine core %s in %.1f s (restart %d of at most %d within %.0f s)",
                             name, delay, len(self._restart_times), self.config.engine_restarts,
                             self.config.engine_restart_window_s)
                await asyncio.sleep(delay)
                # Nothing reads the dead core's socket any more, and its process
                # is reaped (a Ray actor's is Ray's: it restarts it).
                await self.stop_reading(old)
                if old.process is not None and self.launch.ray is None:
                    await asyncio.to_thread(old.process.stop, 0)
                try:
                    new = await self._start_core(old)
                    break
                except (EngineCoreStartError, ValueError, OSError) as exc:
                    reason = f"engine core {name} failed to restart: {exc}"
                    logger.error("%s", reason)
                    old.dead_reason = reason
                    next_delay = self.next_delay()
                    if next_delay is None:
                        old.restarting = False
                        self._give_up(reason)
                        return
                    delay = next_delay
            if self.stopping() or self.members.dead_error is not None or self.members.workers.get(name) is not old:
                # Given up (another core's death) or removed meanwhile.
                await self.stop_new_core(new)
                return
            self.members.add(new)
            old.connection.close()
            logger.warning("engine core %s restarted (pid %s, restart %d of this core)", name, new.ready.pid,
                           new.num_restarts)
            self.adopt(old, new)
        finally:
            # Registered until here, so that a shutdown waits for any core this task started.
            if self._tasks.get(name) is asyncio.current_task():
                del self._tasks[name]
            self._notify_ended()

    async def _start_core(self, old: Worker) -> Worker:
        """A fresh process for ``old``'s name and role, handshake done: a
        new local process, or on Ray the actor's next incarnation (Ray
        restarts it; this waits for it to come back and re-joins it)."""
        opts = self.launch
        assert opts is not None
        if opts.ray is not None:
            process = await opts.ray.rejoin(old.name, old.process, opts.ready_timeout_s)
        else:
            process = CoreProcess.start(core_config(opts.args, old.role, *opts.tp.get(old.role, (None, None))), old.name,
                                        opts.check_integrity_when_idle,
                                        opts.log_level, cpus=opts.cpus.get(old.name))
        return await self._handshake(old.name, old.role, process, num_restarts=old.num_restarts + 1)

    async def reserve(self, cores: list[tuple[str, str]]) -> None:
        """Room for each new core (name, role) of a scale, all or none: with
        --ray a placement group each, within --scale-timeout-s (a local
        process needs none). Raises CorePlacementError naming what is missing."""
        if cores and self.launch is not None and self.launch.ray is not None:
            await self.launch.ray.reserve(cores)

    async def start_new_core(self, name: str, role: str, cpus: str | None) -> Worker:
        """A core this server did not run before (a pool scaled up): a new
        local process, or a new Ray actor placed by its role's resources;
        handshake done and checked against the server's model, not yet a
        member. Raises EngineCoreStartError, ValueError (a different model)
        or RuntimeError (this server did not start its cores)."""
        opts = self.launch
        if opts is None:
            raise RuntimeError("this server did not start its engine cores, so it cannot start more: "
                               "join running cores with POST /v1/admin/workers")
        opts.cpus[name] = cpus
        config = core_config(opts.args, role, *opts.tp.get(role, (None, None)))
        if opts.ray is not None:
            process = await opts.ray.add(name, role, config, cpus, opts.check_integrity_when_idle, opts.log_level,
                                         opts.ready_timeout_s)
        else:
            process = CoreProcess.start(config, name, opts.check_integrity_when_idle, opts.log_level, cpus=cpus)
        return await self._handshake(name, role, process)

    @staticmethod
    async def stop_new_core(worker: Worker) -> None:
        """Stop a core started here that never became a member."""
        with contextlib.suppress(zmq.ZMQError):
            worker.connection.send(EngineCoreShutdown())
        await asyncio.to_thread(worker.process.stop, 10.0)
        worker.connection.close()

    def forget_core(self, name: str) -> None:
        """A core removed from its pool for good: no restart, no Ray actor kept for it."""
        if self.launch is not None:
            self.launch.cpus.pop(name, None)
            if self.launch.ray is not None:
                self.launch.ray.forget(name)

    async def _handshake(self, name: str, role: str, process: CoreProcess, num_restarts: int = 0) -> Worker:
        """Connect to a started core and wait for its handshake."""
        opts = self.launch
        assert opts is not None
        connection = CoreConnection(process.addresses)
        # The handshake's thread uses the sockets until it returns: on any
        # failure (a cancel at shutdown too) kill the process, which ends
        # the handshake within its 0.1 s poll, and only then close them.
        handshake = asyncio.ensure_future(asyncio.to_thread(connection.wait_ready, opts.ready_timeout_s, process))
        try:
            ready = await asyncio.shield(handshake)
            self.members.check_compatible(ready, name)
        except BaseException:
            if process.is_alive():
                process.process.kill()
            await asyncio.wait([handshake])
            if not handshake.cancelled():
                handshake.exception()  # retrieved: the failure that matters is the one raised below
            connection.close()
            await asyncio.to_thread(process.stop, 5.0)
            raise
        return Worker(name, role, process.addresses.input, connection, ready, process, num_restarts=num_restarts)
