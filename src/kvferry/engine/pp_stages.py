"""Rank 0's side of a pipeline-parallel engine core: its stage processes.

    EngineCore (rank 0 = stage 0)                 stage s (pp_worker.py), "kvferry: engine-0 rank s"
    -----------------------------                 ---------------------------------------------------
    PPLeader(config)  spawns stages 1..N-1  ───▶  loads layers [start_s, end_s) (+ norm, lm_head if last)
    load_model(stage 0): embed + its layers ◀───  "loaded" (reports socket)
    start_runners(blocks, max_len, dtype)   ───▶  StageRunner over its layers' KV, the same block count
    runner.execute(sched)                   ───▶  (sched, the tokens sampled in the step before)
       micro-batches: layers ─▶ h ──────────────▶ stage 1: h ─▶ layers ─▶ h ─▶ ... last: layers, sample
       receive_output()                     ◀───  the last stage's RunnerOutput

Sockets are ZeroMQ over ipc:// in one private folder (tcp:// with CURVE
when a launcher placed the stages on other nodes: rank_launcher.py): rank 0
binds a PUSH socket per stage for its steps; stage s binds "acts-s" for the
residual stream from s - 1 (on its node, at a port its launcher found free); the last stage PUSHes its output to rank 0's "reports" (which also
takes "loaded" and errors). No collective: a stage waits on its socket
alone, in slices, checking between them that the group is whole.

A group lives and dies whole, as with tensor parallelism: a watcher thread
polls the stages; once one exits the rest are killed and rank 0's step in
flight (or its next, or ``check`` when idle) raises ``RankFailed`` naming
it. Stages exit when rank 0's process is gone.

With ``-tp T`` as well, each stage is T processes, a tensor-parallel group
of its own (its sums over shared memory, in a store folder of the stage's):
rank r of the core is stage r // T, TP rank r % T. Every process gets every
step from rank 0 and runs the stage's micro-batches in the same order, so
the stage's collectives match; TP rank t sends its residual stream (the
same on every rank of a stage, after the all-reduce) to TP rank t of the
next stage, so no stage gathers or scatters. TP rank 0 of the last stage
samples and sends the output to rank 0; its peers take the tokens with the
next step, as TP workers do.
"""
from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, replace

import torch
import zmq

from kvferry import private_dirs
from kvferry.config import EngineConfig
from kvferry.core.outputs import RunnerOutput, SchedulerOutput
from kvferry.engine.cpu_threads import default_cpus, pinning_requested, process_cpus
from kvferry.engine import rank_launcher
from kvferry.engine.rank_group import POLL_S, RankProcesses, core_name, kill_all, ranks_of, run_naming_failed_rank
from kvferry.engine.pp_runner import StageLink
from kvferry.engine.tp_ranks import RunnerShape, join_group
from kvferry.messages import TPRank
from kvferry.parallel import GroupAddress, RankFailed, ShmAllReduce
from kvferry.parallel.pipeline import PPStage
from kvferry.parallel.rank_sockets import RankKeys
from kvferry.spec import runs_head

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0  # how long rank 0 waits for the stages to load their layers


@dataclass(slots=True)
class StageSpec:
    """Everything a stage process needs, pickled to its stdin."""

    config: EngineConfig
    stage: PPStage
    reports: str  # rank 0's address for "loaded", errors, the last stage's outputs (it binds it)
    steps: str  # ... and for this stage's steps (rank 0 binds it)
    acts_in: str | None  # where this stage binds for the residual stream from the stage before (None: stage 0)
    acts_out: str | None  # the next stage's acts_in (None: the last stage)
    name: str  # the core's: the process is "kvferry: {name} rank {s}"
    threads: int
    cpus: list[int] | None  # pinned to these (KVFERRY_CPU_BIND), else None
    parent_pid: int
    log_level: int
    remote: bool = False  # tcp:// sockets with CURVE (rank_sockets.py): stages on other nodes
    tp_rank: int = 0  # with -tp T: this process's rank in its stage's tensor-parallel group
    group: GroupAddress | None = None  # ... and that group's store (None: -tp 1)

    @property
    def rank(self) -> int:
        """The core's rank of this process: stage x T + TP rank (its title's, its reports')."""
        return self.stage.rank * self.config.parallel.tensor_parallel_size + self.tp_rank


