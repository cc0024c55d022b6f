"""Shared-memory segments left behind by dead processes.

Segments this project creates in /dev/shm are named ``PREFIX<pid>-<random>``
after the process that created them. A creator killed before it could
clean up (SIGKILL, OOM) leaves its segment; the next creator of the same
kind unlinks those whose pid is gone. Assumes one pid namespace per
/dev/shm, as on one host (a reused pid keeps its segment).
"""
from __future__ import annotations

import os
from pathlib import Path


def unlink_dead_segments(directory: Path, prefix: str) -> list[str]:
    """Unlink ``directory/PREFIX<pid>-*`` whose creator ``pid`` no longer
    runs; the names unlinked."""
    removed = []
    for path in directory.glob(f"{prefix}*-*"):
        try:
            pid = int(path.name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
