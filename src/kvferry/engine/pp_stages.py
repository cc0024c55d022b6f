"""Rank 0's side of a pipeline-parallel engine core: its stage processes.

    EngineCore (rank 0 = stage 0)                 stage s (pp_worker.py), "kvferry: engine-0 rank s"
    -----------------------------                 ---------------------------------------------------
    PPLeader(config)  spawns stages 1..N-1  ───▶  loads layers [start_s, end_s) (+ norm, lm_head if last)
    load_model(stage 0): embed + its layers ◀───  "loaded" (reports socket)
    start_runners(blocks, max_len, dtype)   ───▶  StageRunner over its layers' KV, the same block count
    runner.execute(sched)                   ───▶  (sched, the tokens sampled in the step before)
       micro-batches: layers ─▶ h ──────────────▶ stage 1: h ─▶ layers ─▶ h ─▶ ... last: layers, sample
       receive_output()                     ◀───  the last stage's RunnerOutput

Sockets are ZeroMQ over ipc:// in one private folder: rank 0 PUSHes each
step to every stage; stage s binds "acts-s" for the residual stream from
s - 1; the last stage PUSHes its output to rank 0's "reports" (which also
takes "loaded" and errors). No collective: a stage waits on its socket
alone, in slices, checking between them that the group is whole.

A group lives and dies whole, as with tensor parallelism: a watcher thread
polls the stages; once one exits the rest are killed and rank 0's step in
flight (or its next, or ``check`` when idle) raises ``RankFailed`` naming
it. Stages exit when rank 0's process is gone.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

import torch
import zmq

from kvferry.config import EngineConfig
from kvferry.core.outputs import RunnerOutput, SchedulerOutput
from kvferry.engine.cpu_threads import default_cpus, pinning_requested
from kvferry.engine.rank_group import POLL_S, RankProcesses, core_name, kill_all
from kvferry.engine.pp_runner import StageLink
from kvferry.engine.tp_ranks import RunnerShape
from kvferry.messages import TPRank
from kvferry.parallel import RankFailed
from kvferry.parallel.pipeline import PPStage

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0  # how long rank 0 waits for the stages to load their layers


@dataclass(slots=True)
class StageSpec:
    """Everything a stage process needs, pickled to its stdin."""

    config: EngineConfig
    stage: PPStage
    folder: str  # the group's ipc folder: steps-s, acts-s, reports
    name: str  # the core's: the process is "kvferry: {name} rank {s}"
    threads: int
    cpus: list[int] | None  # pinned to these (KVFERRY_CPU_BIND), else None
    parent_pid: int
    log_level: int


def stage_threads(config: EngineConfig) -> int:
    par = config.parallel
    if par.cpu_threads_per_rank is not None:
        return par.cpu_threads_per_rank
    return max(1, len(os.sched_getaffinity(0)) // par.pipeline_parallel_size)


def stage_of(config: EngineConfig, num_layers: int, rank: int) -> PPStage:
    return PPStage.of(num_layers, rank, config.parallel.pipeline_parallel_size)


class PPLeader(RankProcesses):
    """Spawns and drives the stages 1..N-1 of one pipeline-parallel core (this process is stage 0)."""

    MEMBER, GROUP = "pipeline stage", "stage group"

    def __init__(self, config: EngineConfig, num_layers: int, name: str | None = None) -> None:
        self.world_size = n = config.parallel.pipeline_parallel_size
        self.stage = stage_of(config, num_layers, 0)  # a model too shallow fails here, before any stage starts
        self.name = name or core_name()
        self.threads = stage_threads(config)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        self.failure: RankFailed | None = None
        self._last_sampled: dict[str, list[int]] = {}
        # Recent steps' micro-batch times on the first and the last stage:
        # (step, [(k, start, end)] of stage 0, the same of the last stage);
        # tests and bench/pp_decode.py see the overlap in them.
        self.timelines: deque[tuple[int, list, list]] = deque(maxlen=64)
        self._dir = tempfile.mkdtemp(prefix="kvferry-pp-")
        self._ctx = zmq.Context()
        self._reports = self._ctx.socket(zmq.PULL)
        self._reports.bind(f"ipc://{self._dir}/reports")
        cpus = self._stage_cpus(n)
        self._procs: list[subprocess.Popen] = []
        self._steps: list[zmq.Socket] = []
        for rank in range(1, n):
            spec = StageSpec(config, stage_of(config, num_layers, rank), self._dir, self.name, self.threads,
                             cpus[rank] if cpus else None, os.getpid(), logging.getLogger().getEffectiveLevel())
            proc = subprocess.Popen([sys.executable, "-m", "kvferry.engine.pp_worker"], stdin=subprocess.PIPE)
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()
            self._procs.append(proc)
            self._steps.append(self._push(f"ipc://{self._dir}/steps-{rank}"))
        # Stage 0's activations go to stage 1 (queued until it binds).
        self.link = StageLink(prev=None, next=self._push(f"ipc://{self._dir}/acts-1"), alive=self.check)
        self._stopping = threading.Event()  # ours: a stage's exit from now on is no failure
        self._finalizer = weakref.finalize(self, kill_all, list(self._procs), self._dir, self._stopping)
        self._watcher: threading.Thread | None = None

    def _push(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    def _stage_cpus(self, n: int) -> list[list[int]] | None:
        """Each stage's own CPUs when pinning is asked for (KVFERRY_CPU_BIND)."""
        if not pinning_requested():
            return None
        allowed, _ = default_cpus(len(os.sched_getaffinity(0)))
        k = self.threads
        if len(allowed) < n * k:
            logger.info("CPU binding: %d CPUs for %d stages of %d threads; stages left unpinned", len(allowed), n, k)
            return None
        return [allowed[r * k:(r + 1) * k] for r in range(n)]

    # -- start-up ------------------------------------------------------------------
    def connect(self, shard: object = None) -> None:
        """Wait until every stage has loaded its layers (``shard``: unused, TPLeader's signature)."""
        pending = set(range(1, self.world_size))
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while pending:
            self._raise_if_dead()
            if time.monotonic() > deadline:
                raise RankFailed(min(pending), f"did not load its layers within {LOAD_TIMEOUT_S:g}s")
            if not self._reports.poll(int(POLL_S * 1000)):
                continue
            kind, rank, detail = pickle.loads(self._reports.recv())
            if kind != "loaded":
                raise RankFailed(rank, f"failed to start: {detail}")
            pending.discard(rank)
        self._watcher = threading.Thread(target=self._watch, name="pp-stages-watch", daemon=True)
        self._watcher.start()
        logger.info("pipeline parallelism: %d stages of %d threads each (stages 1..: pids %s)", self.world_size,
                    self.threads, ", ".join(str(p.pid) for p in self._procs))

    def start_runners(self, shape: RunnerShape) -> None:
        self._send(shape)

    def ranks(self) -> list[TPRank]:
        """Every stage, this one first: what GET /v1/admin/workers shows."""
        ranks = [TPRank(rank=0, pid=os.getpid(), cpu_threads=self.threads, alive=True)]
        for rank, proc in enumerate(self._procs, start=1):
            ranks.append(TPRank(rank=rank, pid=proc.pid, cpu_threads=self.threads, alive=proc.poll() is None))
        return ranks

    # -- steps ---------------------------------------------------------------------
    def publish(self, sched: SchedulerOutput) -> None:
        """The step to every stage, with the tokens sampled in the step before."""
        self.check()
        self._send((sched, self._last_sampled))
        self._last_sampled = {}

    def receive_output(self, step: int, timeline: list[tuple[int, float, float]]) -> RunnerOutput:
        """The last stage's result of step ``step`` (``timeline``: stage 0's micro-batches of it)."""
        while True:
            self.check()
            if not self._reports.poll(int(POLL_S * 1000)):
                continue
            kind, rank, detail = pickle.loads(self._reports.recv())
            if kind == "error":
                raise RankFailed(rank, detail)
            if kind != "output" or detail[0] != step:
                raise RuntimeError(f"pipeline stages out of step: rank 0 waits for step {step}, got {kind}")
            out: RunnerOutput = detail[1]
            self.timelines.append((step, timeline, detail[2]))
            self._last_sampled = out.sampled_token_ids
            return out

    def record(self, out: RunnerOutput) -> None:
        """ModelRunner's hook (unused: StageRunner records on receipt)."""

    def run(self, execute, sched: SchedulerOutput) -> RunnerOutput:  # noqa: ANN001 - StageRunner.execute
        return execute(sched)

    def close(self) -> None:
        """Stop the stages (a shutdown message, then SIGTERM, then SIGKILL)."""
        if not self._stop_processes():
            return
        for sock in [*self._steps, self.link.next]:
            sock.close(linger=0)
        self._reports.close(linger=0)
        self._ctx.term()
        self._finalizer()
        torch.set_num_threads(self._threads_before)

