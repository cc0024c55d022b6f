"""Transfer buffers for the cluster tier (``cluster.py``): memory registered
with the Mooncake client, cut into equal slots of one value each.

Mooncake's ``batch_put_from``/``batch_get_into`` move values straight
between registered memory and the pool's segments. The tier encodes a
block (header, MAC, payload sealed in place) into a slot and puts it
from there, and reads values into slots to check and open them there: no
value passes through the client's own buffer, and no fresh buffer of a
block's size is made per value (page faults of new memory, not AES-GCM or
the MAC, were most of the cost of one block per call).

Slots are sized from the largest value seen (a node's blocks share one
size); a value that does not fit makes the next buffer bigger.
"""
from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Any

# One buffer holds at most this many values (a batch) and this many bytes.
MAX_SLOTS = 32
MAX_BUFFER_BYTES = 64 << 20
# Read buffers kept (one per concurrent get_many: the store's load threads).
MAX_READ_BUFFERS = 4
_PAGE = 4096


def slot_size(value_nbytes: int) -> int:
    """A slot for values up to ``value_nbytes``, whole pages."""
    return -(-max(value_nbytes, 1) // _PAGE) * _PAGE


class RegisteredBuffer:
    """Anonymous memory registered with one Mooncake client. The first page
    holds the one-byte marker value (``marker_ptr``); ``slots`` values of
    ``slot_nbytes`` follow."""

    def __init__(self, store: Any, slot_nbytes: int, marker: bytes = b"\x01") -> None:
        self.slot_nbytes = slot_nbytes
        self.slots = max(1, min(MAX_SLOTS, MAX_BUFFER_BYTES // slot_nbytes))
        self.nbytes = _PAGE + self.slots * slot_nbytes
        self._mem = mmap.mmap(-1, self.nbytes)
        self._anchor = ctypes.c_char.from_buffer(self._mem)  # holds the address for the buffer's life
        self.ptr = ctypes.addressof(self._anchor)
        self.view = memoryview(self._mem)
        self.view[:len(marker)] = marker
        self.marker_ptr = self.ptr
        rc = store.register_buffer(self.ptr, self.nbytes)
        if rc != 0:
            raise OSError(f"register_buffer returned {rc}")
        self._store = store

    def slot(self, i: int) -> memoryview:
        start = _PAGE + i * self.slot_nbytes
        return self.view[start:start + self.slot_nbytes]

    def slot_ptr(self, i: int) -> int:
        return self.ptr + _PAGE + i * self.slot_nbytes

    def release(self) -> None:
        """Unregister (the memory itself goes with the last reference)."""
        try:
            self._store.unregister_buffer(self.ptr)
        except Exception:
            pass


class BufferPool:
    """Registered buffers for one client: one for writes (callers hold
    ``write_lock``), up to ``MAX_READ_BUFFERS`` for concurrent reads."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()
        self.write_lock = threading.Lock()
        self._writer: RegisteredBuffer | None = None
        self._free: list[RegisteredBuffer] = []
        self._reads = 0  # read buffers made and not released
        self._closed = False

    def writer(self, value_nbytes: int) -> RegisteredBuffer:
        """The write buffer, with slots for values of ``value_nbytes`` (under ``write_lock``)."""
        if self._writer is None or self._writer.slot_nbytes < value_nbytes:
            if self._writer is not None:
                self._writer.release()
            self._writer = None
            self._writer = RegisteredBuffer(self._store, slot_size(value_nbytes))
        return self._writer

    def take_reader(self, value_nbytes: int) -> RegisteredBuffer | None:
        """A read buffer with slots for ``value_nbytes``, or None when every
        one is in use (the caller falls back to the client's own calls)."""
        with self._lock:
            if self._closed:
                return None
            while self._free:
                buf = self._free.pop()
                if buf.slot_nbytes >= value_nbytes:
                    return buf
                buf.release()
                self._reads -= 1
            if self._reads >= MAX_READ_BUFFERS:
                return None
            self._reads += 1
        try:
            return RegisteredBuffer(self._store, slot_size(value_nbytes))
        except Exception:
            with self._lock:
                self._reads -= 1
            raise

    def give_back(self, buf: RegisteredBuffer) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(buf)
                return
            self._reads -= 1
        buf.release()

    def close(self) -> None:
        with self.write_lock, self._lock:
            self._closed = True
            for buf in self._free + ([self._writer] if self._writer else []):
                buf.release()
            self._free, self._writer = [], None
