"""``kvferry serve --ray ADDRESS --kv-cluster auto``: the cluster KV pool's
``mooncake_master``, started by the server on the Ray head node.

    master = ClusterMaster.start("auto", max_restarts=3)   # on the serve driver, after ray.init
    master.url      # mooncake://HEAD:PORT?metadata=http://HEAD:PORT2/metadata (+ auto?OPTIONS)
    master.close()  # at shutdown, after the node stores (the pool's clients)

One actor, ``MooncakeMasterActor``, named ``kvferry-mooncake-master-<job
id>`` in the server's Ray namespace and pinned to the head node, with two
child processes: the master, and Mooncake's HTTP metadata server
(``mooncake.http_metadata_server``; not the master's built-in one, which
listens on every interface whatever its host flag says). Both listen on
the head node's Ray address only (the address the other nodes reach it
by; never a wildcard), on ports picked free on that node before the actor
is created, so that they are the same for every incarnation of the actor.

Healing: the master (or the metadata server) dying ends its actor's process (exit 1) and Ray
restarts the actor, up to ``max_restarts`` times; the new master listens
at the same URL, and the node stores' clients rejoin it by themselves
(kvstore/cluster.py: meanwhile their lookups miss and requests
recompute). A restarted master starts empty: the blocks the nodes lent the
old one are written through again as they are computed.

The pool lives with the server: its blocks outlive no restart of it, so
no secret file needs to be kept for them. Blocks are shared between
nodes only when every node's store holds one secret
(``--cache-secret-file``, the same file on every node): every value in the
pool is authenticated under it (kvstore/shared_tier.py).

Imports ray: only ``kvferry serve --ray`` imports this module.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvferry.fleet.core_actor import node_address
from kvferry.fleet.node_store import NAMESPACE
from kvferry.kvstore.mooncake_lib import master_binary, metadata_server_argv
from kvferry.kvstore.pool_address import auto_url

logger = logging.getLogger(__name__)

# The master starts in well under a second; the head node may be busy.
START_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 10.0
_HEAD_RESOURCE = "node:__internal_head__"


def master_name(job_id: str) -> str:
    return f"kvferry-mooncake-master-{job_id}"


@dataclass(frozen=True, slots=True)
class MasterPorts:
    rpc: int
    metadata: int  # the HTTP metadata server
    metrics: int  # its metrics/admin HTTP server (off the default port, which a second server would share)


@dataclass(frozen=True, slots=True)
class MasterInfo:
    pid: int  # the mooncake_master process
    metadata_pid: int  # the HTTP metadata server's
    actor_pid: int  # its actor's process (the master's parent)
    node_id: str
    host: str
    ports: MasterPorts


def head_node_id() -> str:
    """The Ray head node's id (a ValueError when the cluster reports none)."""
    for node in ray.nodes():
        if node.get("Alive") and _HEAD_RESOURCE in node.get("Resources", {}):
            return node["NodeID"]
    raise ValueError("kv_cluster: auto: the Ray cluster reports no live head node to start the master on")


