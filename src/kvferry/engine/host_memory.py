"""Keep a CPU engine's per-step temporaries in the heap, not in fresh pages.

A forward pass allocates and frees the same large tensors every step
(a 2048-token prefill's gate/up output alone is 12.6 MB; logits, norms and
attention outputs come and go too). glibc serves blocks above its mmap
threshold (dynamic, at most 32 MiB) with a fresh ``mmap`` and gives them
back with ``munmap`` on free, and it trims the heap's free top back to the
kernel; each time, the next step's first writes take a page fault per 4 KiB
page. In a VM a fault is expensive: on the 2-core development VM a
2048-token prefill step took 0.53-0.82 s from one run to the next with
glibc's defaults, and 0.545 s in every run with the settings below (minor
faults of a whole offline benchmark run: 33,000 -> 2,000).

``tune_malloc()`` raises the mmap threshold to 256 MiB and the trim
threshold to 1 GiB with ``mallopt``, once per process: a step's temporaries
then come from memory the process already holds. Larger blocks (the KV
cache itself) are still mapped and unmapped whole. The price is memory:
torch's aligned blocks do not always fit the hole a block of the same size
left, so the heap grows for a few steps before it reuses it (60 rounds of a
40 MiB tensor: 540 MB peak RSS against 260 MB, and 82,000 faults against
614,000). It does nothing off
glibc, when ``KVFERRY_MALLOC_TUNING=0``, or when the user tunes malloc
through the environment (``MALLOC_*_`` or ``GLIBC_TUNABLES``).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

from kvferry import envs

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 256 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_done = False


def tune_malloc() -> bool:
    """Apply the settings above once per process; True if they are in force."""
    global _done
    with _lock:
        if _done:
            return True
        if not _wanted():
            return False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
        if ok:
            logger.debug("malloc: mmap threshold %d MiB, trim threshold %d MiB",
                         MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
        _done = ok
        return ok


def _wanted() -> bool:
    if not envs.malloc_tuning():
        return False
    return not any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in os.environ)
