"""An attention core's side of attention/FFN disaggregation: its FFN workers.

    attention core i ("kvferry: engine-i")          FFN worker j (afd_worker.py), "kvferry: engine-i ffn j"
    ---------------------------------------          -------------------------------------------------------
    AFDLeader(config): the owner (the first core     loads every layer's MLP (its split of them), binds
      to lock FOLDER/owner.lock) spawns M workers    ipc://FOLDER/ffn-j, then writes FOLDER/ffn-j.pid
    connect(): waits for the M pid files         ◀── (its readiness)
    runner step: per layer and micro-batch
      send_rows(ffn-j, (step, layer, mb), x)     ──▶ takes every waiting request of every core,
      recv_rows(...) from each j, summed         ◀── one MLP call per layer over all of their rows

One server's N attention cores share one FOLDER and so the same M workers:
each FFN call batches the rows of every core that has a request waiting,
which is what the split is for (attention's cost grows with each core's
KV, the FFN's weights are read once for all of them). A core started
alone (no folder) makes a private one and owns its workers.

Faults: the owner watches its workers as a TP leader watches its ranks
(rank_group.RankProcesses): one exiting ends the rest and the owner's
step raises ``RankFailed``; the other cores watch the workers' pids and
raise the same. Every core then ends whole, its requests fail, and the
router restarts it; the first core back takes the lock and starts new
workers, the others wait for them. The workers exit once their owner's
process is gone.
"""
from __future__ import annotations

import fcntl
import logging
import os
import pickle
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass

import zmq

from kvferry.config import EngineConfig
from kvferry.core.outputs import RunnerOutput, SchedulerOutput
from kvferry.engine.rank_group import POLL_S, RankProcesses, core_name, kill_all
from kvferry.engine.tp_ranks import RunnerShape
from kvferry.messages import TPRank
from kvferry.parallel import RankFailed
from kvferry.parallel.afd import ffn_address, recv_rows, send_rows

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0  # how long a core waits for the FFN workers to load their weights
_POLL_MS = 200


@dataclass(slots=True)
class FFNSpec:
    """Everything an FFN worker process needs, pickled to its stdin."""

    config: EngineConfig
    index: int  # j of ``size``: its split of every MLP
    size: int
    folder: str
    name: str  # the process is "kvferry: {name} ffn {index}"
    threads: int
    parent_pid: int
    log_level: int