def stage_threads(config: EngineConfig) -> int:
    par = config.parallel
    if par.cpu_threads_per_rank is not None:
        return par.cpu_threads_per_rank
    return max(1, len(os.sched_getaffinity(0)) // (par.pipeline_parallel_size * par.tensor_parallel_size))


def stage_of(config: EngineConfig, num_layers: int, rank: int) -> PPStage:
    """Stage ``rank``'s layers; the last stage also holds the embedding where
    a draft head drafts there (pp_runner.py: drafts ahead)."""
    stage = PPStage.of(num_layers, rank, config.parallel.pipeline_parallel_size)
    return replace(stage, head_embeds=stage.last and runs_head(config.speculative))


class PPLeader(RankProcesses):
    """Spawns and drives ranks 1.. of one pipeline-parallel core (this process
    is stage 0, TP rank 0): stages 1..N-1, or with -tp T every stage's T ranks."""

    MEMBER, GROUP = "pipeline stage", "stage group"

    def __init__(self, config: EngineConfig, num_layers: int, name: str | None = None) -> None:
        par = config.parallel
        n, tp = par.pipeline_parallel_size, par.tensor_parallel_size
        self.tp_size = tp
        self.world_size = world = n * tp  # rank r: stage r // tp, TP rank r % tp
        if tp > 1:  # a failure names the core's rank, which is no stage number
            self.MEMBER, self.GROUP = "TP x PP rank", "rank group"
        # Stages placed elsewhere (--ray-rank-placement spread) may be on other
        # nodes: tcp:// with CURVE (rank_launcher.py, parallel/rank_sockets.py).
        self._launcher = launcher = rank_launcher.current()
        if launcher is not None and tp > 1:  # each stage's sums would need a tcp hub of its own
            raise ValueError(f"tensor_parallel_size {tp} with pipeline_parallel_size {n} does not work with "
                             "--ray-rank-placement spread yet (pack places the core's ranks on one node)")
        self.stage = stage_of(config, num_layers, 0)  # a model too shallow fails here, before any stage starts
        self.name = name or core_name()
        self.threads = stage_threads(config)
        self._parallel = par
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        self.failure: RankFailed | None = None
        self._last_sampled: dict[str, list[int]] = {}
        # The last stage's draft head's hidden state of each prompt transfer that
        # ended in the step just received (pp_runner.py: StageRunner._hidden_to_ship).
        self.transfer_hidden: dict[str, torch.Tensor] = {}
        # Recent steps' micro-batch times on the first and the last stage:
        # (step, [(k, start, end)] of stage 0, the same of the last stage);
        # tests and bench/pp_decode.py see the overlap in them.
        self.timelines: deque[tuple[int, list, list]] = deque(maxlen=64)
        self._dir = private_dirs.make("kvferry-pp-")  # 0700; our stages remove it if we are killed
        self._ctx = zmq.Context()
        self._keys = RankKeys.of_tree() if launcher is not None else None
        self._guard = self._keys.guard(self._ctx) if self._keys is not None else None
        self._reports = self._bind(zmq.PULL, "reports")
        if launcher is not None:
            sites = launcher.place(world - 1)
            acts = {r: f"tcp://{site.host}:{site.port}" for r, site in enumerate(sites, start=1)}
            cpus = None
        else:
            sites = [None] * (world - 1)
            acts = {r: f"ipc://{self._dir}/acts-{r}" for r in range(tp, world)}  # rank r binds acts[r]
            cpus = self._stage_cpus(world)
        # Each stage's TP group meets in a store folder of its own (private, as the core's).
        self._groups = [self._group_address(s) for s in range(n)] if tp > 1 else [None] * n
        self._procs: list = []
        self._steps: list[zmq.Socket] = []
        for rank, site in zip(range(1, world), sites):
            s, t = divmod(rank, tp)
            sock = self._bind(zmq.PUSH, f"steps-{rank}")
            self._steps.append(sock)
            spec = StageSpec(config, stage_of(config, num_layers, s), _endpoint(self._reports), _endpoint(sock),
                             acts.get(rank), acts[rank + tp] if s < n - 1 else None, self.name, self.threads,
                             cpus[rank] if cpus else None, site.parent_pid if site else os.getpid(),
                             logging.getLogger().getEffectiveLevel(), remote=launcher is not None,
                             tp_rank=t, group=self._groups[s])
            self._procs.append(launcher.spawn(rank, "kvferry.engine.pp_worker", spec) if launcher is not None
                               else rank_launcher.local("kvferry.engine.pp_worker", spec))
        # Stage 0's activations go to stage 1 (queued until it binds).
        self.link = StageLink(prev=None, next=self._push(acts[tp]), alive=self.check)
        self._stopping = threading.Event()  # ours: a stage's exit from now on is no failure
        self._finalizer = weakref.finalize(self, kill_all, list(self._procs), self._dir, self._stopping)
        self._watcher: threading.Thread | None = None
        self._group = None  # stage 0's TP group (connect)

    def _group_address(self, stage: int) -> GroupAddress:
        folder = os.path.join(self._dir, f"stage-{stage}")
        os.mkdir(folder, 0o700)
        return GroupAddress.in_folder(folder)

    def _push(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            self._keys.client(sock)
        sock.connect(address)
        return sock

    def _stage_cpus(self, n: int) -> list[list[int]] | None:
        """Each stage's own CPUs when pinning is asked for (KVFERRY_CPU_BIND)."""
        if not pinning_requested():
            return None
        allowed, _ = default_cpus(len(process_cpus()))
        k = self.threads
        if len(allowed) < n * k:
            logger.info("CPU binding: %d CPUs for %d stages of %d threads; stages left unpinned", len(allowed), n, k)
            return None
        return [allowed[r * k:(r + 1) * k] for r in range(n)]

    # -- start-up ------------------------------------------------------------------
    def connect(self, shard: object = None) -> None:
        """Wait until every stage has loaded its layers, then (-tp T) join
        stage 0's TP group: ``shard``, this rank's, sums through it."""
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
        if self.tp_size > 1:
            shard.group = self._group = join_group(0, self._groups[0], self._parallel)
        self._watcher = threading.Thread(target=self._watch, name="pp-stages-watch", daemon=True)
        self._watcher.start()
        logger.info("pipeline parallelism: %d stages of %d rank(s) of %d threads each (ranks 1..: pids %s)",
                    self.world_size // self.tp_size, self.tp_size, self.threads,
                    ", ".join(str(p.pid) for p in self._procs))

    def start_runners(self, shape: RunnerShape) -> None:
        self._send(shape)

    def ranks(self) -> list[TPRank]:
        """Every stage, this one first: what GET /v1/admin/workers shows."""
        return ranks_of(self._procs, self.threads)

    # -- steps ---------------------------------------------------------------------
    def publish(self, sched: SchedulerOutput, head_requests: set[str] | None = None,
                draft_kv_received: set[str] | None = None) -> None:
        """The step to every stage, with the tokens sampled in the step before
        and, under method auto with a draft head, the requests whose draft
        slots are the head's this step (the last stage verifies those against
        its drafts' distributions; the others are the scheduler's drafts);
        with a draft model, the requests whose prompt's draft KV was received
        since (the last stage's draft starts past their prompts)."""
        self.check()
        self._send((sched, self._last_sampled, None if head_requests is None else set(head_requests),
                    set(draft_kv_received or ())))
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
            self.transfer_hidden = detail[3]  # a prefill core's draft head: for the Done stage 0 sends
            self._last_sampled = out.sampled_token_ids
            return out

    def record(self, out: RunnerOutput) -> None:
        """ModelRunner's hook (unused: StageRunner records on receipt)."""

    def run(self, execute, sched: SchedulerOutput) -> RunnerOutput:  # noqa: ANN001 - StageRunner.execute
        """``execute(sched)``; a TP sum that failed because a rank died raises RankFailed naming it."""
        return run_naming_failed_rank(self, execute, sched)

    def close(self) -> None:
        """Stop the stages (a shutdown message, then SIGTERM, then SIGKILL)."""
        if not self._stop_processes():
            return
        if isinstance(self._group, ShmAllReduce):
            self._group.close()
        for sock in [*self._steps, self.link.next]:
            sock.close(linger=0)
        self._reports.close(linger=0)
        if self._guard is not None:
            self._guard.stop()
        self._ctx.term()
        if self._launcher is not None:
            self._launcher.close()  # the ranks' places (Ray actors): the group's bundles are free again
        self._finalizer()
        torch.set_num_threads(self._threads_before)



def _endpoint(sock: zmq.Socket) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
