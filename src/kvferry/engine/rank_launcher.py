"""Where a leader's ranks 1..N-1 run: child processes of this one (the
default), or processes a launcher places elsewhere (``kvferry serve --ray``
with ``--ray-rank-placement spread``: Ray actors in the core's placement
group, fleet/rank_actors.py, possibly on other nodes).

    install(launcher, node)  the core's process says where its ranks go (before EngineCore is built)
                             and which Ray node it is on (what /v1/admin/workers shows)
    current()                the installed launcher, or None: local children
    this_node()              the node install() named ("": not under Ray)
    local(module, spec)      the default: ``python -m module``, the pickled spec on stdin

A launcher's ranks may be on other nodes: the leader then binds its sockets
on tcp://``launcher.host`` with CURVE (parallel/rank_sockets.py) instead of
ipc:// in a private folder, and the TP ranks sum over parallel/tcp_group.py.
A rank is whatever has Popen's ``pid``, ``poll``, ``wait``, ``terminate``
and ``kill`` (what rank_group.RankProcesses uses), and a ``node`` (None: here).
"""
from __future__ import annotations

import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Protocol

from kvferry import peer_auth


@dataclass(frozen=True, slots=True)
class RankSite:
    """Where one rank will run: the node's address, a port free there a
    moment ago (a pipeline stage binds its activations on it), and the pid
    of the process that will be the rank's parent (its watchdog's)."""

    host: str
    port: int
    parent_pid: int
    node: str


class RankHandle(Protocol):
    pid: int
    node: str | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class RankLauncher(Protocol):
    host: str  # this process's node address: the leader binds tcp:// sockets there

    def place(self, count: int) -> list[RankSite]:
        """Room for ranks 1..count (blocking until placed); raises RuntimeError naming what is missing."""

    def spawn(self, rank: int, module: str, spec: object) -> RankHandle: ...

    def close(self) -> None: ...


_launcher: RankLauncher | None = None
_node = ""


def install(launcher: RankLauncher | None, node: str = "") -> None:
    global _launcher, _node
    _launcher, _node = launcher, node


def this_node() -> str:
    return _node


def current() -> RankLauncher | None:
    return _launcher


class LocalRank(subprocess.Popen):
    node: str | None = None


def local(module: str, spec: object) -> LocalRank:
    # The process tree's socket secret in the environment before the rank starts, so it
    # inherits it: a rank's KV transfer links present its token (an offline core of stages
    # started before anything drew the secret would give each stage one of its own).
    peer_auth.socket_secret()
    proc = LocalRank([sys.executable, "-m", module], stdin=subprocess.PIPE)
    proc.stdin.write(pickle.dumps(spec))
    proc.stdin.close()
    return proc


STOP_GRACE_S = 5.0  # a rank or worker process's time to exit on SIGTERM


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
