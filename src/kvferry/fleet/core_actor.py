"""One engine core inside a Ray actor's process ("kvferry: prefill-0").

The front end (ray_cores.py) creates one CoreActor per core, placed by Ray
resources, with a bounded ``max_restarts``. The actor's process is the core's
process: its step loop and socket threads run here, as in a core that
``kvferry serve`` spawns itself, bound to tcp:// ports on the node's own
interface, so that the front end (and the peer cores' KV transfers) reach
it from any node.

    __init__          with --kv-dram-gb: its node's KV store address (node_store.py);
                      bind tcp://<node ip>:* (input, output), start the core's thread (it loads the model)
    info()            CoreActorInfo: the bound addresses, pid, Ray node id, incarnation
    wait(incarnation) returns once the core's loop ended: True when it stopped cleanly (a shutdown message)

A core whose loop fails (or that fails to load) reports why on its output
socket, as any core does, and then ends its process (exit 1): Ray runs
``__init__`` again in a fresh process, with the same arguments, and the
front end re-joins the new incarnation by its new addresses.

Light at import (the front end imports this module to name the class):
torch and the engine are imported in the actor's process only.
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from dataclasses import dataclass

import setproctitle

from kvferry.engine import afd_sites, rank_launcher
from kvferry.engine.core_addresses import CoreAddresses, parse_cpus
from kvferry.gc_heap import freeze_startup_heap

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CoreActorInfo:
    input: str  # tcp://<node ip>:PORT the core takes CoreInput on
    output: str  # ... and sends CoreOutput from
    pid: int
    node_id: str  # the Ray node id (hex), as ray.nodes() names it
    actor_id: str  # the Ray actor id (hex): the same across restarts
    incarnation: str  # new each time Ray (re)starts the actor's process


class CoreActor:
    """Threaded (the front end's ``wait`` blocks one thread for the core's
    life while ``info`` answers on another)."""

    def __init__(self, config, name: str, role: str, env: dict[str, str], check_integrity_when_idle: bool = False,
                 log_level: str = "INFO", cpus: str | None = None, ranks=None) -> None:
        """``ranks``: placement.RankRoom of a TP/PP core (its placement group), else None."""
        # First: the socket secret and KVFERRY_* settings of the server, which
        # a core it spawned itself would inherit (its KV transfer tokens).
        os.environ.update(env)
        import ray  # optional dependency: this module is imported without it

        self.title = f"kvferry: {name}"
        _set_title(self.title)
        logging.basicConfig(level=log_level.upper(),
                            format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
        from kvferry.engine.core_proc import EngineCoreProc  # lazy: torch, in the actor's process only

        node_id = ray.get_runtime_context().get_node_id()
        host = node_address(node_id)
        if role != "engine":
            config.kv_transfer.kv_transfer_address = on_node(config.kv_transfer.kv_transfer_address, host)
        _place_ranks(ranks, node_id, host)
        _find_ffn_workers(config, node_id)
        store_error = None
        if config.kv_tiers.enabled and not config.kv_tiers.kv_store:
            # --kv-dram-gb: the store of this node, shared with its other
            # cores (node_store.py); a restarted core finds the same one.
            from kvferry.fleet.node_store import node_store_address  # optional: imports ray

            try:
                config.kv_tiers.kv_store = node_store_address(node_id)
            except RuntimeError as exc:
                store_error = exc  # the core's start failure, reported as a model that fails to load
        if cpus:
            _bind_cpus(cpus)
        # Port "*": the kernel picks free ports; ``bound`` says which.
        self.proc = EngineCoreProc(None, CoreAddresses(f"tcp://{host}:*", f"tcp://{host}:*"),
                                   check_integrity_when_idle)
        self._info = CoreActorInfo(self.proc.bound.input, self.proc.bound.output, os.getpid(), node_id,
                                   ray.get_runtime_context().get_actor_id(), uuid.uuid4().hex)
        self._ended = threading.Event()
        self._clean = False
        threading.Thread(target=self._run, args=(config, store_error), name="core-steps", daemon=True).start()

    def info(self) -> CoreActorInfo:
        return self._info

    def wait(self, incarnation: str) -> bool:
        """Block until the core's loop ends; True when it stopped cleanly.
        A call meant for an earlier incarnation returns False at once."""
        if incarnation != self._info.incarnation:
            return False
        # Ray titles the process after the method it runs; this one runs for
        # the core's whole life, so the core's own title goes back up here.
        _set_title(self.title)
        self._ended.wait()
        return self._clean

    def _run(self, config, store_error: Exception | None) -> None:
        """Build the core and run its step loop on this one thread (as
        core_proc._run_off_main_thread does, for the same OpenMP reason)."""
        # Lazy: torch, in the actor's process only.
        from kvferry.engine.core import EngineCore
        from kvferry.engine.cpu_threads import bind_step_thread

        try:
            bind_step_thread()
            try:
                if store_error is not None:
                    raise store_error
                self.proc.core = EngineCore(config)
            except Exception as exc:
                logger.exception("engine core failed to start")
                self.proc.send_error(f"the engine core failed to start: {exc}")
                self.proc.close()
                raise
            freeze_startup_heap("engine core")
            self.proc.run()  # until a shutdown message; a failure is reported to the front end first
        except BaseException:
            logging.shutdown()
            os._exit(1)  # a dead core's process ends: Ray starts the actor again
        self._clean = True
        self._ended.set()


def _place_ranks(ranks, node_id: str, host: str) -> None:
    """Where this core's ranks 1..N-1 run (engine/rank_launcher.py): packed,
    they are its children on this node, which its placement group reserved
    for all of them; spread, each is a Ray actor in its own bundle of the
    group (fleet/rank_actors.py), maybe on another node."""
    launcher = None
    if ranks is not None and ranks.placement == "spread":
        from kvferry.fleet.rank_actors import RayRankLauncher  # optional: imports ray

        launcher = RayRankLauncher(ranks.group, ranks.resources, node_id, host)
    rank_launcher.install(launcher, node_id)


def _find_ffn_workers(config, node_id: str) -> None:
    """--mode afd under --ray: the server's FFN workers are Ray actors that
    its board names (fleet/ffn_actors.py); the core's AFDLeader reads it."""
    board = config.parallel.afd.board
    if board is not None:
        from kvferry.fleet.ffn_actors import BoardView  # optional: imports ray

        afd_sites.install(BoardView(board, node_id))


