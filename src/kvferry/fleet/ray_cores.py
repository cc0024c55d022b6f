"""The front end's side of engine cores on a Ray cluster.

    cores = RayCores.connect(placement, max_restarts=3)    # ray.init(address=...)
    processes = cores.start(specs, ready_timeout_s)         # one actor per core, placed by resources
    process = await cores.rejoin(name, dead, timeout_s)     # after a death: the actor's next incarnation
    await cores.reserve([(name, role), ...])                # a pool scaled up: room for the new cores, all or none
    process = await cores.add(name, role, config, ...)      # ... then one more actor in its reserved room
    cores.forget(name)                                      # a pool scaled down: its actor ends for good

Each core is a CoreActor (core_actor.py) whose process runs the core; the
front end connects to its tcp:// addresses as it connects to any core. The
rest of the server sees each actor incarnation as a process: an
``ActorProcess`` has the parts of multiprocessing.Process that CoreProcess,
the listener and the restart supervisor use (pid, a sentinel fd readable
once it is dead, is_alive, exitcode, join, terminate, kill), so a Ray core
is a CoreProcess like a local one.

Healing: Ray restarts a dead actor (up to ``max_restarts``); the supervisor,
instead of spawning a process, calls ``rejoin``: wait for the actor's next
incarnation, then connect and handshake as at start. An actor Ray gave up
on (its restarts spent) is created afresh, within the supervisor's budget.

Imports ray: only ``kvferry serve --ray`` imports this module.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvferry import envs, peer_auth
from kvferry.config import EngineConfig
from kvferry.engine.core_client import CoreAddresses, CoreProcess, EngineCoreStartError
from kvferry.fleet.core_actor import CoreActor, CoreActorInfo
from kvferry.fleet.placement import RANK_STRATEGIES, RankRoom, RayPlacement, actor_resources
from kvferry.fleet.reservations import release, reserve, reserve_now
from kvferry.router.scaling import CorePlacementError

logger = logging.getLogger(__name__)

# Threads of a core's actor: ``wait`` holds one for the core's life, ``info`` needs another.
_ACTOR_CONCURRENCY = 4
# How long a dead core's old incarnation may take to end after reporting its
# error (it flushes its outputs, then exits) before Ray is asked to restart it.
_OLD_EXIT_S = 5.0


class ActorProcess:
    """One incarnation of a core's actor, with multiprocessing.Process's
    interface. Its death is learnt from ``wait``, a call that returns only
    when the core's loop ends (or fails when the actor dies): no polling."""

    def __init__(self, name: str, actor: "ray.actor.ActorHandle", info: CoreActorInfo) -> None:
        self.name = name
        self.actor = actor
        self.info = info
        self.exitcode: int | None = None
        self.death: str | None = None  # why the incarnation ended, as Ray said
        self._clean = False
        self._dead = threading.Event()
        # The sentinel: readable once dead (the listener watches it like a process's).
        self._read_fd, self._write_fd = os.pipe()
        actor.wait.remote(info.incarnation).future().add_done_callback(self._on_end)

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def actor_id(self) -> str:
        return self.info.actor_id

    @property
    def sentinel(self) -> int:
        return self._read_fd

    def is_alive(self) -> bool:
        return not self._dead.is_set()

    def _on_end(self, future) -> None:  # on a Ray thread: no Ray calls here
        error = future.exception()
        self._clean = error is None and future.result() is True
        self.exitcode = 0 if self._clean else 1
        self.death = None if error is None else str(error).splitlines()[0]
        if error is not None:
            logger.error("the Ray actor of %s (pid %d) died: %s", self.name, self.pid, self.death)
        self._dead.set()
        os.write(self._write_fd, b"x")

    def join(self, timeout: float | None = None) -> None:
        self._dead.wait(timeout)
        if self._clean:
            self._end_actor()  # the core stopped when told to: release the actor for good

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        """End the actor for good (Ray restarts it no more)."""
        self._end_actor()

    def _end_actor(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except (RayActorError, ValueError):  # gone already
            pass

    def restart(self) -> None:
        """Kill this incarnation and let Ray start the next one."""
        try:
            ray.kill(self.actor, no_restart=False)
        except (RayActorError, ValueError):
            pass

    def __del__(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def rank_count(config: EngineConfig) -> int:
    """The processes of one core: its TP ranks times its PP stages."""
    return config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size


def core_process(name: str, actor: "ray.actor.ActorHandle", info: CoreActorInfo) -> CoreProcess:
    return CoreProcess(ActorProcess(name, actor, info), CoreAddresses(info.input, info.output))  # type: ignore[arg-type]


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raise ConnectionError unless something listens at HOST:PORT: Ray's
    own client retries an unreachable head for minutes before it gives up."""
    if address == "auto":
        return  # Ray looks the local cluster up itself, and fails fast
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc})") from None


def warn_if_no_node_fits(name: str, resources: dict[str, float]) -> None:
    """Say so at once when no node of the cluster offers ``resources`` now:
    Ray keeps such an actor pending (an autoscaler may add a node for it),
    and the start only fails at --engine-start-timeout."""
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    if not any(all(offered.get(k, 0.0) >= v for k, v in resources.items()) for offered in nodes):
        logger.warning("no node of the Ray cluster offers %s, which %s asks for: it waits for one "
                       "(up to --engine-start-timeout)", resources, name)


@dataclass(slots=True)
class _ActorSpec:
    """How a core's actor was created: to create it again."""

    config: EngineConfig
    role: str
    check_integrity_when_idle: bool
    log_level: str
    cpus: str | None


class RayCores:
    """Creates the cores' actors and brings a restarted one back. One per
    server; the actors are the serve process's (they end with it)."""

    def __init__(self, placement: RayPlacement, max_restarts: int) -> None:
        self.placement = placement
        self.max_restarts = max_restarts
        self._actor_class = ray.remote(CoreActor)
        self._actors: dict[str, "ray.actor.ActorHandle"] = {}  # by core name: the current actor
        self._specs: dict[str, _ActorSpec] = {}
        # The room reserved for each core a scale added (reservations.py): its
        # actor, and any actor made afresh for it, is created there.
        self._groups: dict[str, PlacementGroup] = {}
        # A TP/PP role's group shape (ranks, Ray strategy): a scale reserves the same.
        self._shapes: dict[str, tuple[int, str]] = {}

    @classmethod
    def connect(cls, placement: RayPlacement, max_restarts: int) -> "RayCores":
        """Join the running cluster at ``placement.address`` as a driver.
        Raises ConnectionError when there is none."""
        if not ray.is_initialized():
            check_reachable(placement.address)
            try:
                # The cores' logs stay in the cluster's log folders: the
                # server's own output is its log and ready line.
                ray.init(address=placement.address, namespace="kvferry", log_to_driver=False,
                         logging_level=logging.WARNING)
            except Exception as exc:  # noqa: BLE001 - Ray raises several kinds; all mean the same here
                raise ConnectionError(f"--ray {placement.address}: cannot join the Ray cluster: "
                                      f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from None
        logger.info("on the Ray cluster at %s: %s", placement.address, ray.cluster_resources())
        return cls(placement, max_restarts)

    def close(self) -> None:
        ray.shutdown()

    # -- start (blocking: before the event loop runs) ---------------------------------
    def start(self, cores: list[tuple[str, str, EngineConfig, str | None]], check_integrity_when_idle: bool,
              log_level: str, ready_timeout_s: float) -> list[CoreProcess]:
        """One actor per (name, role, config, cpus), created together (they
        load their models in parallel); returns once each is placed and has
        bound its sockets (its handshake is the caller's). On any failure
        every actor created is ended before EngineCoreStartError propagates."""
        processes = []
        try:
            for name, role, config, cpus in cores:
                self._specs[name] = _ActorSpec(config, role, check_integrity_when_idle, log_level, cpus)
                self._reserve_ranks(name, role, config)
                if name not in self._groups:
                    warn_if_no_node_fits(name, self.placement.resources_of(role))
                self._actors[name] = self._create(name)
            deadline = time.monotonic() + ready_timeout_s
            for name, *_ in cores:
                info = self._get_info(name, deadline - time.monotonic())
                processes.append(core_process(name, self._actors[name], info))
        except BaseException:
            for actor in self._actors.values():
                ray.kill(actor, no_restart=True)
            release(self._groups.values())
            raise
        return processes

    def _reserve_ranks(self, name: str, role: str, config: EngineConfig) -> None:
        """A TP/PP core's placement group: a bundle per rank (0: the core's
        actor), packed or spread (--ray-rank-placement), placed before its
        actor starts so that a group the cluster cannot place fails within
        --scale-timeout-s, naming the resources (reservations.py)."""
        ranks = rank_count(config)
        if ranks == 1:
            return
        strategy = RANK_STRATEGIES[self.placement.rank_placement]
        self._shapes[role] = (ranks, strategy)
        try:
            group = reserve_now(name, role, self.placement.resources_of(role), ranks, strategy,
                                self.placement.scale_timeout_s)
        except CorePlacementError as exc:
            raise EngineCoreStartError(str(exc)) from None
        if group is not None:
            self._groups[name] = group

    def _create(self, name: str) -> "ray.actor.ActorHandle":
        spec = self._specs[name]
        options = actor_resources(self.placement.resources_of(spec.role))
        ranks = None
        if name in self._groups:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self._groups[name], 0)
            if rank_count(spec.config) > 1:  # its other ranks go in bundles 1..N-1 (core_actor.py)
                ranks = RankRoom(self._groups[name], self.placement.rank_placement,
                                 self.placement.resources_of(spec.role))
        # What a core spawned here would inherit: the KVFERRY_* settings, and
        # the socket secret every core of this server shares (KV transfer tokens).
        env = {k: v for k, v in os.environ.items() if k.startswith("KVFERRY_")}
        env[envs.SOCKET_SECRET] = peer_auth.socket_secret().hex()
        return self._actor_class.options(max_restarts=self.max_restarts, max_concurrency=_ACTOR_CONCURRENCY,
                                         **options).remote(spec.config, name, spec.role, env,
                                                           spec.check_integrity_when_idle, spec.log_level,
                                                           spec.cpus, ranks)

    def _get_info(self, name: str, timeout_s: float) -> CoreActorInfo:
        try:
            return ray.get(self._actors[name].info.remote(), timeout=max(0.0, timeout_s))
        except GetTimeoutError:
            resources = self.placement.resources_of(self._specs[name].role)
            raise EngineCoreStartError(
                f"the Ray cluster did not place {name} (resources {resources}) within the start timeout: "
                f"does a node offer them? (ray status)") from None
        except RayActorError as exc:
            raise EngineCoreStartError(f"the Ray actor of {name} failed to start: {exc}") from None

    # -- scaling (event loop) ----------------------------------------------------------
    async def reserve(self, cores: list[tuple[str, str]]) -> None:
        """Room for each new (name, role), all or none, within the
        placement's ``scale_timeout_s``. Raises CorePlacementError naming
        what is missing (nothing is left reserved then)."""
        groups = await reserve([(name, role, self.placement.resources_of(role)) for name, role in cores],
                               self.placement.scale_timeout_s, self._shapes)
        self._groups.update(groups)

    async def add(self, name: str, role: str, config: EngineConfig, cpus: str | None,
                  check_integrity_when_idle: bool, log_level: str, ready_timeout_s: float) -> CoreProcess:
        """One more core's actor (a pool scaled up), placed by its role's
        resources (in the room ``reserve`` made for it); returns once it is
        placed and has bound its sockets (its handshake is the caller's).
        Raises EngineCoreStartError, after ending the actor, when it is not
        up within ``ready_timeout_s``; a cancel ends it too."""
        self._specs[name] = _ActorSpec(config, role, check_integrity_when_idle, log_level, cpus)
        try:
            if name not in self._groups:
                await asyncio.to_thread(warn_if_no_node_fits, name, self.placement.resources_of(role))
            actor = self._actors[name] = self._create(name)
            info = await asyncio.wait_for(asyncio.wrap_future(actor.info.remote().future()), ready_timeout_s)
        except TimeoutError:
            self._end(name)
            resources = self.placement.resources_of(role)
            raise EngineCoreStartError(
                f"the Ray cluster did not place {name} (resources {resources}) within the start timeout: "
                f"does a node offer them? (ray status)") from None
        except RayActorError as exc:
            self._end(name)
            raise EngineCoreStartError(f"the Ray actor of {name} failed to start: {exc}") from None
        except BaseException:
            self._end(name)  # cancelled (the server stops): no actor or room left behind
            raise
        return core_process(name, actor, info)

    def forget(self, name: str) -> None:
        """A core removed from its pool (or whose start failed): end its
        actor for good (a no-op when it already ended), release the room
        reserved for it, and forget how it was made."""
        self._end(name)

    def _end(self, name: str) -> None:
        self._specs.pop(name, None)
        actor = self._actors.pop(name, None)
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except (RayActorError, ValueError):
                pass
        group = self._groups.pop(name, None)
        if group is not None:
            release([group])

    # -- restart (event loop) ----------------------------------------------------------
    async def rejoin(self, name: str, dead: CoreProcess, timeout_s: float) -> CoreProcess:
        """The next incarnation of ``name``'s actor, once Ray restarted it
        (its handshake is the caller's). Raises EngineCoreStartError when
        none is up within ``timeout_s``."""
        old: ActorProcess = dead.process  # type: ignore[assignment]
        deadline = time.monotonic() + timeout_s
        # Dead by its own report (an engine error): its process exits once
        # its outputs are flushed; one that does not is killed, for Ray to restart.
        if not await asyncio.to_thread(old._dead.wait, _OLD_EXIT_S):
            old.restart()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineCoreStartError(f"the Ray actor of {name} did not come back within {timeout_s:.0f} s")
            actor = self._actors[name]
            # Retried by Ray across the restart: answers once the new process is up.
            ref = actor.info.options(max_task_retries=-1).remote()
            try:
                info = await asyncio.wait_for(asyncio.wrap_future(ref.future()), left)
            except TimeoutError:
                continue  # the deadline check above raises
            except ActorDiedError as exc:
                # Ray restarts it no more (its restarts spent, or killed for
                # good by a failed handshake): a fresh actor, same options.
                logger.warning("the Ray actor of %s is gone (%s); creating a new one", name,
                               str(exc).splitlines()[0])
                self._actors[name] = self._create(name)
                continue
            except RayActorError:
                await asyncio.sleep(0.2)  # unavailable for a moment: ask again
                continue
            if info.incarnation == old.info.incarnation:
                old.restart()  # still the dead core's process
                await asyncio.sleep(0.2)
                continue
            logger.warning("the Ray actor of %s is back: pid %d on node %s", name, info.pid, info.node_id)
            return core_process(name, actor, info)
