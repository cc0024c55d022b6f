"""An attention core's side of attention/FFN disaggregation: its FFN workers.

    attention core i ("kvferry: engine-i")          FFN worker j (afd_worker.py)
    ---------------------------------------          ----------------------------
    AFDLeader(config)                                loads every layer's MLP (its split of them), binds
                                                     ipc://FOLDER/ffn-G-j, then writes FOLDER/ffn-G-j.pid
    connect(): waits for the M pid files         ◀── (its readiness; G: the pool's generation,
               of the generation the pool serves      FOLDER/ffn-generation.json, afd_pool.py)
    runner step: per layer and micro-batch
      send_rows(ffn-j, (step, layer, mb), x)     ──▶ takes every waiting request of every core,
      recv_rows(...) from each j, summed         ◀── one MLP call per layer over all of their rows

Whose workers they are:

- ``kvferry serve --mode afd``: the server's (afd_pool.FFNPool), in the
  0700 FOLDER its N attention cores share, so that each FFN call batches
  the rows of every core with a request waiting (attention's cost grows
  with each core's KV; the FFN's weights are read once for all of them).
  The core follows the pool's generations (afd_pool.py): before each step
  it reads the one published, and moves to a newer one (a resize, or the
  workers restarted) between steps, so a step never spans two. A worker
  gone while the core has requests in flight ends the core whole
  (``RankFailed``: they fail; the router restarts it); an idle core
  instead waits at its next step for the next generation, so no request
  that came after the death fails.
- ``kvferry serve --ray --mode afd``: the server's too, as Ray actors
  placed by ``--ray-ffn-resources`` (fleet/ffn_actors.py); the generation
  comes from the server's board actor instead of a folder (the core's actor
  installs its view, afd_sites.py), and a worker on another node is reached
  over tcp:// with CURVE (parallel/rank_sockets.py), one on this node over ipc.
- A core started alone (``kvferry engine-core --ffn M``, ``LLM(ffn=M)``):
  its own, in a private folder, watched as a TP leader watches its ranks
  (rank_group.RankProcesses); they exit once the core's process is gone.
"""
from __future__ import annotations

import logging
import os
import stat
import subprocess
import threading
import time
import weakref

import torch
import zmq

from kvferry import private_dirs
from kvferry.config import EngineConfig
from kvferry.core.outputs import RunnerOutput, SchedulerOutput
from kvferry.engine import afd_sites, rank_launcher
from kvferry.engine.afd_pool import Generation, ffn_threads, pid_file, read_pid, spawn_ffn_workers
from kvferry.engine.rank_group import POLL_S, RankProcesses, core_name, kill_all
from kvferry.engine.tp_ranks import RunnerShape
from kvferry.messages import TPRank
from kvferry.parallel import RankFailed
from kvferry.parallel.afd import recv_rows, send_rows
from kvferry.parallel.rank_sockets import RankKeys
from kvferry.shm_segments import pid_alive

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0  # how long a core waits for the FFN workers to load their weights
_POLL_MS = 200


def check_folder(folder: str) -> None:
    """The shared folder must be this user's and closed to everyone else
    (its sockets take unauthenticated requests)."""
    info = os.stat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ValueError(f"the FFN workers' folder {folder} must be a directory of this user with mode 0700")