def _set_title(title: str) -> None:
    """The process title ``ps`` shows, set through Ray's own copy of
    setproctitle: Ray titles its workers with it, and the setproctitle
    package beside it in one process does not change what ``ps`` shows."""
    try:
        from ray._raylet import setproctitle as set_title  # optional dependency: ray
    except ImportError:  # a Ray without it: the package, as the local cores use
        set_title = setproctitle.setproctitle
    set_title(title)


def node_address(node_id: str) -> str:
    """The address the Ray node of ``node_id`` is known by in the cluster
    (``ray start --node-ip-address``, else the one Ray picked), as a tcp://
    host: the interface the other nodes reach it on."""
    import ray

    host = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), None)
    host = host or ray.util.get_node_ip_address()
    return f"[{host}]" if ":" in host else host


def on_node(transfer_address: str, host: str) -> str:
    """A KV transfer address on the node's interface: the server's default
    (a loopback port) would be unreachable from a core on another node."""
    for loopback in ("tcp://127.0.0.1:", "tcp://localhost:"):
        if transfer_address.startswith(loopback):
            return f"tcp://{host}:{transfer_address[len(loopback):]}"
    return transfer_address or f"tcp://{host}:0"


def _bind_cpus(cpus: str) -> None:
    """--prefill-cpus and the like, on the node the actor landed on."""
    import torch  # lazy: in the actor's process only

    allowed = parse_cpus(cpus)
    os.sched_setaffinity(0, allowed)
    torch.set_num_threads(len(allowed))
