"""What a leader of rank processes does the same for every kind of group:
the tensor-parallel ranks (tp_ranks.py) and the pipeline stages
(pp_stages.py). Rank 0 (the engine core) starts ranks 1..N-1 as child
processes and sends each step to them; a group lives and dies whole.

    RankProcesses   mixin: send a step to every rank, watch them, stop them
    kill_all        SIGTERM, then SIGKILL after a grace (also the finalizer)
    core_name       the core's name from this process's title
    ranks_of        every rank as GET /v1/admin/workers shows it (with its Ray node, if placed by Ray)
"""
from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import subprocess
import threading
import time

import setproctitle
import zmq

from kvferry import private_dirs
from kvferry.engine import rank_launcher
from kvferry.messages import TPRank
from kvferry.parallel import CollectiveError, RankFailed
from kvferry.parallel.rank_sockets import RankKeys

logger = logging.getLogger(__name__)

POLL_S = 0.2
_SEND_WAIT_S = 0.005  # between tries of a step's send to a rank not connected yet
STOP_GRACE_S = rank_launcher.STOP_GRACE_S


class RankProcesses:
    """The leader's side of ranks 1..N-1. The class using it sets
    ``_procs`` (the children, rank 1 first), ``_steps`` (a PUSH socket to
    each), ``_stopping`` (set once the group is being stopped: an exit from
    then on is no failure) and ``failure``; ``MEMBER`` and ``GROUP`` name
    them in the one-line failure ("pipeline stage 1 ... the engine core's
    stage group ends whole")."""

    MEMBER = "rank"
    GROUP = "rank group"
    _procs: list[subprocess.Popen]
    _steps: list[zmq.Socket]
    _stopping: threading.Event
    failure: RankFailed | None

    def _bind(self, kind: int, name: str) -> zmq.Socket:
        """A socket rank 0 binds (``_ctx``, ``_keys``, ``_dir``,
        ``_launcher`` are the user's): ipc:// in the private folder, or
        tcp:// on this node with CURVE when the ranks may be elsewhere."""
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is None:
            sock.bind(f"ipc://{self._dir}/{name}")
        else:
            self._keys.server(sock).bind(f"tcp://{self._launcher.host}:*")
        return sock

    def check(self) -> None:
        """RankFailed once a rank is gone: the group ends whole."""
        if self.failure is not None:
            raise self.failure

    def _send(self, message: object) -> None:
        """``message`` to every rank. Rank 0 binds the step sockets, and a
        bound PUSH socket with no peer blocks a send: a rank that has not
        connected yet is waited for, one that is gone fails the group
        (RankFailed), and while the group stops a gone rank is skipped."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._steps:
            while True:
                try:
                    sock.send(data, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    if self._stopping.is_set():
                        break
                    self.check()
                    self._raise_if_dead()
                    time.sleep(_SEND_WAIT_S)

    def _raise_if_dead(self) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
                raise RankFailed(rank, f"{self.MEMBER} {rank} (pid {proc.pid}) exited with {how}; "
                                       f"the engine core's {self.GROUP} ends whole")

    def _watch(self) -> None:
        """The watcher thread: the first rank to exit ends the others."""
        while not self._stopping.is_set():
            try:
                self._raise_if_dead()
            except RankFailed as failure:
                if not self._stopping.is_set():
                    logger.error("%s", failure)
                    self.failure = failure
                    kill_all(self._procs, None)
                return
            time.sleep(POLL_S)

    def _stop_processes(self) -> bool:
        """Ask every rank to stop (a shutdown message) and wait up to the
        grace; False if the group was already stopping (close runs once)."""
        if self._stopping.is_set():
            return False
        self._stopping.set()
        try:
            self._send(None)
        except zmq.ZMQError:
            pass
        end = time.monotonic() + STOP_GRACE_S
        for proc in self._procs:
            try:
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return True


def ranks_of(procs: list, threads: int) -> list[TPRank]:
    """Every rank, this one (rank 0) first; ``node``: its Ray node id under
    --ray (a local child is on rank 0's), else "" (rank_launcher.py)."""
    ranks = [TPRank(rank=0, pid=os.getpid(), cpu_threads=threads, alive=True, node=rank_launcher.this_node())]
    for rank, proc in enumerate(procs, start=1):
        ranks.append(TPRank(rank=rank, pid=proc.pid, cpu_threads=threads, alive=proc.poll() is None,
                            node=getattr(proc, "node", None) or ranks[0].node))
    return ranks


def connect_to_leader(ctx: zmq.Context, reports: str, steps: str, remote: bool) -> tuple[zmq.Socket, zmq.Socket]:
    """A rank's two sockets to rank 0, which bound both: its reports (PUSH)
    and its steps (PULL); CURVE clients when ``remote`` (tcp://, rank_sockets.py)."""
    keys = RankKeys.of_tree() if remote else None
    out, into = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for sock, address in ((out, reports), (into, steps)):
        if keys is not None:
            keys.client(sock)
        sock.connect(address)
    out.setsockopt(zmq.LINGER, 2000)
    return out, into


def core_name() -> str:
    title = setproctitle.getproctitle()
    return title.removeprefix("kvferry: ") if title.startswith("kvferry: ") else "engine"


def kill_all(procs: list[subprocess.Popen], folder: str | None, stopping: threading.Event | None = None) -> None:
    """End every process still running (SIGTERM, SIGKILL after the grace)
    and remove the group's folder."""
    if stopping is not None:
        stopping.set()
    rank_launcher.stop_all(procs)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)



# -- a worker's side (tp_worker, pp_worker, afd_worker) ------------------------
def receive_pickled(sock: zmq.Socket, poll_ms: int) -> object:
    """The next message on ``sock``, unpickled (polled, so signals get in)."""
    while not sock.poll(poll_ms):
        pass
    return pickle.loads(sock.recv())


def watch_parent(parent_pid: int, poll_ms: int, folder: str | None = None) -> None:
    """Exit once the process that started this one is gone (its group cannot
    go on). ``folder``: the group's private folder (private_dirs.py), which
    a parent killed outright left: removed first (by every member: the
    first one wins)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_ms / 1000)
        private_dirs.remove(folder)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def run_naming_failed_rank(leader, execute, sched):  # noqa: ANN001, ANN201 - a leader with .failure; the runner's step
    """``execute(sched)`` for a leader of rank processes (TP ranks, pipeline
    stages): a collective that failed because a rank died raises the
    leader's RankFailed naming that rank, once its watcher has seen it."""
    try:
        return execute(sched)
    except CollectiveError as exc:
        deadline = time.monotonic() + 2.0  # let the watcher see which rank is gone
        while leader.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if leader.failure is not None:
            raise leader.failure from exc
        raise
