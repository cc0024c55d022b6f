"""Rank 0's side of a tensor-parallel engine core: its worker ranks.

    EngineCore (rank 0)                          worker rank r (tp_worker.py), "kvferry: engine-0 rank r"
    -------------------                          ---------------------------------------------------------
    TPLeader(config)  spawns ranks 1..N-1  ───▶  loads its shard of the weights
    load_model(shard 0)                    ◀───  "loaded" (reports socket)
    connect(): ProcessGroup(0, N)          ◀──▶  ProcessGroup(r, N)   (gloo over loopback)
    start_runners(blocks, max_len, dtype)  ───▶  ModelRunner over its KV heads, same block count
    runner.execute(sched)                  ───▶  (sched, rank 0's sampled tokens of the step before)
       schedule, forward, all-reduce,      ◀──▶  the same forward, its collectives in the same order;
       all-gather logits, sample                 no sampling: it appends rank 0's tokens next step

The scheduler stays single: rank 0 schedules and samples, and each step's
``SchedulerOutput`` (the runner's whole input, plain data) goes to every
worker, pickled, over one ZeroMQ PUSH socket per worker that rank 0 binds
(ipc:// in its private folder; tcp:// with CURVE, and the sums over
parallel/tcp_group.py, when a launcher placed the ranks on other nodes:
rank_launcher.py). A worker
waiting for a step waits on its socket, so an idle core has no collective
in flight and no timeout to meet.

A group lives and dies whole: a watcher thread polls the workers; once one
exits, the rest are killed, and rank 0's next step (or the one in flight,
whose collective fails when the peer's sockets close) raises ``RankFailed``
naming it. Workers exit when rank 0's process is gone. Workers are started
with ``subprocess`` (``python -m kvferry.engine.tp_worker``), not
multiprocessing: the served engine core is itself a daemonic process, which
multiprocessing forbids to have children; a fresh interpreter is what the
spawn method gives anyway.
"""
from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import zmq

from kvferry import private_dirs
from kvferry.config import EngineConfig, ParallelConfig
from kvferry.core.outputs import RunnerOutput, SchedulerOutput
from kvferry.engine.cpu_threads import default_cpus, pinning_requested, process_cpus
from kvferry.engine import rank_launcher
from kvferry.engine.rank_group import POLL_S, RankProcesses, core_name, kill_all, ranks_of, run_naming_failed_rank
from kvferry.messages import TPRank
from kvferry.model import layer_op
from kvferry.model.layers.parallel import TPShard
from kvferry.parallel import GroupAddress, ProcessGroup, RankFailed, ShmAllReduce
from kvferry.parallel.rank_sockets import RankKeys
from kvferry.parallel.tcp_group import TcpGroup

logger = logging.getLogger(__name__)

# Bounds every collective of a step; a dead peer fails it at once (its
# sockets close), this only catches a hung one.
COLLECTIVE_TIMEOUT_S = 120.0
# How long rank 0 waits for the workers to load their shards.
LOAD_TIMEOUT_S = 600.0


@dataclass(slots=True)
class WorkerSpec:
    """Everything a worker rank needs, pickled to its stdin."""

    config: EngineConfig
    rank: int
    world_size: int
    group: GroupAddress
    steps: str  # the address the worker binds for its step messages
    reports: str  # rank 0's address for "loaded" / errors
    name: str  # the core's name: the process is "kvferry: {name} rank {rank}"
    threads: int
    cpus: list[int] | None  # pinned to these (KVFERRY_CPU_BIND), else None
    parent_pid: int
    log_level: int  # rank 0's
    remote: bool = False  # tcp:// sockets with CURVE (rank_sockets.py), the sums over TcpGroup


@dataclass(slots=True)
class RunnerShape:
    """Rank 0's resolved pool, so that every rank's block ids mean the same blocks."""

    num_kv_blocks: int
    max_model_len: int
    kv_cache_dtype: torch.dtype
    kv_pool: str = ""  # pipeline stages with a KV transfer: stage 0's pool segment (stage_transfer.py)


