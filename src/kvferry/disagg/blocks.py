"""The KV pool's blocks as the transfer moves them: checksums, runs of
consecutive blocks, gathers and scatters (whole layers or a range of KV
heads), and the decode core's pool as a named shared-memory segment.

Layout: a pool layer is ``[2, num_blocks, block_size, kv_heads, head_dim]``
(``kv_cache[layer]``); a gathered chunk ``[2, n, block_size, heads, head_dim]``
(K of every block, then V), contiguous.
"""
from __future__ import annotations

import logging
import mmap
import os
import uuid
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvferry.model.kv_cache_dtype import index_copy_into
from kvferry.shm_segments import unlink_dead_segments

logger = logging.getLogger(__name__)

_SHM_DIR = Path("/dev/shm")
_POOL_PREFIX = "kvferry-kvpool-"

def chunk_checksum(data: torch.Tensor, num_blocks: int) -> int:
    """xxh3-64 of the first ``num_blocks`` blocks of a gathered layer
    ``data: [2, n, block_size, H, D]`` (contiguous): K of each block, then V
    of each. Two hash calls over contiguous memory, on the sender while the
    gathered bytes are still in cache."""
    h = xxhash.xxh3_64()
    for kv in data[:, :num_blocks]:  # [num_blocks, bs, H, D], contiguous
        h.update(_as_bytes(kv))
    return h.intdigest()


def pool_checksum(pool_layer: torch.Tensor, block_ids: list[int]) -> int:
    """``chunk_checksum`` of blocks ``block_ids`` read in place from a pool
    layer ``[2, num_blocks, bs, H, D]``: one hash update per contiguous run
    of blocks, with no gather copy."""
    if pool_layer.device.type != "cpu":
        index = torch.tensor(block_ids, dtype=torch.int64, device=pool_layer.device)
        return chunk_checksum(pool_layer.index_select(1, index).cpu(), len(block_ids))
    runs = block_runs(block_ids)
    h = xxhash.xxh3_64()
    for kv in pool_layer.view(torch.uint8).numpy():  # [num_blocks, bs, H, D * elem], bytes
        for _, first, count in runs:
            h.update(kv[first : first + count])
    return h.intdigest()


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids: ``(position in block_ids, first id,
    count)``; a run of blocks is one contiguous range of a pool layer."""
    return [(pos, block_ids[pos], count) for pos, count in _run_bounds(np.asarray(block_ids, dtype=np.int64))]


def paired_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs where both ``src_ids`` and ``dst_ids`` are consecutive:
    ``(first src id, first dst id, count)``, each one contiguous copy."""
    src, dst = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    return [(src_ids[pos], dst_ids[pos], count) for pos, count in _run_bounds(src, dst)]


