"""The FFN workers of ``kvferry serve --ray --mode afd`` as Ray actors,
placed by ``--ray-ffn-resources`` as the cores are by theirs.

    server (the driver)                                 FFN worker j: an FFNActor on the node Ray chose
    FFNPool(config, launcher=RayFFN(...))  ── spawn ──▶ its process "kvferry: afd ffn j" (afd_worker.py) as its
                                                        child: ipc in the actor's 0700 folder, and tcp://NODE:*
                                                        with CURVE (parallel/rank_sockets.py)
      ready: every actor's FFNSite (node, ipc, tcp)  ◀── once the worker's pid file is written
      publish ──▶ FFNBoard "kvferry-ffn-…" (a named actor): (Generation with its sites, the actors)
    attention core (a CoreActor, core_actor.py)
      BoardView(board, node): reads the board every BOARD_POLL_S; each worker on its own node over
      ipc, any other over tcp with CURVE; a worker is gone once its actor's ``wait`` returns

The pool's rules are the local ones (afd_pool.py): generations, a resize
beside the serving one (``kvferry scale --ffn``), a dead worker restarts
the whole generation within --engine-restarts. A worker handle
(``FFNHandle``) has Popen's interface over its actor, as the spread TP
ranks' (rank_actors.RayRank); its actor is released once its process exits.

Imports ray: only ``kvferry serve --ray`` and a core's actor import this module.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from kvferry import envs, peer_auth, private_dirs
from kvferry.config import EngineConfig
from kvferry.engine.afd_pool import FFNLoadError, FFNSite, FFNSpec, Generation, pid_file, read_pid, tcp_file
from kvferry.fleet.core_actor import node_address
from kvferry.fleet.placement import actor_resources
from kvferry.fleet.rank_actors import RayRank, stop_child
from kvferry.fleet.ray_cores import warn_if_no_node_fits
from kvferry.parallel.afd import ffn_address

logger = logging.getLogger(__name__)

NAMESPACE = "kvferry"  # the server's (ray_cores.RayCores.connect)
BOARD_POLL_S = 0.1  # how often a core reads the board: a restart or a resize is seen this late at most
# An FFN actor's threads: the pool's and every attention core's ``wait`` hold one each for its life.
_ACTOR_CONCURRENCY = 64
_READY_TIMEOUT_S = 30.0


class FFNBoard:
    """What the pool serves now, for the cores of every node: (Generation, its workers' actors)."""

    def __init__(self) -> None:
        self._value: tuple[Generation, list] | None = None

    def publish(self, gen: Generation, actors: list) -> None:
        self._value = (gen, actors)

    def read(self) -> tuple[Generation, list] | None:
        return self._value


class FFNActor:
    """One FFN worker's place on its node; the worker's process is its child."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)  # the socket secret: the worker's CURVE keys are derived from it
        self.node_id = ray.get_runtime_context().get_node_id()
        self.host = node_address(self.node_id)
        self.folder = private_dirs.make("kvferry-ffn-")  # 0700: its ipc sockets; the worker removes it if we die
        self.proc: subprocess.Popen | None = None
        self.threads = 0
        self._started = threading.Event()

    def start(self, spec: FFNSpec) -> int:
        spec = dataclasses.replace(spec, folder=self.folder, host=self.host, parent_pid=os.getpid())
        self.threads = spec.threads
        self.proc = subprocess.Popen([sys.executable, "-m", "kvferry.engine.afd_worker"], stdin=subprocess.PIPE)
        self.proc.stdin.write(pickle.dumps(spec))
        self.proc.stdin.close()
        self._started.set()
        return self.proc.pid

    def ready(self, generation: int, index: int) -> FFNSite | None:
        """Its addresses once the worker serves (its pid file written), else None."""
        if self.proc is None or read_pid(pid_file(self.folder, index, generation)) != self.proc.pid:
            return None
        with open(tcp_file(self.folder, index, generation), encoding="ascii") as f:
            tcp = f.read().strip()
        return FFNSite(self.node_id, ffn_address(self.folder, index, generation), tcp, self.proc.pid, self.threads)

    def wait(self) -> int:
        """The worker's exit code, once it exited (its folder is removed then:
        the pool ends this actor without a ``stop``)."""
        self._started.wait()
        code = self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
        return code

    def retire(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)

    def stop(self) -> None:
        stop_child(self.proc)
        shutil.rmtree(self.folder, ignore_errors=True)


class FFNHandle(RayRank):
    """A worker on some node, with the parts of Popen the pool uses; its
    actor is ended once the worker's process is seen to exit."""

    _released = False

    def poll(self) -> int | None:
        code = super().poll()
        if code is not None and not self._released:
            self._released = True
            try:
                ray.kill(self.actor, no_restart=True)
            except (RayActorError, ValueError):
                pass
        return code

    def wait(self, timeout: float | None = None) -> int:
        super().wait(timeout)
        return self.poll()  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        """SIGUSR1 (retire) is all the pool sends."""
        if sig == signal.SIGUSR1:
            self.actor.retire.remote()


