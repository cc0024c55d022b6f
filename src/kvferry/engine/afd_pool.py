"""The FFN workers of attention/FFN disaggregation as processes: how they
start, and the pool ``kvferry serve --mode afd`` keeps (no torch here: the
server's process imports it before any core starts).

    spawn_ffn_workers(config, folder, name, generation, size)
                                   M processes "kvferry: NAME ffn j" (afd_worker.py), each writing
                                   FOLDER/ffn-G-j.pid once it serves (G: the pool's generation)
    FFNPool(config, ...)           the server's M workers, shared by its N attention cores
                                   (launcher: LocalFFN, children of the server; under --ray,
                                   fleet/ffn_actors.py's RayFFN, Ray actors placed by --ray-ffn-resources)
    pool.resize(M')                kvferry scale --ffn M': the next generation, M' workers, beside the last
    read_generation(folder)        what the pool serves now (FOLDER/ffn-generation.json): a core's view

Generations. Every set of workers the pool starts is a generation G (its
sockets and pid files are named by G). Once all of its workers serve, the
pool publishes G in FOLDER/ffn-generation.json (written whole, by rename;
under --ray on the server's board actor instead, with each worker's node
and addresses, as cores on other nodes share no folder: afd_sites.py);
an attention core reads it before each step and moves to a newer
generation between two steps, never inside one (afd_leader.py). So:

- a resize starts M' workers beside the M serving, publishes them, then
  retires the M: each old worker exits once no request came for
  RETIRE_IDLE_S (a core's step that began on it finishes there);
- a worker that exits unpublishes the generation (a core's next step waits
  for the next one), the rest are stopped, and M start again after a
  backoff, within the cores' restart budget. A core with rows in flight
  on the dead worker ends whole (its requests fail, as a TP core's do when
  a rank dies); an idle one just waits for the next generation.

    start ─► ok ──a worker exits──► stop the others ─► restarting ──published──► ok
                                                           └─ budget spent ─► down (the cores' steps fail)
"""
from __future__ import annotations

import json
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
from typing import Protocol

from kvferry.config import EngineConfig
from kvferry.engine.rank_launcher import stop_all

logger = logging.getLogger(__name__)

_POLL_S = 0.2
_BACKOFF_S, _BACKOFF_MAX_S = 0.5, 30.0
LOAD_TIMEOUT_S = 600.0  # how long a generation may take to load its weights
MAX_FFN_WORKERS = 64  # a typo such as 1000 is an error, not a thousand model loads
GENERATION_FILE = "ffn-generation.json"


@dataclass(slots=True, frozen=True)
class FFNSite:
    """Where worker j of a generation placed by Ray listens: its Ray node,
    its ipc:// socket (for a core on that node: the folder is the node's),
    and its tcp:// one with CURVE (for a core on any other node)."""

    node: str
    ipc: str
    tcp: str
    pid: int
    threads: int  # its torch threads (the admin's view)


@dataclass(slots=True, frozen=True)
class Generation:
    """What the pool serves now: its generation, the worker count, their
    pids (worker j's is ``pids[j]``) and the pool's health ("ok", or
    "restarting" / "down", with no workers to use). ``sites``: worker j's
    addresses under --ray (``sites[j]``); empty for workers of one host,
    found in the shared folder by their generation and index."""

    generation: int
    size: int
    pids: tuple[int, ...]
    health: str = "ok"
    sites: tuple[FFNSite, ...] = ()


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
    generation: int = 0
    host: str | None = None  # under --ray: also bind tcp://HOST:* with CURVE (cores on other nodes)


def ffn_threads(config: EngineConfig, size: int | None = None) -> int:
    par = config.parallel
    if par.cpu_threads_per_rank is not None:
        return par.cpu_threads_per_rank
    return max(1, len(os.sched_getaffinity(0)) // ((size or par.afd.ffn_workers) + 1))


def pid_file(folder: str, index: int, generation: int = 0) -> str:
    return os.path.join(folder, f"ffn-{generation}-{index}.pid")


def tcp_file(folder: str, index: int, generation: int = 0) -> str:
    """Where a worker placed by Ray writes its tcp:// address (before its pid file)."""
    return os.path.join(folder, f"ffn-{generation}-{index}.tcp")


def read_pid(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip() or 0) or None
    except (FileNotFoundError, ValueError):
        return None


def read_generation(folder: str) -> Generation | None:
    """The generation the pool serves (None: none yet, or being replaced)."""
    try:
        with open(os.path.join(folder, GENERATION_FILE), encoding="utf-8") as f:
            raw = json.load(f)
        return Generation(int(raw["generation"]), int(raw["size"]), tuple(map(int, raw["pids"])), str(raw["health"]))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def write_generation(folder: str, gen: Generation) -> None:
    path = os.path.join(folder, GENERATION_FILE)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"generation": gen.generation, "size": gen.size, "pids": list(gen.pids), "health": gen.health}, f)
    os.replace(tmp, path)  # whole or absent: a core never reads half of it


