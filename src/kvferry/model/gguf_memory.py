"""Where a served GGUF file's blocks are held (``KVFERRY_GGUF_WEIGHTS``).

``huge-pages`` (the default where the kernel has transparent huge pages):
the blocks a step streams are read at load (pread, tensor by tensor) into
the process's own memory on 2 MiB pages (huge_pages.py). A batch-1 decode
step reads every linear layer's blocks and the lm_head's once, front to
back: on the file's 4 KiB pages that is a TLB miss and page walk every 64
cache lines and a stop of the hardware prefetchers at every 4 KiB
boundary. Measured on Zen 4 (2 cores), a 1B-shaped Q4_K_M file, one
thread: the step's matmuls took 0.88x the time on huge pages (BENCHMARKS.md).
The cost: each engine holds its own copy (about the file's bytes, RSS),
where mapped engines serving one file share its page cache, and the load
reads the whole file at once.

``mapped``: views of a private mapping of the file (gguf_weights.map_file),
llama.cpp's default (mmap): pages are read in as first used, shared with
every engine serving the file, and never counted twice.

Either way the bytes and so the logits are the same. A GGUF's token
embedding that is not also the lm_head (an untied ``output.weight``) stays
a view of the mapping in both: a step reads one row of it per token, which
huge pages cannot speed up, and a copy would hold the whole table.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvferry import envs
from kvferry.model import huge_pages

HUGE_PAGES, MAPPED = "huge-pages", "mapped"


def mode() -> str:
    """``KVFERRY_GGUF_WEIGHTS`` where set, else huge pages where the kernel
    has them (``always`` or ``madvise``), else the mapped file."""
    chosen = envs.gguf_weights()
    if chosen is not None:
        return chosen
    return HUGE_PAGES if huge_pages.thp_enabled() else MAPPED


def read_into(path: Path, out: np.ndarray, offset: int, name: str) -> None:
    """Fill ``out`` (contiguous) with the file's bytes from ``offset``:
    pread, so no page of a mapping of the file is touched (the page cache
    is not this process's memory), and the copy is written where ``out`` is."""
    buf = memoryview(out.reshape(-1).view(np.uint8))
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(buf):  # Linux returns at most ~2 GiB per call
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n <= 0:
                raise ValueError(f"GGUF {path.name}: tensor {name!r} is truncated")
            done += n
    finally:
        os.close(fd)


class BlockSlab:
    """Tensors of a file, packed in the given order into one huge-page
    mapping. The caller puts a fused layer's shards back to back in row
    order (q, k, v; gate, up), so the layer stacks them as one view
    (quant.stack_rows) wherever they lie in the file: no stacked copy on
    4 KiB pages beside the slab. Each run of tensors starts on a cache
    line; ``runs``: the tensors as lists, each list packed without a gap."""

    ALIGN = 64

    def __init__(self, path: Path, runs: list[list[Any]]) -> None:
        self.path = path
        self._at: dict[str, int] = {}
        end = 0
        for run in runs:
            end = -(-end // self.ALIGN) * self.ALIGN
            for t in run:
                self._at[t.name] = end
                end += int(t.n_bytes)
        self.data = huge_pages.empty((end,), torch.uint8)

    def __contains__(self, name: str) -> bool:
        return name in self._at

    def _slot(self, t: Any) -> torch.Tensor:
        start = self._at[t.name]
        return self.data[start:start + int(t.n_bytes)]

    def read(self, t: Any) -> torch.Tensor:
        """Tensor ``t``'s bytes, read from the file into its place."""
        slot = self._slot(t)
        read_into(self.path, slot.numpy(), int(t.data_offset), t.name)
        return slot

    def place(self, t: Any, data: torch.Tensor) -> torch.Tensor:
        """``data`` (tensor ``t``'s bytes, rearranged: llama's unpermuted
        Q/K) copied into ``t``'s place, shaped as ``data``."""
        slot = self._slot(t)
        slot.copy_(data.reshape(-1))
        return slot.view(data.shape)
