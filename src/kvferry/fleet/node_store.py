"""One node KV store per Ray node that hosts an engine core (``kvferry serve
--ray ADDRESS --kv-dram-gb N``, with the other ``--kv-*`` tier flags).

    serve driver:  stores = NodeStores.start(NodeStoreSpec(tiers, api_keys, cache_secret, env, max_restarts))
    core actor:    config.kv_tiers.kv_store = node_store_address(node_id)   # in CoreActor.__init__
    serve driver:  stores.close()                                          # at shutdown, before ray.shutdown()

Three kinds of actor, all in the server's Ray namespace ("kvferry"):

* ``NodeStores``, one per server, named ``kvferry-kvstores-<job id>``:
  created by the serve driver, which owns it. It creates each node's
  store when a core on that node first asks for it, so that every store
  is owned by it and through it by the driver: they end with the server
  (a core cannot own its node's store: a store would then die with the
  first core that does, and the other cores of the node lose it too).
* ``NodeStoreActor``, one per node, named ``kvferry-kvstore-<job id>-<node
  id>``, pinned to its node (NodeAffinitySchedulingStrategy, soft=False),
  created with ``get_if_exists``. It starts the store as ``kvferry serve``
  starts one (``kvstore.launch.start_store``: a child process titled
  "kvferry: kvstore", with the server's tier flags and key file, its one
  cache secret through a pipe (``start_node_store``) so that every node's
  store seals, names and authenticates under the same secret and the
  nodes share the pool's (and Redis') blocks, public and private, and its
  socket secret in the environment so that the cores' tokens are the
  store's), listening on an ipc:// socket: only the cores of its node use
  it.
* The cores (``core_actor.CoreActor``), which ask ``NodeStores`` for their
  node's store address before they build their engine.

Healing: the store's address is fixed per server and node, so a store
started again listens where the cores' clients (``KVStoreClient``)
reconnect by themselves; meanwhile their lookups miss (as with a store
that died under ``kvferry serve``). The store process dying ends its
actor's process (exit 1), and a dead actor's process ends the store (it
watches its parent, if Ray does not kill it first): either way Ray restarts the actor, up to
``max_restarts`` times, and the new incarnation starts the store again.
A core restarted by Ray asks again and finds the same store; one whose
store's restarts are spent gets a fresh store actor.

Imports ray: only the Ray cores and ``kvferry serve --ray`` import this
module (the store's own process, a plain child, never does).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvferry import envs, peer_auth
from kvferry.config import KVTierConfig
from kvferry.kvstore.launch import start_store

logger = logging.getLogger(__name__)

NAMESPACE = "kvferry"  # the serve driver's Ray namespace (ray_cores.RayCores.connect)
# How long a core waits for its node's store to be placed and answer (it
# loads no model: seconds, unless the node is out of memory or gone).
START_TIMEOUT_S = 120.0
# A store actor's methods are short, but ``stop`` waits up to _STOP_TIMEOUT_S
# for the store to exit: ``info`` still answers meanwhile.
_STORE_CONCURRENCY = 4
# One thread per core asking at once (each may wait for its node's store to start).
_REGISTRY_CONCURRENCY = 32
_STOP_TIMEOUT_S = 15.0


def registry_name(job_id: str) -> str:
    return f"kvferry-kvstores-{job_id}"


def store_name(job_id: str, node_id: str) -> str:
    return f"kvferry-kvstore-{job_id}-{node_id}"


@dataclass(frozen=True, slots=True)
class NodeStoreSpec:
    """How every node's store is started: what ``kvferry serve`` gives the
    store it starts without --ray. The key file is a path: on a cluster of
    several hosts each node must have it at the same path (as it has the
    model). The cache secret travels as the socket secret does, in the
    actors' creation arguments (whoever reaches Ray's control plane can run
    code on every node anyway): the server's (``secret_file.server_cache_secret``),
    the same for every node."""

    tiers: KVTierConfig  # the --kv-* flags (kv_store empty: each node's store sets its own)
    api_keys: str | None
    cache_secret: bytes | None = field(repr=False)  # never in a log line or an error's repr
    # The server's KVFERRY_* settings and socket secret (the cores get the same).
    env: dict[str, str] = field(repr=False)
    max_restarts: int  # of each store's actor
    log_level: str = "info"


@dataclass(frozen=True, slots=True)
class NodeStoreInfo:
    address: str  # ipc://... on the store's node
    pid: int  # the store's process ("kvferry: kvstore")
    actor_pid: int  # its actor's process (the store's parent)
    node_id: str
    actor_id: str  # the same across restarts


def server_env() -> dict[str, str]:
    """What a process this server spawned would inherit, as the cores' actors
    get it (ray_cores.RayCores._create): the KVFERRY_* settings and the socket
    secret, which the store's token derives from."""
    env = {k: v for k, v in os.environ.items() if k.startswith("KVFERRY_")}
    env[envs.SOCKET_SECRET] = peer_auth.socket_secret().hex()
    return env


