"""An all-reduce over shared memory for the ranks of one host (as vLLM's CPU
SHM communicator): no sockets, no kernel on the data path.

One segment holds, for each of two buffers, one slot per rank, and one
sequence flag per rank (and, for the C++ wait, each flag's count of the
ranks sleeping on it: shm_sums.h):

    [flags: int64 x world_size][sleepers: int64 x world_size][buffer 0: slot 0 | slot 1 | ...][buffer 1: ...]

Call number ``seq`` (every rank counts its calls; chunks of a large tensor
are calls of their own) uses buffer ``seq % 2``:

1. rank r copies its tensor into its slot, then stores ``seq`` into its flag
   (x86 keeps stores in order: a peer that sees the flag sees the data);
2. it waits until every flag is >= ``seq``;
3. it sums the slots in rank order: every rank adds the same numbers in the
   same order, so all ranks get the same bits, whatever the tensor's shape
   (gloo's ring all-reduce sums each chunk in an order that depends on the
   size). Two ranks each add the peer's slot to their own tensor, in one
   pass: a + b and b + a are the same bits.

Two buffers suffice: a rank writes buffer ``seq % 2`` again at ``seq + 2``
only after every flag reached ``seq + 1``, i.e. after every rank finished
reading call ``seq``.

A rank's flag is also its count of calls: whichever side makes a call
(this Python, or the C++ of ``attach``) reads the count from it.

Where the C++ decoder layer builds, a tensor-parallel rank attaches its
``ShmSums`` (model/csrc/shm_sums.h, the same protocol and the same sums),
and the calls run there: the copy, the flag, the wait and the sum without
Python between them, and the rank's decoder layers run in one C++ call with
their all-reduces inside (``tp_decoder_layers``). Its wait spins for 100 us
(yielding), then sleeps on the late peer's flag as a futex, which the peer wakes when
it stores it (a wake only when someone sleeps: a syscall per sum otherwise).

Without it the wait spins for 100 us, yielding between looks, then naps from 50 us
doubling up to 1 ms (ranks may share cores). Either wait is bounded: a peer whose process is gone (pids are in the group's store)
fails it at once, a hung one after ``timeout_s``, with ``CollectiveError``.
``all_gather`` takes the same steps, each rank then copying every slot into
its place in the result. Anything other than a float sum goes to the wrapped
gloo group.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from kvferry.parallel.group import CollectiveError, ProcessGroup

SLOT_BYTES = 4 << 20  # per rank and buffer: one decode step's [batch, hidden] many times over
_ALIGN = 64
_LIVENESS_EVERY_S = 0.05
# A wait first spins (a peer on its own core arrives within microseconds),
# then naps, so that a peer sharing this CPU gets it (a loaded host, more
# ranks than cores): spinning there took the CPU the peer needed.
_SPIN_S = 100e-6
_NAP_S = 50e-6  # doubling up to _MAX_NAP_S: a waiter that wakes often competes with the peer it waits for
_MAX_NAP_S = 1e-3
# Dtypes torch adds in (at least) float32 and rounds once: two ranks' sum in one pass.
_ONE_PASS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class ShmAllReduce:
    """``group``'s collectives, its float sums through shared memory."""

    def __init__(self, group: ProcessGroup, slot_bytes: int = SLOT_BYTES) -> None:
        self.group, self.rank, self.world_size = group, group.rank, group.world_size
        self.timeout_s = group.timeout_s
        n = self.world_size
        self._slot = slot_bytes
        self._data_offset = -(-16 * n // _ALIGN) * _ALIGN  # the flags, then their sleeper counts
        size = self._data_offset + 2 * n * slot_bytes
        if self.rank == 0:
            self._shm = shared_memory.SharedMemory(create=True, size=size)
            group.store_set("shm_all_reduce", self._shm.name)
        else:
            self._shm = shared_memory.SharedMemory(name=group.store_get("shm_all_reduce"))
            _untrack(self._shm)  # rank 0 owns it: a worker's exit must not unlink it
        group.store_set(f"pid{self.rank}", str(os.getpid()))
        self._flags = np.ndarray((n,), dtype=np.int64, buffer=self._shm.buf)
        # The same memory for C++, with the sleeper counts after the flags.
        self._flag_tensor = torch.frombuffer(self._shm.buf, dtype=torch.int64, count=2 * n)
        self._bytes = torch.frombuffer(self._shm.buf, dtype=torch.uint8, offset=self._data_offset,
                                       count=2 * n * slot_bytes)
        self.native: torch.ScriptObject | None = None  # attach()'s ShmSums: the calls run there
        self._views: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
        group.barrier()  # every rank attached (rank 0 may unlink the name from now on)
        self._pids = [int(group.store_get(f"pid{r}")) for r in range(n)]
        if self.rank == 0:
            self._shm.unlink()  # gone from /dev/shm once every rank has closed it, however they end

    def segment(self) -> tuple[torch.Tensor, torch.Tensor, int, int, list[int], float]:
        """What a C++ ShmSums over this segment takes: the flags (then their
        sleeper counts), the slots' bytes, this rank, a slot's size, every
        rank's pid, and the timeout."""
        return self._flag_tensor, self._bytes, self.rank, self._slot, list(self._pids), float(self.timeout_s)

    def attach(self, native: torch.ScriptObject) -> None:
        """Make every float sum and exchange through ``native`` (a ShmSums over
        ``segment()``), where the wait sleeps on a futex instead of napping.
        Every rank attaches one, or none: a Python post wakes no sleeper."""
        self.native = native

    # -- collectives -------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op != "sum" or not tensor.is_floating_point() or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return self.group.all_reduce(tensor, op)
        if self.native is not None:
            with native_errors():
                self.native.all_reduce_(tensor)
            return tensor
        flat = tensor.view(-1)
        per_call = self._slot // tensor.element_size()
        for start in range(0, flat.numel(), per_call):
            self._reduce_chunk(flat[start:start + per_call])
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``tensor`` side by side along ``dim``, in rank order
        (the logits of a vocabulary-parallel lm_head each step: gloo's took
        1-3 ms of a 1B-shaped decode step). The tensor as [outer, inner]
        (outer: the dims before ``dim``), in calls of as many outer rows as a
        slot holds; a row longer than a slot goes to gloo."""
        t = tensor.contiguous()
        if t.device.type != "cpu" or t.dim() == 0 or t.numel() == 0:
            return self.group.all_gather(tensor, dim)
        if not -t.dim() <= dim < t.dim():
            raise ValueError(f"all_gather: dim {dim} is out of range for a {t.dim()}-d tensor")
        d = dim % t.dim()
        outer = math.prod(t.shape[:d])
        inner = t.numel() // outer
        if inner * t.element_size() > self._slot:
            return self.group.all_gather(tensor, dim)
        n = self.world_size
        src, out = t.view(outer, inner), t.new_empty(outer, n * inner)
        per_call = self._slot // (inner * t.element_size())
        for start in range(0, outer, per_call):
            part = src[start:start + per_call]
            rows = part.shape[0]
            slots = self._exchange(part.reshape(-1), "all_gather")
            for r in range(n):
                out[start:start + rows, r * inner:(r + 1) * inner].copy_(slots[r].view(rows, inner))
        shape = list(t.shape)
        shape[d] *= n
        return out.view(shape)

    def barrier(self) -> None:
        self.group.barrier()

    def _exchange(self, x: torch.Tensor, name: str) -> list[torch.Tensor]:
        """One call: ``x`` (1-D) into this rank's slot, and every rank's slot
        once all have written theirs."""
        if self.native is not None:
            with native_errors():
                seq = self.native.exchange(x)
            return self._slots(seq % 2, x)
        seq = int(self._flags[self.rank]) + 1  # this rank's calls so far, +1
        slots = self._slots(seq % 2, x)
        slots[self.rank].copy_(x)
        self._flags[self.rank] = seq  # after the data (stores stay in order on x86)
        self._wait(seq, name)
        return slots

    def _reduce_chunk(self, x: torch.Tensor) -> None:
        slots, n = self._exchange(x, "all_reduce"), self.world_size
        if n == 2 and x.dtype in _ONE_PASS:
            # One pass: a + b and b + a are the same bits, and torch adds a
            # half type in float32 and rounds once (as the float32 sum below
            # does). The float32 round trip and the copy took 3-4x the time
            # of a prefill step's [2048, hidden] bf16 sum (BENCHMARKS.md).
            x.add_(slots[1 - self.rank])
            return
        if x.dtype == torch.float32 and n >= 2:  # one rank: the copy below
            torch.add(slots[0], slots[1], out=x)
            for r in range(2, n):  # rank order: the same sum on every rank
                x.add_(slots[r])
            return
        total = slots[0].float()  # half types: summed in float32, rounded once
        for r in range(1, n):
            total.add_(slots[r])
        x.copy_(total)

    def _slots(self, buffer: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Each rank's slot of ``buffer`` as a 1-D tensor like ``x`` (kept: a decode
        step asks for the same few shapes, 2 x layers + 1 times)."""
        nbytes = x.numel() * x.element_size()
        key = (buffer, nbytes, x.dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 256:
                self._views.clear()
            first = buffer * self.world_size * self._slot
            views = self._views[key] = [self._bytes[first + r * self._slot: first + r * self._slot + nbytes]
                                        .view(x.dtype) for r in range(self.world_size)]
        return views

    def _wait(self, seq: int, name: str) -> None:
        flags = self._flags
        if flags.min() >= seq:
            return
        start = last_check = time.monotonic()
        nap = _NAP_S
        while flags.min() < seq:
            now = time.monotonic()
            if now - start < _SPIN_S:
                os.sched_yield()
            else:  # the peer is late (it shares our CPU, or is busy): let it run
                time.sleep(nap)
                nap = min(2 * nap, _MAX_NAP_S)
            if now - last_check >= _LIVENESS_EVERY_S:
                last_check = now
                self._check_peers(seq, now - start, name)

    def _check_peers(self, seq: int, waited: float, name: str) -> None:
        for r, pid in enumerate(self._pids):
            if self._flags[r] < seq and not _alive(pid):
                raise CollectiveError(f"rank {self.rank} of {self.world_size}: {name} failed: rank {r} "
                                      f"(pid {pid}) is gone")
        if waited > self.timeout_s:
            late = [r for r in range(self.world_size) if self._flags[r] < seq]
            raise CollectiveError(f"rank {self.rank} of {self.world_size}: {name} failed: rank(s) {late} did "
                                  f"not answer within {self.timeout_s:g}s")

    def close(self) -> None:
        self.native = self._flags = self._flag_tensor = self._bytes = None
        self._views.clear()
        try:
            self._shm.close()
        except BufferError:  # a view still held somewhere: the mapping goes with the process
            pass


# What the C++ ShmSums' errors start with (shm_sums.h: kShmError).
_NATIVE_ERROR = "shm collective: "


@contextlib.contextmanager
def native_errors() -> Iterator[None]:
    """A ShmSums call whose collective failed (a peer gone, the timeout)
    raises CollectiveError, as the Python wait does."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if _NATIVE_ERROR not in text:
            raise
        raise CollectiveError(text.split(_NATIVE_ERROR, 1)[1].splitlines()[0]) from e


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed child that its parent has not reaped yet is a zombie: gone too.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return False


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Keep multiprocessing's resource tracker from unlinking a segment this process only attached."""
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - the tracker's own key
    except Exception:  # noqa: BLE001 - only a warning at exit is at stake
        pass
