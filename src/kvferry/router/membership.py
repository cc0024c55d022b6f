"""Which engine cores the router serves from, and whether they are healthy.

``Membership`` is the one record of the workers (by name) and of the whole
fleet's death: routing, the restart supervisor and /health all read it, so
they agree on who is up. It also holds the rules a core must pass to be a
member (same model, same block keys) and how a joining core is named.

``HealthMonitor`` asks every core for a hello each interval: a joined core
(which this server cannot watch through a process sentinel) silent past the
timeout is reported dead, and a started core silent past its heartbeat
deadline (alive but hung) is reported and killed, for the supervisor to
start again.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import zmq

from kvferry.engine.core_client import CoreAddresses, CoreConnection
from kvferry.messages import EngineCoreReady
from kvferry.router.config import check_role
from kvferry.router.errors import EngineDeadError, EngineRestartingError
from kvferry.router.prefix_index import PrefixIndex
from kvferry.router.worker import Worker
from kvferry.spec import shipped

logger = logging.getLogger(__name__)


class Membership:
    """The workers by name, in the order they joined, and the error that
    ended the fleet (None while it serves). ``reference`` is the first
    core's ready message: every other core must match it."""

    def __init__(self, mode: str, reference: EngineCoreReady) -> None:
        self.mode = mode
        self.reference = reference
        self.workers: dict[str, Worker] = {}
        # Set when no core is left (or one died past the restart budget):
        # from then on every request gets it.
        self.dead_error: EngineDeadError | None = None

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles that must each have a live core for any request to pass."""
        return ("engine",) if self.mode == "colocated" else ("prefill", "decode")

    def role_of(self, name: str) -> str:
        """The role of a core this server names itself ("prefill-0": prefill)."""
        return "engine" if self.mode == "colocated" else name.rsplit("-", 1)[0]

    def add(self, worker: Worker) -> None:
        self.workers[worker.name] = worker

    def remove(self, worker: Worker) -> None:
        del self.workers[worker.name]

    def find(self, name_or_address: str) -> Worker:
        """The worker with this name or address; KeyError if none."""
        for worker in self.workers.values():
            if name_or_address in (worker.name, worker.address):
                return worker
        raise KeyError(name_or_address)

    def live(self, role: str) -> list[Worker]:
        """The workers of ``role`` that take new requests."""
        return [w for w in self.workers.values() if w.alive and w.accepting and w.role == role]

    def any_up(self) -> bool:
        """Whether some core serves, or will once its restart is done."""
        return any(w.alive or w.restarting for w in self.workers.values())

    def only_restarting(self, role: str) -> bool:
        """No core of ``role`` takes requests, but one is being restarted."""
        members = [w for w in self.workers.values() if w.role == role]
        return not any(w.alive and w.accepting for w in members) and any(w.restarting for w in members)

    def restarting(self, role: str | None = None) -> list[Worker]:
        return [w for w in self.workers.values() if w.restarting and (role is None or w.role == role)]

    def unavailable(self, role: str) -> EngineDeadError:
        """Why no core of ``role`` can take a request: EngineRestartingError
        while one of them restarts (a client may retry), else EngineDeadError."""
        restarting = self.restarting(role)
        if restarting:
            return EngineRestartingError(restarting_message(role, restarting))
        return EngineDeadError(f"no {role} core is accepting requests")

    def check_can_leave(self, worker: Worker) -> None:
        """Raise ValueError when ``worker`` is its role's last live core."""
        peers = [w for w in self.workers.values() if w.role == worker.role and w.alive and w.accepting]
        if peers == [worker]:
            raise ValueError(f"cannot remove the last live {worker.role} worker")

    def check_compatible(self, ready: EngineCoreReady, address: str) -> None:
        check_compatible(self.reference, ready, address, disagg=self.mode == "disagg")

    def next_name(self, role: str) -> str:
        """A free name for a joining core: "{role}-{n}", n counting from the
        number of cores of that role."""
        index = sum(1 for w in self.workers.values() if w.role == role)
        name = f"{role}-{index}"
        while name in self.workers:
            index += 1
            name = f"{role}-{index}"
        return name

    async def join(self, address: str, role: str, timeout_s: float) -> Worker:
        """Connect to a running core, check it matches, and add it (not
        owned: it outlives this server). Raises ValueError (bad address,
        role, a different model) or EngineCoreStartError (no answer)."""
        check_role(role, self.mode)
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
            self.check_compatible(ready, address)
        except BaseException:
            connection.close()
            raise
        worker = Worker(self.next_name(role), role, address, connection, ready, owned=False)
        self.add(worker)
        return worker

    def health(self, serving: bool) -> dict:
        """{"status": "ok" | "degraded", "workers": {name: alive}, and the
        names of those restarting and why each dead one is down} (one
        worker: {"status": "ok"}, as before there was a router) while every
        role has a live core; else {"status": "restarting" | "unavailable",
        "reason": ...}: a role with no live core cannot serve any request
        (disagg: no decode core means no request gets through), so that is
        never "degraded". ``serving``: whether the client still runs."""
        if not serving:
            reason = str(self.dead_error) if self.dead_error else "the engine core is not running"
            return {"status": "unavailable", "reason": reason}
        for role in self.roles:
            members = [w for w in self.workers.values() if w.role == role]
            if any(w.alive and w.accepting for w in members):
                continue
            restarting = [w for w in members if w.restarting]
            if restarting:
                return {"status": "restarting", "reason": restarting_message(role, restarting)}
            why = "; ".join(w.dead_reason for w in members if w.dead_reason)
            return {"status": "unavailable", "reason": f"no {role} core is running" + (f": {why}" if why else "")}
        alive = {name: w.alive for name, w in self.workers.items()}
        if len(alive) == 1:
            return {"status": "ok"}
        health: dict = {"status": "ok" if all(alive.values()) else "degraded", "workers": alive}
        if restarting := [w.name for w in self.workers.values() if w.restarting]:
            health["restarting"] = restarting
        if errors := {w.name: w.dead_reason for w in self.workers.values() if not w.alive and w.dead_reason}:
            health["errors"] = errors  # why each is down (a crash, a missed heartbeat)
        return health

    def describe(self, index: PrefixIndex) -> list[dict]:
        """The admin view of every worker (GET /v1/admin/workers)."""
        return [w.describe(index.num_blocks(w.name)) | ray_placement(w) for w in self.workers.values()]


