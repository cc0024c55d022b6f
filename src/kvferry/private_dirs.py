"""Private (0700) temporary folders that outlive no process of their tree.

A folder of ipc:// sockets (an engine core's, a tensor-parallel core's
ranks', a pipeline's stages', the FFN workers') is named
``$TMPDIR/PREFIX<creator pid>-<random>``. Its creator removes it when it
stops; one killed outright (SIGKILL, OOM) cannot, so two more hands do:

- the children the folder was made for remove it when they see their
  parent gone, before they exit (``folder_of`` finds it from their
  ipc:// endpoint; ``rank_group.watch_parent``, ``core_proc``);
- the next creator of the same prefix removes the folders of this user
  whose creator pid no longer runs (``make``), for a tree killed whole.

Only a folder whose name starts with ``kvferry-`` is ever removed this
way: an endpoint in a folder the operator chose is left alone.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from kvferry.shm_segments import pid_alive

_OURS = "kvferry-"


def make(prefix: str) -> str:
    """A fresh 0700 folder ``$TMPDIR/PREFIX<pid>-<random>``, after removing
    those of ``prefix`` whose creator is gone."""
    assert prefix.startswith(_OURS) and prefix.endswith("-"), prefix
    remove_dead(prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


def remove_dead(prefix: str, directory: Path | None = None) -> list[str]:
    """Remove ``PREFIX<pid>-*`` folders of this user whose ``pid`` no longer
    runs (a zombie counts as gone); the names removed."""
    removed = []
    for path in (directory or Path(tempfile.gettempdir())).glob(f"{prefix}*-*"):
        try:
            pid = int(path.name[len(prefix):].split("-")[0])
            st = path.lstat()
            if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid() or pid_alive(pid):
                continue
        except (ValueError, OSError):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed


def folder_of(endpoint: str | None) -> str | None:
    """The private folder an ``ipc://`` endpoint lies in, when it is one of
    ours (``$TMPDIR/kvferry-*``); None for tcp://, abstract sockets, or a
    folder of the operator's."""
    if not endpoint or not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    return ours(os.path.dirname(endpoint[len("ipc://"):]))


def ours(folder: str | None) -> str | None:
    """``folder`` when it is one of ours (named ``kvferry-*``), else None."""
    return folder if folder and os.path.basename(folder.rstrip("/")).startswith(_OURS) else None


def remove(folder: str | None) -> None:
    """Remove ``folder`` (None: nothing), whatever is left in it."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
