"""Tensors in anonymous memory advised for transparent huge pages (2 MiB).

For weights a step streams through once, front to back, and in full: an
MoE layer's packed experts (moe.py's ``ExpertLinear``), 12 MiB an expert
in OLMoE's shape, nearly all of them read each decode step at batch 16.
In 4 KiB pages every 64 cache lines of such a stream is a TLB miss and a
page walk, and the hardware prefetchers stop at each 4 KiB boundary; on 2
MiB pages one TLB entry covers the whole of a 48-column block's stream.
Measured on Zen 4 (2 cores), one thread: a 1-row bf16 matmul over cold
2048 x 2048 weights read 24 GB/s on huge pages against 20 on 4 KiB ones,
and a reduction over the same bytes likewise (30 against 21 GB/s); the
OLMoE-shaped layer at batch 16 took 15-20% less time.

torch's own allocator does this only for the whole process and only when
``THP_MEM_ALLOC_ENABLE`` is set before its first allocation, which a
library cannot arrange; so the few tensors that gain get their own mapping.
Where the kernel has no transparent huge pages (or they are off) the
advice is refused or ignored, and the tensor is plain 4 KiB pages: the
same contents, only slower. Pages take memory when first written, so the
alignment slack (up to 2 MiB a tensor, never written) costs address space
only.
"""
from __future__ import annotations

import ctypes
import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_enabled() -> bool:
    """Whether the kernel gives an advised mapping transparent huge pages:
    its setting is ``always`` or ``madvise`` (the bracketed word), not
    ``never`` or absent (a kernel without them, another OS)."""
    try:
        setting = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def return_freed_heap() -> None:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim;
    elsewhere nothing). A copy moved here from the heap leaves its old pages
    free but still counted: glibc raises its mmap threshold after the first
    large free, so later copies of a few MiB to 32 MiB came from the heap,
    and freeing them there returns nothing to the kernel (measured: a TP 2
    rank of the 1B-shaped model held ~640 MB more until trimmed)."""
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: its libc's
    except OSError:
        trim = None
    if trim is not None:  # absent: not glibc
        trim(0)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous tensor starting on a 2 MiB boundary of a
    private anonymous mapping advised MADV_HUGEPAGE (the tensor keeps the
    mapping alive)."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    # Private: a shared anonymous mapping is shmem, whose huge pages follow
    # another setting (shmem_enabled, "never" by default).
    pages = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise = getattr(pages, "madvise", None)
    if advise is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            advise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages: 4 KiB pages serve
            pass
    start = torch.frombuffer(pages, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE  # a multiple of the base page, so of every dtype's size
    return torch.frombuffer(pages, dtype=dtype, count=numel, offset=offset).view(shape)


class Arena:
    """Many tensors' bytes, packed one after another into huge-page chunks
    (``empty``) of ``chunk`` bytes or more. Where a tensor of its own would
    waste the rest of its last 2 MiB page (faulted in whole when its last
    byte is written), here only each chunk's last written page is partly
    unused; a chunk's unwritten tail costs address space only. Back to back,
    unaligned: tensors asked for one after another in a chunk are one run
    of memory (a fused layer's shards then stack as one view), and the
    quantized kernels load unaligned anyway (a Q8_0 block is 34 bytes)."""

    def __init__(self, chunk: int = 256 << 20) -> None:
        self.chunk = chunk
        self._buf: torch.Tensor | None = None
        self._used = 0

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialized uint8 tensor of ``nbytes`` in the arena."""
        start = self._used
        if self._buf is None or start + nbytes > self._buf.numel():
            self._buf, start = empty((max(self.chunk, nbytes),), torch.uint8), 0
        self._used = start + nbytes
        return self._buf[start:start + nbytes]