def ray_placement(worker: Worker) -> dict:
    """Where a core runs on a Ray cluster: its Ray node id and actor id
    (None for a local process or a joined core). A Ray core's process is
    an actor incarnation (kvferry.fleet.ray_cores.ActorProcess), which
    knows both; nothing else does."""
    process = getattr(worker.process, "process", None)
    return {"node_id": getattr(process, "node_id", None), "ray_actor": getattr(process, "actor_id", None)}


def restarting_message(role: str, workers: list[Worker]) -> str:
    names = ", ".join(w.name for w in workers)
    why = workers[0].dead_reason
    return f"no {role} core is up: {names} restarting" + (f" (after: {why})" if why else "")


def check_compatible(first: EngineCoreReady, other: EngineCoreReady, address: str, disagg: bool = False) -> None:
    """Every worker must serve the same model with the same block keys, or
    the router's hashes and validation would be wrong for it. In disagg
    mode prefill and decode cores must also speculate alike: a prefill core
    ships what the decode core's drafter needs (kvferry.spec.speculation_signature)."""
    names = ("model_fingerprint", "block_size", "kv_dtype", "vocab_size", "eos_token_ids")
    for name in names + (("speculative",) if disagg else ()):
        mine, theirs = getattr(first, name), getattr(other, name)
        if name == "speculative":  # only what travels between the pair must agree
            mine, theirs = shipped(mine), shipped(theirs)
        if mine != theirs:
            raise ValueError(f"the core at {address!r} differs in {name}: {getattr(other, name)!r} "
                             f"(the server's: {getattr(first, name)!r})")


class HealthMonitor:
    """Asks every live worker for a hello each interval and reports one that
    stays silent past its deadline to ``on_silent``. A hello is answered by
    the core's input thread, not its step loop, and any output counts as an
    answer too.

    - A joined core (not ours to kill) is dead after ``timeout_s`` of
      silence: unreachable, or its host is gone.
    - A core this server started is also watched by its process sentinel,
      which only tells of an exit. A core that is alive but answers nothing
      (stopped with SIGSTOP, a deadlock, a host swapping itself to death)
      misses its heartbeat deadline, ``heartbeat_timeout_s`` (0: not timed):
      it is reported, then killed (SIGKILL; a Ray actor: killed for Ray to
      start again), so that the restart supervisor starts a fresh one. The
      deadline is generous because the answer needs the core's GIL for a
      moment: a kernel that holds the GIL (a C++ op that does not release
      it) delays it by that kernel's length, and a loaded host delays every
      thread of the core.

    A round that runs late (this event loop was itself blocked) judges no
    one: the answers that came meanwhile are still unread on the sockets,
    and a stalled router must not read as a fleet of hung cores."""

    def __init__(self, members: Membership, interval_s: float, timeout_s: float,
                 on_silent: Callable[[Worker, str], None], heartbeat_timeout_s: float = 0.0) -> None:
        self.members = members
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_silent = on_silent
        self._last_round: float | None = None

    def check(self, now: float) -> None:
        """One round: report (and kill) the silent, greet the rest."""
        late = self._last_round is not None and now - self._last_round > max(2 * self.interval_s, 1.0)
        self._last_round = now
        for worker in list(self.members.workers.values()):
            if not worker.alive:
                continue
            silent_s = now - worker.last_heard
            if not late and worker.process is None and silent_s > self.timeout_s:
                self.on_silent(worker, f"worker {worker.name} ({worker.address}) did not answer for "
                                       f"{silent_s:.0f} s")
                continue
            if not late and worker.process is not None and 0 < self.heartbeat_timeout_s < silent_s:
                self.on_silent(worker, f"engine core {worker.name} (pid {worker.ready.pid}) missed its heartbeat: "
                                       f"no answer for {silent_s:.0f} s (--engine-heartbeat-timeout "
                                       f"{self.heartbeat_timeout_s:g}); killed as hung")
                kill_hung(worker)
                continue
            with contextlib.suppress(zmq.ZMQError):
                worker.connection.hello()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.check(time.monotonic())


def kill_hung(worker: Worker) -> None:
    """Kill a started core that is alive but hung: SIGKILL (a stopped or
    deadlocked process ignores SIGTERM), or for a Ray actor's incarnation
    ``ray.kill`` with restarts allowed, so that Ray starts the next one for
    the supervisor to re-join."""
    process = worker.process.process if worker.process is not None else None
    if process is None:
        return
    try:
        restart = getattr(process, "restart", None)  # kvferry.fleet.ray_cores.ActorProcess
        if restart is not None:
            restart()
        elif process.is_alive():
            process.kill()
    except (OSError, ValueError) as exc:  # gone already, or its handle closed
        logger.warning("could not kill engine core %s: %s", worker.name, exc)