_SOCKET_PREFIX = "kvferry-nodestore-"


def store_address(job_id: str, node_id: str) -> str:
    """The store's socket on its node: the same for every incarnation of the
    store (the cores' clients reconnect to it), apart for each server (job)
    and node (two Ray nodes may share one host's /tmp)."""
    return f"ipc://{tempfile.gettempdir()}/{_SOCKET_PREFIX}{job_id}-{node_id[:24]}.sock"


def remove_stale_sockets(directory: Path) -> None:
    """The socket files of node stores that are gone: a store ended by Ray
    with its actor (the server was killed) is killed too and never removes
    its own. A socket file nothing listens on refuses a connection."""
    for path in directory.glob(f"{_SOCKET_PREFIX}*.sock"):
        try:
            if not path.is_socket() or path.lstat().st_uid != os.getuid():
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)
        except OSError:
            continue


def start_node_store(spec: NodeStoreSpec, address: str) -> subprocess.Popen:
    """The node's store process, as ``spec`` says, listening at ``address``
    and answering; raises (ValueError, RuntimeError) when it cannot start.
    The caller has put ``spec.env`` in its environment (the store inherits
    the socket secret); the cache secret goes through a pipe."""
    tiers = dataclasses.replace(spec.tiers, kv_store=address)
    process, _ = start_store(tiers, api_keys=spec.api_keys, cache_secret=spec.cache_secret,
                             extra_args=["--log-level", spec.log_level.lower()])
    return process


class NodeStoreActor:
    """The node's store: a ``kvferry: kvstore`` child process of this actor's
    process. Threaded (``stop`` runs while the watcher waits)."""

    def __init__(self, spec: NodeStoreSpec) -> None:
        os.environ.update(spec.env)  # first: the child inherits the socket secret
        logging.basicConfig(level=spec.log_level.upper(),
                            format="%(asctime)s %(levelname)s [node-kvstore] %(name)s: %(message)s")
        context = ray.get_runtime_context()
        node_id = context.get_node_id()
        remove_stale_sockets(Path(tempfile.gettempdir()))
        address = store_address(context.get_job_id(), node_id)
        self._stopping = False
        # Raises (the actor fails to start, the core that asked says why) when the store cannot start.
        self.process = start_node_store(spec, address)
        self._info = NodeStoreInfo(address, self.process.pid, os.getpid(), node_id, context.get_actor_id())
        logger.info("KV store of node %s at %s (pid %d)", node_id, address, self.process.pid)
        threading.Thread(target=self._watch, name="kvstore-watch", daemon=True).start()

    def info(self) -> NodeStoreInfo:
        return self._info

    def stop(self) -> int | None:
        """Stop the store cleanly (SIGTERM: it removes its socket and arena);
        its exit code. The actor is ended by the caller."""
        self._stopping = True
        self.process.terminate()
        try:
            return self.process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def _watch(self) -> None:
        code = self.process.wait()
        if self._stopping:
            return
        # Dead under the cores (killed, out of memory): this process ends too,
        # so that Ray starts the actor, and with it the store, again.
        logger.error("the KV store (pid %d) exited with %s; ending its actor for Ray to restart it",
                     self.process.pid, code)
        logging.shutdown()
        os._exit(1)


