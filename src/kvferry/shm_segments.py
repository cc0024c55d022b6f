"""Shared-memory segments and socket files left behind by dead processes.

Segments this project creates in /dev/shm are named ``PREFIX<pid>-<random>``
after the process that created them; a node KV store's socket file is
named ``PREFIX<pid>-<random>.sock`` after the process that started the
store. An owner killed before it could clean up (SIGKILL, OOM) leaves
them; the next creator of the same kind removes those whose pid is gone.
A zombie counts as gone (it maps nothing and will never clean up). Only
this user's files are touched. Assumes one pid namespace per /dev/shm and
temporary directory, as on one host (a reused pid keeps its files).
"""
from __future__ import annotations

import os
from pathlib import Path


def unlink_dead_segments(directory: Path, prefix: str) -> list[str]:
    """Unlink ``directory/PREFIX<pid>-*`` whose creator ``pid`` no longer
    runs; the names unlinked."""
    return _unlink_dead(directory, prefix, "", sockets=False)


def unlink_dead_sockets(directory: Path, prefix: str, suffix: str = ".sock") -> list[str]:
    """Unlink the socket files ``directory/PREFIX<pid>-*SUFFIX`` whose owner
    ``pid`` no longer runs; the names unlinked."""
    return _unlink_dead(directory, prefix, suffix, sockets=True)


def _unlink_dead(directory: Path, prefix: str, suffix: str, sockets: bool) -> list[str]:
    removed = []
    for path in directory.glob(f"{prefix}*-*{suffix}"):
        try:
            pid = int(path.name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        try:
            st = path.lstat()
            if st.st_uid != os.getuid() or (sockets and not path.is_socket()) or pid_alive(pid):
                continue
            path.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(path.name)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it waits only to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) S ...": the state follows the last ")" (comm may hold one).
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)