def _run_bounds(*ids: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of the maximal stretches where every array steps by
    one (vectorized: called per layer, so a Python loop over blocks would
    cost a third of a shared-memory transfer)."""
    n = len(ids[0])
    if n == 0:
        return []
    step = np.ones(n - 1, dtype=bool)
    for a in ids:
        step &= np.diff(a) == 1
    starts = [0, *(np.flatnonzero(~step) + 1).tolist()]
    return [(start, end - start) for start, end in zip(starts, [*starts[1:], n])]


def gather_blocks(pool_layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """[2, n, bs, H, D], contiguous, from a pool layer [2, num_blocks, bs, H, D]."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=pool_layer.device)
    return pool_layer.index_select(1, index)


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


# Per-run copies (and per-run hash updates) beat a gather-scatter kernel
# while the blocks form a few contiguous ranges, the usual case in a pool
# that is not fragmented; past this many runs, gather once.
_MAX_RUN_COPIES = 8



# -- the decode core's pool in shared memory -------------------------------------------
class SharedKVPool:
    """A KV pool tensor over a named shared-memory segment.

    The decode core creates it (and unlinks it on ``close``); a prefill core
    on the same host attaches by name and writes into it. A pool made with
    ``create`` is zero-filled (fresh shared memory is)."""

    def __init__(self, tensor: torch.Tensor, name: str, shm: shared_memory.SharedMemory | None = None,
                 mapping: mmap.mmap | None = None) -> None:
        self.tensor = tensor  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.name = name
        self._shm = shm  # set on the creating side, which unlinks it
        self._mapping = mapping  # set on an attaching side

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype, name: str | None = None) -> "SharedKVPool":
        """A new segment named after this process (``kvferry-kvpool-<pid>-<random>``),
        after unlinking the segments of pools whose creator is gone. ``name``:
        one derived from such a name (``rank_pool_name``: this process creates
        its tensor-parallel ranks' pools, so that they go when it goes)."""
        if name is None:
            remove_stale_pools()
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        name = name or f"{_POOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        return cls(torch.frombuffer(shm.buf, dtype=dtype).view(shape), shm.name, shm=shm)

    @classmethod
    def attach(cls, name: str, block_shape: tuple[int, ...], dtype: torch.dtype) -> "SharedKVPool":
        """Map another core's pool; ``block_shape`` is
        ``(num_layers, 2, block_size, kv_heads, head_dim)`` (both cores serve
        one model, so only the block count differs). Mapped from /dev/shm
        directly: ``SharedMemory(name)`` would also register the segment with
        Python's resource tracker (< 3.13), which unlinks it when this
        process exits, though it is the decode core's."""
        with open(f"/dev/shm/{name.lstrip('/')}", "r+b") as f:
            mapping = mmap.mmap(f.fileno(), 0)
        elem = torch.empty((), dtype=dtype).element_size()
        per_block = int(np.prod(block_shape)) * elem
        num_blocks = len(mapping) // per_block
        layers, two, *rest = block_shape
        flat = torch.frombuffer(mapping, dtype=dtype, count=num_blocks * per_block // elem)
        return cls(flat.view(layers, two, num_blocks, *rest), name, mapping=mapping)

    def close(self) -> None:
        self.tensor = None  # drop the view before the buffer goes
        try:
            if self._shm is not None:
                self._shm.unlink()  # first: close() refuses while a view is alive
                self._shm.close()
            elif self._mapping is not None:
                self._mapping.close()
        except BufferError:
            pass  # a view is still alive somewhere; the OS unmaps at exit
        except FileNotFoundError:
            pass


def remove_stale_pools(directory: Path = _SHM_DIR) -> list[str]:
    """Unlink the pool segments of decode cores that are gone without
    cleaning up (SIGKILL, OOM: a ``close`` that never ran)."""
    removed = unlink_dead_segments(directory, _POOL_PREFIX)
    if removed:
        logger.warning("removed %d KV pool segment(s) left by dead processes: %s", len(removed), removed)
    return removed



def write_blocks(pool_layer: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
    """pool_layer: [2, num_blocks, bs, H, D]; data: [2, n, bs, H, D] into
    blocks ``block_ids``: one copy per contiguous run of destination blocks
    while there are few runs, else one scatter."""
    runs = block_runs(block_ids)
    if len(runs) <= _MAX_RUN_COPIES:
        for pos, first, count in runs:
            pool_layer[:, first : first + count].copy_(data[:, pos : pos + count])
        return
    index = torch.tensor(block_ids, dtype=torch.int64, device=pool_layer.device)
    index_copy_into(pool_layer, 1, index, data.to(pool_layer.device))


def gather_heads(pool_layer: torch.Tensor, block_ids: list[int], lo: int, hi: int) -> torch.Tensor:
    """[2, n, bs, hi - lo, D], contiguous: heads [lo, hi) of blocks
    ``block_ids`` of a pool layer [2, num_blocks, bs, H, D] (the whole layer's
    gather when [lo, hi) is every head)."""
    data = gather_blocks(pool_layer, block_ids)
    return data if (lo, hi) == (0, pool_layer.shape[3]) else data[:, :, :, lo:hi].contiguous()


def rank_pool_name(base: str, rank: int) -> str:
    """The shared-memory segment of tensor-parallel rank ``rank``'s pool
    (rank 0's is ``base``; kvferry.messages.KVDestination.tp_size)."""
    return base if rank == 0 else f"{base}-rank{rank}"