class NodeStores:
    """The server's registry of its node stores (see the module's doc)."""

    def __init__(self, spec: NodeStoreSpec) -> None:
        self.spec = spec
        self._job_id = ray.get_runtime_context().get_job_id()
        self._actor_class = ray.remote(NodeStoreActor)
        self._stores: dict[str, "ray.actor.ActorHandle"] = {}  # by node id
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    # -- the driver's side -------------------------------------------------------------
    @classmethod
    def start(cls, spec: NodeStoreSpec) -> "NodeStoresHandle":
        """Create the server's registry (on the driver's node when it can):
        cores ask it for their node's store from then on."""
        here = ray.get_runtime_context().get_node_id()
        actor = ray.remote(cls).options(
            name=registry_name(ray.get_runtime_context().get_job_id()), namespace=NAMESPACE, num_cpus=0,
            max_concurrency=_REGISTRY_CONCURRENCY, max_restarts=spec.max_restarts,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)).remote(spec)
        return NodeStoresHandle(actor)

    # -- the cores' side (actor methods) -------------------------------------------------
    def address_on(self, node_id: str) -> str:
        """The address of ``node_id``'s store, started if it is not running.
        Raises RuntimeError when it cannot be started."""
        with self._lock:
            node_lock = self._locks.setdefault(node_id, threading.Lock())
        with node_lock:
            error = None
            for _ in range(2):  # a store dead for good (its restarts spent) is created afresh, once
                store = self._stores.get(node_id) or self._create(node_id)
                try:
                    return ray.get(store.info.remote(), timeout=START_TIMEOUT_S).address
                except GetTimeoutError:
                    raise RuntimeError(f"the KV store of Ray node {node_id} did not start within "
                                       f"{START_TIMEOUT_S:.0f} s") from None
                except RayActorError as exc:
                    self._stores.pop(node_id, None)
                    error = exc
            raise RuntimeError(f"the KV store of Ray node {node_id} failed to start: {_creation_error(error)} "
                               f"(its output is in that node's Ray worker logs)")

    def _create(self, node_id: str) -> "ray.actor.ActorHandle":
        store = self._stores[node_id] = self._actor_class.options(
            name=store_name(self._job_id, node_id), namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
            max_concurrency=_STORE_CONCURRENCY, max_restarts=self.spec.max_restarts,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(self.spec)
        return store

    def stop(self) -> None:
        """Stop every store cleanly and end its actor for good."""
        stores = list(self._stores.values())
        self._stores.clear()
        refs = [store.stop.remote() for store in stores]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=_STOP_TIMEOUT_S + 5)
        finally:
            for store in stores:
                try:
                    ray.kill(store, no_restart=True)
                except (RayActorError, ValueError):
                    pass


class NodeStoresHandle:
    """The serve driver's handle on its registry."""

    def __init__(self, actor: "ray.actor.ActorHandle") -> None:
        self.actor = actor

    def close(self) -> None:
        """Stop the stores (after the cores: they are their clients), then the registry."""
        try:
            ray.get(self.actor.stop.remote(), timeout=_STOP_TIMEOUT_S + 10)
        except Exception as exc:  # noqa: BLE001 - whatever Ray says, the actors end below and with the driver
            logger.warning("stopping the node KV stores: %s", _first_line(exc))
        try:
            ray.kill(self.actor, no_restart=True)
        except (RayActorError, ValueError):
            pass


def node_store_address(node_id: str, timeout_s: float = START_TIMEOUT_S + 10) -> str:
    """In a core's actor: the address of its node's store, started by the
    server's registry if need be; "" when the server started no registry
    (it runs no node stores). Raises RuntimeError when the store cannot be
    started."""
    job_id = ray.get_runtime_context().get_job_id()
    try:
        registry = ray.get_actor(registry_name(job_id), namespace=NAMESPACE)
    except ValueError:
        return ""
    try:
        return ray.get(registry.address_on.remote(node_id), timeout=timeout_s)
    except GetTimeoutError:
        raise RuntimeError(f"no KV store address for Ray node {node_id} within {timeout_s:.0f} s") from None
    except RayActorError as exc:  # the registry died (its node went away)
        raise RuntimeError(f"the server's KV store registry is gone: {_first_line(exc)}") from None
    except RayTaskError as exc:
        raise RuntimeError(_first_line(exc.cause if exc.cause is not None else exc)) from None


def _first_line(exc: BaseException | None) -> str:
    text = str(exc) if exc is not None else ""
    return text.splitlines()[0] if text else repr(exc)


def _creation_error(exc: BaseException | None) -> str:
    """Why an actor's ``__init__`` failed: Ray's message holds its traceback,
    whose last line is the exception ("RuntimeError: ..."); else its first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] if exc is not None else []
    if len(lines) > 1 and ": " in lines[-1]:
        return lines[-1]
    return _first_line(exc)
