"""The weight load's copies on one OpenMP thread.

Loading a checkpoint is some hundreds of ``copy_`` calls (each tensor from
its memory-mapped file into the model's storage, often with a dtype
conversion), with Python, safetensors reads and page faults between them.
Each copy over torch's grain size is a parallel region: with a team of two
or more, the workers wake for it and then spin-wait (libgomp's default wait
policy) for the next region, burning a CPU each while the master does the
Python work between copies. Measured on a busy 2-core Zen 4 host, in fresh
processes at 2 threads (medians of 3, BENCHMARKS.md "Start-up and memory"):
the embedded 135M model in float32 loaded in 1.82 CPU-s and 1.88 s wall
with the team, 0.52 CPU-s and 0.56 s with the copies on one thread; a
1B-shaped bf16 checkpoint in 2.29 CPU-s and 2.49 s with the team, 1.65 and
1.69 s on one thread. The second thread bought no wall time even for the
1B model's largest tensors (the embedding table, 100M values): no size rule. ``OMP_WAIT_POLICY=PASSIVE`` saves
as much but for the whole process, whose decode steps want the spinning.
Only the plain copies are narrowed: a quantizing load (int8, GGUF) keeps
its team for its arithmetic. The team size comes back afterwards on the
same thread; a one-thread region starts no team, so libgomp keeps its pool
(and any pinning, engine/cpu_threads.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a weight being loaded, on this thread alone."""
    with torch.no_grad(), one_thread():
        dst.copy_(src)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block's torch ops on the calling thread alone, then give the
    thread back its team size (torch's thread count is per thread under
    OpenMP: other threads keep theirs)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
