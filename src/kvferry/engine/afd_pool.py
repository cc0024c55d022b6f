"""The FFN workers of attention/FFN disaggregation as processes: how they
start, and the pool ``kvferry serve --mode afd`` keeps (no torch here: the
server's process imports it before any core starts).

    spawn_ffn_workers(config, folder, name)   M processes "kvferry: NAME ffn j" (afd_worker.py), each
                                              writing FOLDER/ffn-j.pid once it serves
    FFNPool(config, ...)                      the server's M workers, shared by its N attention cores:
                                              one exits, the rest are stopped and all M started again
                                              after a backoff, within the cores' restart budget

    start ─► ok ──a worker exits──► stop the others ─► restarting ──started──► ok
                                                           └─ budget spent ─► down (the cores cannot start)

The attention cores see the old workers' pids gone, end whole (their
requests fail, as a TP core's do when a rank dies) and are restarted by
the router; they wait for the new workers' pid files (afd_leader.py).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from kvferry.config import EngineConfig

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
_POLL_S = 0.2
_BACKOFF_S, _BACKOFF_MAX_S = 0.5, 30.0


@dataclass(slots=True)
class FFNSpec:
    """Everything an FFN worker process needs, pickled to its stdin."""

    config: EngineConfig
    index: int  # j of ``size``: its split of every MLP
    size: int
    folder: str
    name: str  # the process is "kvferry: {name} ffn {index}"
    threads: int
    parent_pid: int  # it exits once this process is gone
    log_level: int


def ffn_threads(config: EngineConfig) -> int:
    par = config.parallel
    if par.cpu_threads_per_rank is not None:
        return par.cpu_threads_per_rank
    return max(1, len(os.sched_getaffinity(0)) // (par.afd.ffn_workers + 1))


def pid_file(folder: str, index: int) -> str:
    return os.path.join(folder, f"ffn-{index}.pid")


def spawn_ffn_workers(config: EngineConfig, folder: str, name: str) -> list[subprocess.Popen]:
    """Start the M workers (the stale pid files of any before them removed first)."""
    size = config.parallel.afd.ffn_workers
    unready(folder, size)
    procs = []
    for j in range(size):
        spec = FFNSpec(config, j, size, folder, name, ffn_threads(config), os.getpid(),
                       logging.getLogger().getEffectiveLevel())
        proc = subprocess.Popen([sys.executable, "-m", "kvferry.engine.afd_worker"], stdin=subprocess.PIPE)
        proc.stdin.write(pickle.dumps(spec))
        proc.stdin.close()
        procs.append(proc)
    return procs


def unready(folder: str, size: int) -> None:
    """Remove the workers' pid files: no core may connect to them from now on."""
    for j in range(size):
        try:
            os.unlink(pid_file(folder, j))
        except FileNotFoundError:
            pass


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process still running, SIGKILL after the grace."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    end = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def exit_text(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


class FFNPool:
    """The server's FFN workers (module docstring). Thread-safe: ``stop``
    may come from any thread, while a restart is under way too."""

    def __init__(self, config: EngineConfig, *, max_restarts: int, window_s: float, name: str = "afd") -> None:
        folder = config.parallel.afd.folder
        if folder is None:
            raise ValueError("an FFN pool needs the cores' shared folder (AFDConfig.folder)")
        self.config, self.folder, self.name = config, folder, name
        self.max_restarts, self.window_s = max_restarts, window_s
        self.health = "ok"
        self._restarts: deque[float] = deque()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.procs = spawn_ffn_workers(config, folder, name)
        self._thread = threading.Thread(target=self._watch, name="afd-ffn-pool", daemon=True)
        self._thread.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            stop_all(self.procs)

    def _watch(self) -> None:
        while not self._stopping.wait(_POLL_S):
            dead = [(j, p) for j, p in enumerate(self.procs) if p.poll() is not None]
            if dead and not self._restart(*dead[0]):
                return

    def _restart(self, index: int, proc: subprocess.Popen) -> bool:
        """Stop the group, then start it again after the backoff; False
        once the budget is spent or the server stops."""
        with self._lock:
            if self._stopping.is_set():
                return False
            logger.error("FFN worker %d (pid %d) exited with %s; the FFN workers restart whole", index, proc.pid,
                         exit_text(proc.returncode))
            unready(self.folder, len(self.procs))  # a core restarting now waits for the new ones
            stop_all(self.procs)
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > self.window_s:
                self._restarts.popleft()
            if len(self._restarts) >= self.max_restarts:
                self.health = "down"
                logger.error("FFN workers: no restart left (%d within %.0f s)", self.max_restarts, self.window_s)
                return False
            delay = min(_BACKOFF_S * 2 ** len(self._restarts), _BACKOFF_MAX_S)
            self._restarts.append(now)
            self.health = "restarting"
        if self._stopping.wait(delay):
            return False
        with self._lock:
            if self._stopping.is_set():
                return False
            self.procs = spawn_ffn_workers(self.config, self.folder, self.name)
            self.health = "ok"
            logger.warning("FFN workers restarted (pids %s)", ", ".join(map(str, self.pids)))
        return True