class AFDLeader(RankProcesses):
    """This attention core's link to the M FFN workers (module docstring);
    the engine core holds it where a TP or PP core holds its leader."""

    MEMBER, GROUP = "FFN worker", "attention/FFN group"

    def __init__(self, config: EngineConfig, name: str | None = None) -> None:
        afd = config.parallel.afd
        self.size = afd.ffn_workers
        self.name = name or core_name()
        self.threads = ffn_threads(config)
        self._config = config
        self._threads_before = torch.get_num_threads()
        if config.parallel.cpu_threads_per_rank is not None:  # the attention core's too
            torch.set_num_threads(config.parallel.cpu_threads_per_rank)
        self.failure: RankFailed | None = None
        self.owner = afd.folder is None  # a core alone starts its own workers
        self._dir = private_dirs.make("kvferry-afd-") if self.owner else afd.folder
        self._view = self._view_of(afd.board)
        self._procs: list[subprocess.Popen] = []
        self._steps: list[zmq.Socket] = []  # the owner's control sockets (shutdown)
        self._pids: list[int] = []
        self.generation, self._gen = 0, Generation(0, 0, ())
        self._ctx = zmq.Context()
        if self.owner:
            self._spawn(config)
        self.socks: list[zmq.Socket] = []
        self._stopping = threading.Event()
        self._finalizer = weakref.finalize(self, kill_all, list(self._procs), self._dir if self.owner else None,
                                           self._stopping)
        self._watcher: threading.Thread | None = None

    def _view_of(self, board: str | None) -> afd_sites.GenerationView:
        """Where this core learns of its workers: the folder, or the Ray board's view."""
        if board is None:
            check_folder(self._dir)
            return afd_sites.FolderView(self._dir)
        view = afd_sites.installed()
        if view is None:
            raise ValueError(f"the FFN workers of {board} are Ray actors: only a core that kvferry serve --ray "
                             "placed finds them")
        self._dir = None
        return view

    def _spawn(self, config: EngineConfig) -> None:
        self._procs = spawn_ffn_workers(config, self._dir, self.name)
        for j in range(self.size):
            ctl = self._ctx.socket(zmq.PUSH)
            ctl.setsockopt(zmq.LINGER, 0)
            ctl.connect(f"ipc://{self._dir}/ctl-0-{j}")
            self._steps.append(ctl)

    # -- start-up ------------------------------------------------------------------
    def connect(self, shard: object = None) -> None:
        """Wait until every FFN worker has loaded its weights: the owner's
        pid files, or the pool's published generation."""
        if self.owner:
            self._use(Generation(0, self.size, tuple(self._wait_owned())))
        else:
            self._use(self._wait_generation(-1))
        self._watcher = threading.Thread(target=self._watch, name="afd-ffn-watch", daemon=True)
        self._watcher.start()
        logger.info("attention/FFN disaggregation: %d FFN workers (pids %s)%s", self.size,
                    ", ".join(map(str, self._pids)), ", started by this core" if self.owner else "")

    def _wait_owned(self) -> list[int]:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        pids: list[int | None] = [None] * self.size
        while None in pids:
            self._raise_if_dead()
            if time.monotonic() > deadline:
                raise RankFailed(pids.index(None) + 1, f"did not load its weights within {LOAD_TIMEOUT_S:g}s")
            for j in range(self.size):
                pid = read_pid(pid_file(self._dir, j))
                if pids[j] is None and pid is not None and pid == self._procs[j].pid and pid_alive(pid):
                    pids[j] = pid
            time.sleep(POLL_S / 4)
        return [p for p in pids if p is not None]

    def _wait_generation(self, stale: int) -> Generation:
        """The pool's published generation, once it is not ``stale`` and
        its workers are alive (RankFailed once the pool is down, or after
        LOAD_TIMEOUT_S)."""
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            gen = self._view.read()
            if gen is not None and gen.health == "down":
                raise RankFailed(1, "the FFN workers are down (no restart left); the engine core's "
                                    f"{self.GROUP} ends whole")
            if gen is not None and gen.health == "ok" and gen.generation != stale and not self._view.dead(gen):
                return gen
            if time.monotonic() > deadline:
                raise RankFailed(1, f"no FFN workers served within {LOAD_TIMEOUT_S:g}s")
            time.sleep(POLL_S / 4)

    def _use(self, gen: Generation) -> None:
        """Talk to ``gen``'s workers from the next step on (none is in flight)."""
        for sock in self.socks:
            sock.close(linger=0)
        self.generation, self.size, self._pids, self._gen = gen.generation, gen.size, list(gen.pids), gen
        self.threads = ffn_threads(self._config, gen.size)
        self.socks = []
        for j in range(self.size):
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            address, curve = self._view.address(gen, j)
            if curve:  # a worker on another Ray node: tcp://, only with the server's key (rank_sockets.py)
                RankKeys.of_tree().client(sock)
            sock.connect(address)
            self.socks.append(sock)
        self._stash: list[dict[tuple, object]] = [{} for _ in self.socks]

    def _follow(self, continuing: bool) -> None:
        """Before a step: move to the pool's newer generation (a resize), or,
        while this one's workers are gone or being replaced, wait for the
        next one. ``continuing``: the step carries requests that ran before;
        a core with requests in flight when its workers died ends whole, as
        a step cut by the death does (the rule does not hang on whether the
        death fell inside a step or between two); an idle one waits."""
        gen = self._view.read()
        gone = self._view.dead(self._gen)
        if gen is not None and gen.generation == self.generation and gen.health == "ok" and not gone:
            return
        if continuing and gone:
            self._raise_if_dead()
        if gen is None or gen.health != "ok" or gen.generation == self.generation:
            logger.warning("FFN workers of generation %d are gone; waiting for the next", self.generation)
            gen = self._wait_generation(self.generation)
        self._use(gen)
        logger.info("FFN workers: generation %d, %d workers (pids %s)", gen.generation, gen.size,
                    ", ".join(map(str, gen.pids)))

    def start_runners(self, shape: RunnerShape) -> None:
        """The FFN workers hold no KV: nothing to size."""

    def _watch(self) -> None:
        """The owner's: its workers' exits. The pool's workers are followed
        by generation instead (``_follow``); this thread only ends an idle
        core at once when the pool is down (no restart left), so that the
        router and /health see it without a request failing first."""
        if self.owner:
            super()._watch()
            return
        while not self._stopping.wait(POLL_S):
            gen = self._view.read()
            if gen is not None and gen.health == "down":
                self.failure = RankFailed(1, "the FFN workers are down (no restart left); the engine core's "
                                             f"{self.GROUP} ends whole")
                logger.error("%s", self.failure)
                return

    def _raise_if_dead(self) -> None:
        if self.owner:
            super()._raise_if_dead()
            return
        for j in self._view.dead(self._gen)[:1]:
            raise RankFailed(j + 1, f"{self.MEMBER} {j + 1} (pid {self._pids[j]}) is gone; the engine core's "
                                    f"{self.GROUP} ends whole")

    # -- steps -----------------------------------------------------------------------
    def alive(self) -> None:
        """RankFailed once an FFN worker is gone (polled while a reply is awaited)."""
        self.check()
        self._raise_if_dead()

    def send(self, tag: tuple[int, int, int], rows) -> None:  # noqa: ANN001 - torch.Tensor [T, hidden]
        """A micro-batch's normed rows of one layer to every FFN worker."""
        for sock in self.socks:
            send_rows(sock, tag, rows)

    def receive(self, tag: tuple[int, int, int]):  # noqa: ANN201 - torch.Tensor [T, hidden]
        """The layer's MLP output for ``tag``: the workers' partial sums added."""
        out = None
        for j in range(len(self.socks)):
            part = self._answer(j, tag)
            out = part if out is None else out.add_(part)
        return out

    def _answer(self, j: int, tag: tuple[int, int, int]):  # noqa: ANN202 - torch.Tensor
        """Worker j's answer to ``tag``; those that come first wait in its stash
        (the worker answers in its batches' order, recv_rows)."""
        stash = self._stash[j]
        while tag not in stash:
            got, rows = recv_rows(self.socks[j], _POLL_MS, self.alive)
            if len(stash) > 64:  # at most the step's micro-batches are in flight
                raise RuntimeError(f"attention and FFN out of step: waiting for {tag}, got {got}")
            stash[got] = rows
        return stash.pop(tag)

    def publish(self, sched: SchedulerOutput) -> None:
        """ModelRunner's hook before a step: the group must be whole (the
        pool's: its generation now)."""
        self.check()
        if not self.owner:
            self._follow(bool(sched.cached_requests))

    def record(self, out: RunnerOutput) -> None:
        """ModelRunner's hook after a step (nothing to forward: the FFN samples nothing)."""

    def run(self, execute, sched: SchedulerOutput) -> RunnerOutput:  # noqa: ANN001 - ModelRunner.execute
        return execute(sched)

    def ranks(self) -> list[TPRank]:
        """This core (rank 0) and the FFN workers (ranks 1..M): GET /v1/admin/workers."""
        here = rank_launcher.this_node()  # its Ray node under --ray, else ""
        ranks = [TPRank(rank=0, pid=os.getpid(), cpu_threads=torch.get_num_threads(), alive=True, node=here)]
        gen, gone = self._gen, set(self._view.dead(self._gen))
        for j, pid in enumerate(self._pids):
            threads = gen.sites[j].threads if gen.sites else self.threads
            ranks.append(TPRank(rank=j + 1, pid=pid, cpu_threads=threads, alive=j not in gone,
                                node=self._view.node(gen, j) or here))
        return ranks

    def close(self) -> None:
        """Stop the owner's workers (a shutdown message, then SIGTERM, then SIGKILL)."""
        if not self._stop_processes():
            return
        for sock in [*self._steps, *self.socks]:
            sock.close(linger=0)
        self._ctx.term()
        self._finalizer()
        torch.set_num_threads(self._threads_before)