class RayFFN:
    """afd_pool.FFNLauncher over Ray: each worker an FFNActor asking for
    ``resources``; the generations published on the board actor ``board``."""

    def __init__(self, config: EngineConfig, name: str, resources: dict[str, float], board: str,
                 place_timeout_s: float) -> None:
        self.config, self.name, self.resources, self.place_timeout_s = config, name, resources, place_timeout_s
        self.board_name = board
        self._board = ray.remote(FFNBoard).options(name=board, namespace=NAMESPACE).remote()
        self._class = ray.remote(FFNActor)
        self._sites: dict[int, list[FFNSite]] = {}
        self._actors: dict[int, list] = {}

    def spawn(self, generation: int, size: int) -> list[FFNHandle]:
        """``size`` workers of ``generation``, placed and started; FFNLoadError
        (none left running) when Ray does not place them within the timeout."""
        warn_if_no_node_fits(f"an FFN worker of {self.name}", self.resources)
        env = {k: v for k, v in os.environ.items() if k.startswith("KVFERRY_")}
        env[envs.SOCKET_SECRET] = peer_auth.socket_secret().hex()
        actors = [self._class.options(max_restarts=0, max_concurrency=_ACTOR_CONCURRENCY,
                                      **actor_resources(self.resources)).remote(env) for _ in range(size)]
        self._actors[generation] = actors
        threads = self.config.parallel.cpu_threads_per_rank or max(1, int(self.resources.get("CPU", 1.0)))
        specs = [FFNSpec(self.config, j, size, "", self.name, threads, 0, logging.getLogger().getEffectiveLevel(),
                         generation) for j in range(size)]
        try:
            pids = ray.get([a.start.remote(spec) for a, spec in zip(actors, specs)], timeout=self.place_timeout_s)
        except (GetTimeoutError, RayActorError) as exc:
            self._end(generation)
            why = "did not place" if isinstance(exc, GetTimeoutError) else "failed to start"
            raise FFNLoadError(f"the Ray cluster {why} {size} FFN workers (resources {self.resources} each) within "
                               f"{self.place_timeout_s:g} s (--scale-timeout-s; ray status lists each node's "
                               "resources)") from None
        return [FFNHandle(a, pid, "") for a, pid in zip(actors, pids)]

    def ready(self, procs: list[FFNHandle], generation: int) -> bool:
        actors = self._actors.get(generation, [])
        try:
            sites = ray.get([a.ready.remote(generation, j) for j, a in enumerate(actors)], timeout=_READY_TIMEOUT_S)
        except (GetTimeoutError, RayActorError):
            return False  # the pool sees a dead one through its handle
        if not actors or None in sites:
            return False
        self._sites[generation] = sites
        for proc, site in zip(procs, sites):
            proc.node = site.node
        return True

    def publish(self, gen: Generation) -> None:
        actors = []
        if gen.health == "ok":
            gen = dataclasses.replace(gen, sites=tuple(self._sites[gen.generation]))
            actors = self._actors[gen.generation]
        ray.get(self._board.publish.remote(gen, actors))
        for old in [g for g in self._sites if g < gen.generation]:  # their handles release their actors
            self._sites.pop(old)

    def unready(self, generation: int, size: int) -> None:
        """The board names only the generation published last: nothing to withdraw."""

    def _end(self, generation: int) -> None:
        for actor in self._actors.pop(generation, []):
            try:
                ray.kill(actor, no_restart=True)
            except (RayActorError, ValueError):
                pass

    def close(self) -> None:
        """End every worker's actor and the board (the pool stopped their processes)."""
        for generation in list(self._actors):
            self._end(generation)
        try:
            ray.kill(self._board, no_restart=True)
        except (RayActorError, ValueError):
            pass


class BoardView:
    """afd_sites.GenerationView of an attention core on Ray node ``node``."""

    def __init__(self, board: str, node: str) -> None:
        self.node_id = node
        self._board = board_actor(board)
        self._latest: Generation | None = None
        self._exits: dict[int, list] = {}  # generation -> its workers' ``wait`` futures (done: gone)
        self._stop = threading.Event()
        self._poll()
        threading.Thread(target=self._follow, name="afd-ffn-board", daemon=True).start()

    def _poll(self) -> None:
        try:
            value = ray.get(self._board.read.remote(), timeout=10)
        except (GetTimeoutError, RayActorError) as exc:
            logger.debug("the FFN board did not answer: %s", exc)
            return
        if value is None:
            return
        gen, actors = value
        if gen.health == "ok" and gen.generation not in self._exits:
            self._exits[gen.generation] = [a.wait.remote().future() for a in actors]
        self._latest = gen

    def _follow(self) -> None:
        while not self._stop.wait(BOARD_POLL_S):
            self._poll()

    def read(self) -> Generation | None:
        return self._latest

    def dead(self, gen: Generation) -> list[int]:
        return [j for j, exit_ in enumerate(self._exits.get(gen.generation, [])) if exit_.done()]

    def address(self, gen: Generation, index: int) -> tuple[str, bool]:
        site = gen.sites[index]
        return (site.ipc, False) if site.node == self.node_id else (site.tcp, True)

    def node(self, gen: Generation, index: int) -> str:
        return gen.sites[index].node if gen.sites else ""

    def close(self) -> None:
        self._stop.set()


def board_actor(board: str, timeout_s: float = 30.0) -> "ray.actor.ActorHandle":
    """The named board actor, once Ray knows it (the server creates it before any core starts)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(board, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
