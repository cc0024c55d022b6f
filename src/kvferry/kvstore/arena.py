"""The DRAM tier's bytes: one file under /dev/shm, mapped by the store
service and by every engine process on the node.

Slot ``s`` is bytes ``[s * block_nbytes, (s + 1) * block_nbytes)``: one
block in the device KV layout. Engines copy blocks in and out in place
(``torch.from_numpy(arena[s])``); nothing is pickled or sent.

Why a plain mmap'd file rather than ``multiprocessing.shared_memory``: the
latter registers every attach with a resource tracker that unlinks the
segment when an attaching process exits, so an engine's exit could delete
the store's arena. Here only the service that created the file unlinks it.
The whole file is allocated up front (``posix_fallocate``), so a /dev/shm
too small fails at start with an error rather than a SIGBUS at first touch.
"""
from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path

import numpy as np

from kvferry.shm_segments import unlink_dead_segments

SHM_DIR = Path("/dev/shm")


class Arena:
    """``view``: uint8 ``[num_slots, block_nbytes]`` over the mapping."""

    def __init__(self, path: Path, num_slots: int, block_nbytes: int, owner: bool, mm: mmap.mmap) -> None:
        self.path = path
        self.num_slots = num_slots
        self.block_nbytes = block_nbytes
        self.owner = owner
        self._mmap = mm
        # [num_slots, block_nbytes]
        self.view = np.frombuffer(mm, dtype=np.uint8).reshape(num_slots, block_nbytes)

    @classmethod
    def create(cls, num_slots: int, block_nbytes: int, directory: Path = SHM_DIR) -> "Arena":
        if num_slots < 1:
            raise ValueError(f"num_slots: the arena must hold at least one block, got {num_slots}")
        if block_nbytes < 1:
            raise ValueError(f"block_nbytes: must be >= 1, got {block_nbytes}")
        path = directory / f"kvferry-kvstore-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        size = num_slots * block_nbytes
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                path.unlink(missing_ok=True)
                raise ValueError(f"kv_dram_gb: cannot allocate {size / 2**30:.2f} GiB in {directory}: "
                                 f"{exc.strerror or exc}") from None
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, num_slots, block_nbytes, True, mm)

    @staticmethod
    def sweep_stale(directory: Path = SHM_DIR) -> int:
        """Unlink arenas whose creator is gone (killed before it could
        clean up: SIGKILL, OOM). The creator's pid is in the name."""
        return len(unlink_dead_segments(directory, "kvferry-kvstore-"))

    @classmethod
    def attach(cls, path: str | Path, num_slots: int, block_nbytes: int) -> "Arena":
        """Map an arena another process created (the store's)."""
        path = Path(path)
        size = num_slots * block_nbytes
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"arena {path}: {os.fstat(fd).st_size} bytes, expected {size}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, num_slots, block_nbytes, False, mm)

    def close(self) -> None:
        """Unmap (views others hold keep the memory alive until dropped),
        and, for the creator, unlink the file."""
        if self.owner:
            self.path.unlink(missing_ok=True)
        try:
            del self.view
            self._mmap.close()
        except BufferError:
            pass  # someone still holds a view: the mapping lives until it is dropped

