"""The ranks of a TP or PP core that Ray spread over nodes
(``--ray-rank-placement spread``): each rank 1..N-1 is a RankActor in its
bundle of the core's placement group, and runs the rank's process
(``python -m kvferry.engine.tp_worker`` or ``pp_worker``) as its child, on
the node the bundle names.

    launcher = RayRankLauncher(group, resources, node_id, host)   # in the core's actor (core_actor.py)
    rank_launcher.install(launcher, node_id)                        # TPLeader / PPLeader use it
    sites = launcher.place(n - 1)          # the rank actors, bundles 1..n-1: their node, a free port, pid
    handle = launcher.spawn(rank, module, spec)                     # Popen's interface, over the actor

A group lives and dies whole here too: the rank actors are owned by the
core's actor process, so Ray ends them when it dies (and its children see
their parent gone and exit); a rank that exits makes its ``poll`` answer,
the leader's watcher fails the core, and Ray restarts the core's actor,
which places a fresh set of rank actors in the same group.

Imports ray: only a core's actor under ``kvferry serve --ray`` imports this module.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvferry.engine.rank_launcher import RankSite
from kvferry.fleet.core_actor import node_address
from kvferry.fleet.placement import actor_resources

logger = logging.getLogger(__name__)

# How long the core waits for its rank actors' places: after a restart the
# dead incarnation's rank actors may still hold the bundles for a moment.
PLACE_TIMEOUT_S = 120.0
_STOP_GRACE_S = 5.0


class RankActor:
    """One rank's place on its node; the rank's process is its child."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)  # the socket secret: the rank's CURVE keys are derived from it
        self.node_id = ray.get_runtime_context().get_node_id()
        self.host = node_address(self.node_id)
        self.proc: subprocess.Popen | None = None
        self._started = threading.Event()

    def site(self) -> RankSite:
        with socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET) as s:
            s.bind((self.host.strip("[]"), 0))  # free a moment ago: a stage binds its activations here
            port = s.getsockname()[1]
        return RankSite(self.host, port, os.getpid(), self.node_id)

    def start(self, module: str, spec: bytes) -> int:
        self.proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE)
        self.proc.stdin.write(spec)
        self.proc.stdin.close()
        self._started.set()
        return self.proc.pid

    def wait(self) -> int:
        """The rank's exit code, once it exited."""
        self._started.wait()
        return self.proc.wait()

    def stop(self) -> None:
        stop_child(self.proc)


def stop_child(proc: subprocess.Popen | None) -> None:
    """An actor's child process ended: SIGTERM, then SIGKILL past a grace."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()


class RayRank:
    """A rank process on another node, with the parts of Popen the leader uses."""

    def __init__(self, actor: "ray.actor.ActorHandle", pid: int, node: str) -> None:
        self.actor, self.pid, self.node = actor, pid, node
        self.returncode: int | None = None
        self._done = threading.Event()
        actor.wait.remote().future().add_done_callback(self._on_exit)

    def _on_exit(self, future) -> None:  # on a Ray thread
        error = future.exception()
        self.returncode = -9 if error is not None else future.result()  # the actor died: as if killed
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def terminate(self) -> None:
        try:
            self.actor.stop.remote()
        except RayActorError:
            pass

    def kill(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except (RayActorError, ValueError):
            pass
        self._done.wait(_STOP_GRACE_S)
        if self.returncode is None:
            self.returncode = -9
            self._done.set()


class RayRankLauncher:
    """rank_launcher.RankLauncher over the bundles 1..N-1 of ``group``
    (bundle 0 holds the core's own actor)."""

    def __init__(self, group: PlacementGroup, resources: dict[str, float], node: str, host: str) -> None:
        self.group, self.resources, self.node, self.host = group, resources, node, host
        self._actors: list = []
        self._sites: list[RankSite] = []
        self._class = ray.remote(RankActor)

    def place(self, count: int) -> list[RankSite]:
        env = {k: v for k, v in os.environ.items() if k.startswith("KVFERRY_")}
        self._actors = [self._class.options(
            max_restarts=0, max_concurrency=3, **actor_resources(self.resources),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, bundle)).remote(env)
            for bundle in range(1, count + 1)]
        try:
            self._sites = ray.get([a.site.remote() for a in self._actors], timeout=PLACE_TIMEOUT_S)
        except GetTimeoutError:
            self.close()
            raise RuntimeError(f"the Ray cluster did not place this core's {count} other ranks "
                               f"(resources {self.resources} each) in its placement group within "
                               f"{PLACE_TIMEOUT_S:g} s") from None
        logger.info("ranks 1..%d on Ray nodes %s", count, ", ".join(s.node[:12] for s in self._sites))
        return self._sites

    def spawn(self, rank: int, module: str, spec: object) -> RayRank:
        actor = self._actors[rank - 1]
        pid = ray.get(actor.start.remote(module, pickle.dumps(spec)))
        return RayRank(actor, pid, self._sites[rank - 1].node)

    def close(self) -> None:
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except (RayActorError, ValueError):
                pass
