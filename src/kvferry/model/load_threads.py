"""The weight load's copies on one OpenMP thread.

Loading a checkpoint is some hundreds of ``copy_`` calls (each tensor from
its memory-mapped file into the model's storage, often with a dtype
conversion), with Python, safetensors reads and page faults between them.
Each copy over torch's grain size is a parallel region: with a team of two
or more, the workers wake for it, and between copies they spin-wait
(libgomp's default wait policy) for the next region, burning a CPU each
while the master does the Python work. On the embedded 135M model in
float32 the load took 1.3-1.75 CPU-s and 2.8-5.5 s wall on a busy 2-core
host with a team of two, against about 0.5 CPU-s and 1.1 s on one thread
(``OMP_WAIT_POLICY=PASSIVE`` does as well, but for the whole process: the
decode step's regions want the spinning). The copies are memory-bound, and
page faults on the file's pages serialize in the kernel anyway, so a second
thread buys little even on a 1B model (BENCHMARKS.md, "Start-up and
memory"). The team is restored afterwards on the same thread: libgomp
keeps its pool (and any pinning, engine/cpu_threads.py) across a one-thread
section, which never starts a team.
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