def ffn_threads(config: EngineConfig) -> int:
    par = config.parallel
    if par.cpu_threads_per_rank is not None:
        return par.cpu_threads_per_rank
    return max(1, len(os.sched_getaffinity(0)) // (par.afd.ffn_workers + 1))


def pid_file(folder: str, index: int) -> str:
    return os.path.join(folder, f"ffn-{index}.pid")


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
        self.failure: RankFailed | None = None
        self._private = afd.folder is None
        self._dir = tempfile.mkdtemp(prefix="kvferry-afd-") if self._private else afd.folder
        check_folder(self._dir)
        self._lock = open(os.path.join(self._dir, "owner.lock"), "a+")  # noqa: SIM115 - held for life
        self.owner = _try_lock(self._lock)
        self._procs: list[subprocess.Popen] = []
        self._steps: list[zmq.Socket] = []  # the owner's control sockets (shutdown)
        self._pids: list[int] = []
        self._ctx = zmq.Context()
        if self.owner:
            self._spawn(config)
        self.socks: list[zmq.Socket] = []
        self._stopping = threading.Event()
        self._finalizer = weakref.finalize(self, kill_all, list(self._procs), self._dir if self._private else None,
                                           self._stopping)
        self._watcher: threading.Thread | None = None
        self.steps_run = 0

    def _spawn(self, config: EngineConfig) -> None:
        for j in range(self.size):
            try:
                os.unlink(pid_file(self._dir, j))  # a former owner's worker: not ready
            except FileNotFoundError:
                pass
        for j in range(self.size):
            spec = FFNSpec(config, j, self.size, self._dir, self.name, self.threads, os.getpid(),
                           logging.getLogger().getEffectiveLevel())
            proc = subprocess.Popen([sys.executable, "-m", "kvferry.engine.afd_worker"], stdin=subprocess.PIPE)
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()
            self._procs.append(proc)
            ctl = self._ctx.socket(zmq.PUSH)
            ctl.setsockopt(zmq.LINGER, 0)
            ctl.connect(f"ipc://{self._dir}/ctl-{j}")
            self._steps.append(ctl)

    # -- start-up ------------------------------------------------------------------
    def connect(self, shard: object = None) -> None:
        """Wait until every FFN worker has loaded its weights (its pid file)."""
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        pids: list[int | None] = [None] * self.size
        while None in pids:
            self._raise_if_dead()
            if time.monotonic() > deadline:
                raise RankFailed(pids.index(None) + 1, f"did not load its weights within {LOAD_TIMEOUT_S:g}s")
            for j in range(self.size):
                pid = _read_pid(pid_file(self._dir, j))
                mine = not self.owner or pid == self._procs[j].pid  # the owner: its own workers only
                if pids[j] is None and pid is not None and mine and _alive(pid):
                    pids[j] = pid
            time.sleep(POLL_S / 4)
        self._pids = [p for p in pids if p is not None]
        for j in range(self.size):
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(ffn_address(self._dir, j))
            self.socks.append(sock)
        self._watcher = threading.Thread(target=self._watch, name="afd-ffn-watch", daemon=True)
        self._watcher.start()
        logger.info("attention/FFN disaggregation: %d FFN workers (pids %s)%s", self.size,
                    ", ".join(map(str, self._pids)), ", started by this core" if self.owner else "")

    def start_runners(self, shape: RunnerShape) -> None:
        """The FFN workers hold no KV: nothing to size."""

    def _raise_if_dead(self) -> None:
        if self.owner:
            super()._raise_if_dead()
            return
        for j, pid in enumerate(self._pids, start=1):
            if not _alive(pid):
                raise RankFailed(j, f"{self.MEMBER} {j} (pid {pid}) is gone; the engine core's {self.GROUP} "
                                    "ends whole")

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
        for sock in self.socks:
            part = recv_rows(sock, tag, _POLL_MS, self.alive)
            out = part if out is None else out.add_(part)
        return out

    def publish(self, sched: SchedulerOutput) -> None:
        """ModelRunner's hook before a step: the group must be whole."""
        self.check()

    def record(self, out: RunnerOutput) -> None:
        """ModelRunner's hook after a step (nothing to forward: the FFN samples nothing)."""

    def run(self, execute, sched: SchedulerOutput) -> RunnerOutput:  # noqa: ANN001 - ModelRunner.execute
        return execute(sched)

    def ranks(self) -> list[TPRank]:
        """This core (rank 0) and the FFN workers (ranks 1..M): GET /v1/admin/workers."""
        ranks = [TPRank(rank=0, pid=os.getpid(), cpu_threads=0, alive=True)]
        for j, pid in enumerate(self._pids, start=1):
            ranks.append(TPRank(rank=j, pid=pid, cpu_threads=self.threads, alive=_alive(pid)))
        return ranks

    def close(self) -> None:
        """Stop the owner's workers (a shutdown message, then SIGTERM, then SIGKILL)."""
        if not self._stop_processes():
            return
        for sock in [*self._steps, *self.socks]:
            sock.close(linger=0)
        self._ctx.term()
        self._finalizer()
        self._lock.close()


def _try_lock(lock) -> bool:  # noqa: ANN001 - an open file
    """Whether this process now owns the FFN workers (the lock is the
    kernel's: it is free again the moment its holder's process is gone)."""
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_pid(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip() or 0) or None
    except (FileNotFoundError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