def join_group(rank: int, address: GroupAddress | str, parallel: ParallelConfig) -> ProcessGroup | ShmAllReduce | TcpGroup:
    """This rank's membership, its sums through shared memory unless gloo is
    asked for; over TcpGroup when the ranks may be on other nodes (``address``
    is then rank 0's tcp:// hub)."""
    if isinstance(address, str):
        return TcpGroup.member(rank, parallel.tensor_parallel_size, address, COLLECTIVE_TIMEOUT_S)
    group = ProcessGroup(rank, parallel.tensor_parallel_size, address, COLLECTIVE_TIMEOUT_S)
    if parallel.tp_all_reduce != "shm":
        return group
    shm = ShmAllReduce(group)
    # Its sums in C++ where the decoder layer's library loads (every rank
    # alike: the same build, the same switches), the layers in one call.
    if (native := layer_op.shm_sums(shm)) is not None:
        shm.attach(native)
    return shm


def threads_per_rank(parallel: ParallelConfig) -> int:
    if parallel.cpu_threads_per_rank is not None:
        return parallel.cpu_threads_per_rank
    return max(1, len(process_cpus()) // parallel.tensor_parallel_size)


class TPLeader(RankProcesses):
    """Spawns and drives the worker ranks of one tensor-parallel core."""

    MEMBER, GROUP = "tensor-parallel rank", "rank group"

    def __init__(self, config: EngineConfig, name: str | None = None) -> None:
        """``name``: the core's (default: from this process's title, "kvferry: engine-1" -> "engine-1")."""
        name = name or core_name()
        self._parallel = par = config.parallel
        self.world_size = n = par.tensor_parallel_size
        self.threads = threads_per_rank(par)
        # This rank's team: the calling thread is the one that steps (an
        # offline LLM's caller gets its own count back at close).
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        self.failure: RankFailed | None = None
        self._last_sampled: dict[str, list[int]] = {}
        # Hidden states a P/D decode core received for its draft head, for the
        # workers' heads (they draft in step with rank 0's), sent with the next step.
        self._received_hidden: dict[str, torch.Tensor] = {}
        # Method auto with a head: the requests whose slots the head fills this
        # step (rank 0's scheduler chose them; None: every reserved slot is the head's).
        self._head_requests: set[str] | None = None
        self._dir = private_dirs.make("kvferry-tp-")  # 0700; our ranks remove it if we are killed
        self._ctx = zmq.Context()
        # Ranks placed elsewhere (--ray-rank-placement spread) may be on other
        # nodes: tcp:// with CURVE, and the sums over TcpGroup (rank_launcher.py).
        self._launcher = launcher = rank_launcher.current()
        self._keys = RankKeys.of_tree() if launcher is not None else None
        self._guard = self._keys.guard(self._ctx) if self._keys is not None else None
        self._reports = self._bind(zmq.PULL, "reports")
        reports = self._reports.getsockopt_string(zmq.LAST_ENDPOINT)
        self._hub: TcpGroup | None = None
        if launcher is not None:
            sites = launcher.place(n - 1)
            self._hub = TcpGroup.hub(n, launcher.host, COLLECTIVE_TIMEOUT_S, self.check)
            self._address: GroupAddress | str = self._hub.address
            cpus = None  # the ranks' CPUs are their nodes': nothing to split here
        else:
            sites = [None] * (n - 1)
            self._address = GroupAddress.in_folder(self._dir)  # private: only our ranks find each other
            cpus = self._rank_cpus(n)
        self._procs: list = []
        self._steps: list[zmq.Socket] = []
        for rank, site in zip(range(1, n), sites):
            sock = self._bind(zmq.PUSH, f"steps-{rank}")  # queues until the worker connects
            self._steps.append(sock)
            spec = WorkerSpec(config, rank, n, self._address, sock.getsockopt_string(zmq.LAST_ENDPOINT), reports,
                              name, self.threads, cpus[rank] if cpus else None,
                              site.parent_pid if site else os.getpid(), logging.getLogger().getEffectiveLevel(),
                              remote=launcher is not None)
            self._procs.append(launcher.spawn(rank, "kvferry.engine.tp_worker", spec) if launcher is not None
                               else rank_launcher.local("kvferry.engine.tp_worker", spec))
        # Workers never outlive this object (an offline LLM dropped without close()).
        self._stopping = threading.Event()  # ours: a worker's exit from now on is no failure
        self._finalizer = weakref.finalize(self, kill_all, list(self._procs), self._dir, self._stopping)
        self._watcher: threading.Thread | None = None
        self._group: ProcessGroup | ShmAllReduce | None = None

    def _rank_cpus(self, n: int) -> list[list[int]] | None:
        """Each rank's own CPUs when pinning is asked for (KVFERRY_CPU_BIND), so ranks never share one."""
        if not pinning_requested():
            return None
        allowed, _ = default_cpus(len(process_cpus()))
        k = self.threads
        if len(allowed) < n * k:
            logger.info("CPU binding: %d CPUs for %d ranks of %d threads; ranks left unpinned", len(allowed), n, k)
            return None
        return [allowed[r * k:(r + 1) * k] for r in range(n)]

    # -- start-up --------------------------------------------------------------------
    def connect(self, shard: TPShard) -> None:
        """Wait for every worker's shard, then form the group (rank 0's
        shard talks through it from now on)."""
        pending = set(range(1, self.world_size))
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while pending:
            self._raise_if_dead()
            if time.monotonic() > deadline:
                raise RankFailed(min(pending), f"did not load its shard within {LOAD_TIMEOUT_S:g}s")
            if not self._reports.poll(int(POLL_S * 1000)):
                continue
            kind, rank, detail = pickle.loads(self._reports.recv())
            if kind != "loaded":
                raise RankFailed(rank, f"failed to start: {detail}")
            pending.discard(rank)
        shard.group = self._group = self._hub or join_group(0, self._address, self._parallel)
        self._watcher = threading.Thread(target=self._watch, name="tp-ranks-watch", daemon=True)
        self._watcher.start()
        logger.info("tensor parallelism: %d ranks of %d threads each (workers: pids %s)", self.world_size,
                    self.threads, ", ".join(str(p.pid) for p in self._procs))

    def ranks(self) -> list[TPRank]:
        """Every rank, this one first: what GET /v1/admin/workers shows.
        Read by the core's input thread at each heartbeat (``poll`` only
        reads the exit status the watcher may have reaped already)."""
        return ranks_of(self._procs, self.threads)

    def start_runners(self, shape: RunnerShape) -> None:
        self._send(shape)

    # -- steps -----------------------------------------------------------------------
    def publish(self, sched: SchedulerOutput) -> None:
        """The step to every worker, with rank 0's samples of the step before
        (and the draft head's received hidden states, and auto's head requests)."""
        self.check()
        self._send((sched, self._last_sampled, self._received_hidden, self._head_requests))
        self._last_sampled, self._received_hidden = {}, {}

    def share_head_requests(self, request_ids: set[str]) -> None:
        self._head_requests = set(request_ids)

    def share_hidden(self, request_id: str, hidden: torch.Tensor) -> None:
        self._received_hidden[request_id] = hidden.cpu()

    def record(self, out: RunnerOutput) -> None:
        self._last_sampled = out.sampled_token_ids

    def run(self, execute, sched: SchedulerOutput) -> RunnerOutput:  # noqa: ANN001 - ModelRunner.execute
        """``execute(sched)``; a collective that failed because a rank died raises RankFailed naming it."""
        return run_naming_failed_rank(self, execute, sched)

    def close(self) -> None:
        """Stop the workers (a shutdown message, then SIGTERM, then SIGKILL)."""
        if not self._stop_processes():
            return
        if isinstance(self._group, (ShmAllReduce, TcpGroup)):
            self._group.close()
        elif self._hub is not None:
            self._hub.close()
        for sock in self._steps:
            sock.close(linger=0)
        self._reports.close(linger=0)
        if self._guard is not None:
            self._guard.stop()
        self._ctx.term()
        if self._launcher is not None:
            self._launcher.close()  # the ranks' places (Ray actors): the group's bundles are free again
        self._finalizer()
        torch.set_num_threads(self._threads_before)