def _free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` (on the node this runs on)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.bind((host.strip("[]"), 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """A child's pre-exec: SIGKILLed when the actor's process dies (Linux's
    parent-death signal), so that an actor killed outright leaves no master
    holding the ports its next incarnation binds. The children are started
    from the actor's creation task, on its main thread, which lives as long
    as the process."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=0.2):
            return True
    except OSError:
        return False


class MooncakeMasterActor:
    """The pool's master and metadata server: child processes of this
    actor's process, whose output goes to this actor's Ray worker log.
    Threaded (``stop`` runs while the watchers wait)."""

    def __init__(self, host: str, ports: MasterPorts, log_level: str = "info") -> None:
        logging.basicConfig(level=log_level.upper(),
                            format="%(asctime)s %(levelname)s [mooncake-master] %(name)s: %(message)s")

        bare = host.strip("[]")
        self._host, self._ports, self._stopping = host, ports, False
        self.metadata = subprocess.Popen(metadata_server_argv(host, ports.metadata), stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent)
        self.process = subprocess.Popen(
            [master_binary(), f"--rpc_address={bare}", f"--rpc_port={ports.rpc}",
             f"--metrics_host={bare}", f"--metrics_port={ports.metrics}", "--enable_metric_reporting=false"],
            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (_listening(host, ports.rpc) and _listening(host, ports.metadata)):
            dead = next((p for p in (self.process, self.metadata) if p.poll() is not None), None)
            if dead is not None or time.monotonic() > deadline:
                self._kill_children()
                what = f"did not listen within {START_TIMEOUT_S:.0f} s" if dead is None else \
                    f"exited with {dead.returncode} at start (its output is in the head node's Ray worker logs)"
                name = "the metadata server" if dead is self.metadata else "mooncake_master"
                raise RuntimeError(f"{name} {what}")
            time.sleep(0.05)
        logger.info("mooncake_master (pid %d) on %s: rpc %d; metadata server (pid %d) %d", self.process.pid, host,
                    ports.rpc, self.metadata.pid, ports.metadata)
        for child in (self.process, self.metadata):
            threading.Thread(target=self._watch, args=(child,), name="master-watch", daemon=True).start()

    def info(self) -> MasterInfo:
        return MasterInfo(self.process.pid, self.metadata.pid, os.getpid(), ray.get_runtime_context().get_node_id(),
                          self._host, self._ports)

    def stop(self) -> int | None:
        """Stop the master and the metadata server (SIGTERM, then SIGKILL);
        the master's exit code."""
        self._stopping = True
        for child in (self.process, self.metadata):
            child.terminate()
        codes = []
        for child in (self.process, self.metadata):
            try:
                codes.append(child.wait(_STOP_TIMEOUT_S))
            except subprocess.TimeoutExpired:
                child.kill()
                codes.append(child.wait())
        return codes[0]

    def _kill_children(self) -> None:
        for child in (self.process, self.metadata):
            if child.poll() is None:
                child.kill()
                child.wait()

    def _watch(self, child: subprocess.Popen) -> None:
        code = child.wait()
        if self._stopping:
            return
        # Gone under the node stores: this process ends too (and the other
        # child with it), for Ray to start the actor, and both, again at the same ports.
        logger.error("%s (pid %d) exited with %s; ending its actor for Ray to restart it",
                     "mooncake_master" if child is self.process else "the metadata server", child.pid, code)
        self._kill_children()
        logging.shutdown()
        os._exit(1)


class ClusterMaster:
    """The serve driver's handle on the master it started."""

    def __init__(self, actor: "ray.actor.ActorHandle", url: str, node_id: str) -> None:
        self.actor = actor
        self.url = url
        self.node_id = node_id

    @classmethod
    def start(cls, value: str, max_restarts: int, log_level: str = "info") -> "ClusterMaster":
        """Start the master on the head node for ``value`` (``auto`` or
        ``auto?OPTIONS``: the options of the URL the stores get). Raises
        ValueError naming what is missing or why it did not start."""
        master_binary()  # a ValueError naming what is missing, before any actor
        head = head_node_id()
        host = node_address(head)
        pinned = NodeAffinitySchedulingStrategy(head, soft=False)
        actor = None
        try:
            ports = MasterPorts(*ray.get(ray.remote(_free_ports).options(num_cpus=0, scheduling_strategy=pinned)
                                         .remote(host, 3), timeout=START_TIMEOUT_S))
            actor = ray.remote(MooncakeMasterActor).options(
                name=master_name(ray.get_runtime_context().get_job_id()), namespace=NAMESPACE, num_cpus=0,
                max_concurrency=2, max_restarts=max_restarts,
                scheduling_strategy=pinned).remote(host, ports, log_level)
            pid = ray.get(actor.info.remote(), timeout=START_TIMEOUT_S + 30).pid
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:
            if actor is not None:
                _kill(actor)
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
            raise ValueError(f"kv_cluster: auto: the mooncake_master on the Ray head node did not start: "
                               f"{reason}") from None
        url = auto_url(value, host, ports.rpc, ports.metadata)
        logger.info("cluster KV pool: mooncake_master (pid %d) on the Ray head node %s at %s", pid, head, url)
        return cls(actor, url, head)

    def close(self) -> None:
        """Stop the master and end its actor for good (after the node stores)."""
        try:
            ray.get(self.actor.stop.remote(), timeout=_STOP_TIMEOUT_S + 10)
        except Exception as exc:  # noqa: BLE001 - whatever Ray says, the actor ends below and with the driver
            logger.warning("stopping the mooncake_master: %s", str(exc).splitlines()[0] if str(exc) else repr(exc))
        _kill(self.actor)


def _kill(actor: "ray.actor.ActorHandle") -> None:
    try:
        ray.kill(actor, no_restart=True)
    except (RayActorError, ValueError):
        pass