def spawn_ffn_workers(config: EngineConfig, folder: str, name: str, generation: int = 0,
                      size: int | None = None) -> list[subprocess.Popen]:
    """Start ``size`` workers (default: the config's M) of ``generation``
    (the stale pid files of any before them removed first)."""
    size = size or config.parallel.afd.ffn_workers
    unready(folder, size, generation)
    procs = []
    for j in range(size):
        spec = FFNSpec(config, j, size, folder, name, ffn_threads(config, size), os.getpid(),
                       logging.getLogger().getEffectiveLevel(), generation)
        proc = subprocess.Popen([sys.executable, "-m", "kvferry.engine.afd_worker"], stdin=subprocess.PIPE)
        proc.stdin.write(pickle.dumps(spec))
        proc.stdin.close()
        procs.append(proc)
    return procs


def unready(folder: str, size: int, generation: int = 0) -> None:
    """Remove the workers' pid files: no core may connect to them from now on."""
    for j in range(size):
        try:
            os.unlink(pid_file(folder, j, generation))
        except FileNotFoundError:
            pass


def exit_text(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"



class FFNLoadError(RuntimeError):
    """A generation's workers did not all come up (one exited, or the load timed out)."""


class FFNLauncher(Protocol):
    """Where a pool's workers run and how the cores learn of them. A worker
    handle has Popen's ``pid``, ``poll``, ``wait``, ``terminate``, ``kill``
    and ``send_signal`` (SIGUSR1: retire)."""

    def spawn(self, generation: int, size: int) -> list: ...

    def ready(self, procs: list, generation: int) -> bool:
        """Every worker of ``generation`` serves (the cores may connect)."""

    def publish(self, gen: Generation) -> None: ...

    def unready(self, generation: int, size: int) -> None:
        """No core may connect to ``generation``'s workers from now on."""

    def close(self) -> None: ...


class LocalFFN:
    """The server's workers as its children, found through the cores' shared
    0700 folder: their pid files (ready), the generation file (published)."""

    def __init__(self, config: EngineConfig, folder: str, name: str) -> None:
        self.config, self.folder, self.name = config, folder, name

    def spawn(self, generation: int, size: int) -> list[subprocess.Popen]:
        return spawn_ffn_workers(self.config, self.folder, self.name, generation, size)

    def ready(self, procs: list[subprocess.Popen], generation: int) -> bool:
        return all(read_pid(pid_file(self.folder, j, generation)) == p.pid for j, p in enumerate(procs))

    def publish(self, gen: Generation) -> None:
        write_generation(self.folder, gen)

    def unready(self, generation: int, size: int) -> None:
        unready(self.folder, size, generation)

    def close(self) -> None:
        """The folder is the server's (removed when it exits)."""


class FFNPool:
    """The server's FFN workers (module docstring). Thread-safe: ``stop``
    and ``resize`` may come from any thread, while a restart is under way
    too (one generation starts at a time)."""

    def __init__(self, config: EngineConfig, *, max_restarts: int, window_s: float, name: str = "afd",
                 launcher: FFNLauncher | None = None) -> None:
        folder = config.parallel.afd.folder
        if launcher is None and (folder is None or config.parallel.afd.board):
            raise ValueError("an FFN pool needs the cores' shared folder (AFDConfig.folder)")
        self.config, self.folder, self.name = config, folder, name
        self.launcher = launcher or LocalFFN(config, folder, name)  # type: ignore[arg-type]
        self.max_restarts, self.window_s = max_restarts, window_s
        self.health = "ok"
        self.generation, self.size = 0, config.parallel.afd.ffn_workers
        self._restarts: deque[float] = deque()
        self._lock = threading.Lock()  # held while a generation starts: one at a time
        self._stopping = threading.Event()
        self._retired: list[subprocess.Popen] = []  # earlier generations', exiting once idle
        self.procs = self.launcher.spawn(self.generation, self.size)
        self._thread = threading.Thread(target=self._watch, name="afd-ffn-pool", daemon=True)
        self._thread.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            stop_all([*self.procs, *self._retired])
            self.launcher.close()

    def resize(self, size: int) -> float:
        """Serve with ``size`` workers from now on (kvferry scale --ffn):
        the next generation starts beside this one, is published once it
        serves, and this one is retired (module docstring). Returns the
        seconds it took; FFNLoadError (nothing changed) when the new
        workers do not come up, RuntimeError when the pool is down."""
        start = time.monotonic()
        with self._lock:
            if self._stopping.is_set() or self.health == "down":
                raise RuntimeError(f"the FFN workers are {'stopping' if self._stopping.is_set() else 'down'}")
            if size == self.size:
                return 0.0
            new = self.launcher.spawn(self.generation + 1, size)
            try:
                self._wait_ready(new, self.generation + 1)
            except FFNLoadError:
                stop_all(new)
                raise
            old, self.procs = self.procs, new
            self.launcher.unready(self.generation, len(old))  # no core connects to it any more
            self.generation, self.size = self.generation + 1, size
            self._publish()
            self._retire(old)
        logger.warning("FFN workers resized to %d (pids %s) in %.1f s", size, ", ".join(map(str, self.pids)),
                       time.monotonic() - start)
        return time.monotonic() - start

    def _retire(self, procs: list[subprocess.Popen]) -> None:
        """Each exits once no core sent it a request for RETIRE_IDLE_S (afd_worker.py)."""
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
        self._retired.extend(procs)

    def _publish(self, health: str = "ok") -> None:
        pids = tuple(self.pids) if health == "ok" else ()
        self.launcher.publish(Generation(self.generation, self.size, pids, health))

    def _wait_ready(self, procs: list[subprocess.Popen], generation: int) -> None:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while not self.launcher.ready(procs, generation):
            dead = [(j, p) for j, p in enumerate(procs) if p.poll() is not None]
            if dead:
                j, p = dead[0]
                raise FFNLoadError(f"FFN worker {j} (pid {p.pid}) exited with {exit_text(p.returncode)} "
                                   "before it served")
            if time.monotonic() > deadline or self._stopping.is_set():
                raise FFNLoadError(f"the FFN workers did not load within {LOAD_TIMEOUT_S:g} s")
            time.sleep(_POLL_S / 4)

    def _watch(self) -> None:
        with self._lock:  # the first generation: published once it serves
            try:
                self._wait_ready(self.procs, self.generation)
                self._publish()
            except FFNLoadError as exc:
                logger.error("%s", exc)  # the dead worker is seen below, and restarted
        while not self._stopping.wait(_POLL_S):
            self._retired = [p for p in self._retired if p.poll() is None]
            dead = [(j, p) for j, p in enumerate(self.procs) if p.poll() is not None]
            if dead and not self._restart(*dead[0]):
                return

    def _restart(self, index: int, proc: subprocess.Popen) -> bool:
        """Stop the group, then start the next generation after the
        backoff; False once the budget is spent or the server stops."""
        with self._lock:
            if self._stopping.is_set():
                return False
            logger.error("FFN worker %d (pid %d) exited with %s; the FFN workers restart whole", index, proc.pid,
                         exit_text(proc.returncode))
            self._publish("restarting")  # a core's next step waits for the next generation
            self.launcher.unready(self.generation, len(self.procs))
            stop_all(self.procs)
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > self.window_s:
                self._restarts.popleft()
            if len(self._restarts) >= self.max_restarts:
                self.health = "down"
                self._publish("down")
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
            self.generation += 1
            try:
                # Ray's may fail to place them: the stopped ones stay, seen dead again (within the budget).
                self.procs = self.launcher.spawn(self.generation, self.size)
                self._wait_ready(self.procs, self.generation)
            except FFNLoadError as exc:
                logger.error("%s", exc)
                return True  # the watch sees the dead one and restarts again, within the budget
            self.health = "ok"
            self._publish()
            logger.warning("FFN workers restarted (pids %s)", ", ".join(map(str, self.pids)))
        return True
