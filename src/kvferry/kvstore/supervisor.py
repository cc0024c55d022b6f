"""Keeping a server's node KV store running: ``kvferry serve --kv-dram-gb``
starts its store ("kvferry: kvstore") through a ``StoreSupervisor``, which
watches the process as the router's supervisor watches the engine cores.

    start ─► ok ──store exits──► reap, remove its arena and socket ─► restarting ──started──► ok
                                                                        │ (backoff 0.5 s doubling to 30 s)
                                                                        └─ budget spent ─► down (serving goes on, tiers off)

* A store that exits while the server did not ask it to is **reaped at
  once** (a thread waits on it: no ``<defunct>`` child), its arena and its
  socket file are removed (it could not: SIGKILL, OOM), and it is started
  again **at the same address** after a backoff, at most ``max_restarts``
  times within ``window_s`` (the server passes ``--engine-restarts`` and
  ``--engine-restart-window``). The cores need nothing new for it: their
  store clients see the old connection close, say Hello again at the same
  address, find a new service there, and map its new arena (see
  ``client.py``); until then every lookup misses and every load comes back
  empty, so the cores recompute.
* Past the budget the store is **down**: the server keeps serving from the
  device pool alone. A store is a cache, so this is never fatal (a core past
  its budget is).
* ``health`` says which: ``"ok"``, ``"restarting"`` or ``"down"``; the
  server's ``/health`` reports it as ``kv_store`` (``with_store_health``)
  and its ``/metrics`` leave out a store's counters while it is not ok.
* ``stop`` stops the store cleanly (SIGTERM: it flushes, then removes its
  socket and arena itself; SIGKILL after ``timeout_s``), then removes
  whatever of either is left.

On a Ray cluster each node's store is a Ray actor that Ray restarts
(``fleet/node_store.py``); this class is the single-host server's.
"""
from __future__ import annotations

import dataclasses
import logging
import subprocess
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Literal

from kvferry.kvstore.launch import remove_stale_store_files, socket_path, start_store

if TYPE_CHECKING:
    from kvferry.config import KVTierConfig

logger = logging.getLogger(__name__)

StoreHealth = Literal["ok", "restarting", "down"]

# As the engine cores' (router/supervisor.py): a store that dies at once
# is not respawned in a tight loop, but the first restart comes back fast.
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
_STOP_TIMEOUT_S = 10.0


class StoreSupervisor:
    """One store process, restarted within a budget. Thread-safe: a
    watcher thread waits on the process; ``stop`` and ``health`` are
    called from the server's threads."""

    def __init__(self, tiers: KVTierConfig, *, max_restarts: int, window_s: float, api_keys: str | None = None,
                 cache_secret_file: str | None = None, start_timeout_s: float = 30.0,
                 backoff_s: float = RESTART_BACKOFF_S, backoff_max_s: float = RESTART_BACKOFF_MAX_S) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {max_restarts}")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._start_kwargs = {"api_keys": api_keys, "cache_secret_file": cache_secret_file,
                              "timeout_s": start_timeout_s}
        # The first start raises (the server reports it and exits 2), as before supervision.
        self.process, self.address = start_store(tiers, **self._start_kwargs)
        # Every restart listens where the cores already look.
        self._tiers = dataclasses.replace(tiers, kv_store=self.address)
        self._health: StoreHealth = "ok"
        self._restarts: deque[float] = deque()  # monotonic times of the restarts in the window
        self._stopping = threading.Event()
        # Held while a store starts: stop() then waits for it, and stops it.
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="kvstore-supervisor", daemon=True)
        self._watcher.start()

    @property
    def health(self) -> StoreHealth:
        return self._health

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = _STOP_TIMEOUT_S) -> int | None:
        """Stop the store for good (SIGTERM, then SIGKILL past
        ``timeout_s``); its exit code. Idempotent."""
        self._stopping.set()
        with self._lock:  # a restart under way finishes first, and is stopped below
            process = self.process
        if process.poll() is None:
            process.terminate()
        try:
            code = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("KV store (pid %d) did not stop within %.0f s: killing it", process.pid, timeout_s)
            process.kill()
            code = process.wait()
        self._watcher.join(timeout_s)
        self._remove_files()
        self._health = "down"
        return code

    # -- the watcher --------------------------------------------------------------------
    def _watch(self) -> None:
        while True:
            process = self.process
            code = process.wait()  # reaps it: no zombie, and its pid reads as dead from now on
            if self._stopping.is_set():
                return
            logger.error("KV store (pid %d) exited with code %s: the KV tiers below the device pool are off "
                         "until it is back", process.pid, code)
            self._remove_files()
            if not self._restart():
                return

    def _restart(self) -> bool:
        """Start the store again (retrying a failed start) within the
        budget; False when it is spent or the server stops."""
        while not self._stopping.is_set():
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > self.window_s:
                self._restarts.popleft()
            if len(self._restarts) >= self.max_restarts:
                self._health = "down"
                logger.error("KV store: no restart left (%d within %.0f s); serving without the KV tiers",
                             self.max_restarts, self.window_s)
                return False
            delay = min(self.backoff_s * 2 ** len(self._restarts), self.backoff_max_s)
            self._restarts.append(now)
            self._health = "restarting"
            logger.warning("KV store: restarting in %.1f s (restart %d of %d within %.0f s)", delay,
                           len(self._restarts), self.max_restarts, self.window_s)
            if self._stopping.wait(delay):
                return False
            with self._lock:
                if self._stopping.is_set():
                    return False
                try:
                    self.process, _ = start_store(self._tiers, **self._start_kwargs)
                except (RuntimeError, ValueError, OSError) as exc:
                    logger.error("KV store: restart failed: %s", exc)
                    self._remove_files()
                    continue
            self._health = "ok"
            logger.warning("KV store restarted at %s (pid %d)", self.address, self.process.pid)
            return True
        return False

    def _remove_files(self) -> None:
        """The socket file and arena a dead store left (a clean stop removed
        both already). Called only while no store of ours runs."""
        path = socket_path(self.address)
        if path is not None and path.is_socket():
            path.unlink(missing_ok=True)
        remove_stale_store_files()  # its arena: its pid is dead once reaped


def with_store_health(state: dict, store: StoreHealth) -> dict:
    """``/health``'s answer with the store's: ``kv_store`` says it, and a
    serving server whose store is not ok is ``degraded`` (it serves, from
    the device pool alone), as one whose core is down while its role has
    another."""
    state = dict(state, kv_store=store)
    if store != "ok" and state.get("status") == "ok":
        state["status"] = "degraded"
    return state
