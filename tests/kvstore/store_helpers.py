"""Helpers of the store service tests: sizes, block bytes, keys, waiting."""
import os
import time

import numpy as np

from kvferry.kvstore.client import KVStoreClient
from kvferry.kvstore.service import GIB

BLOCK_NBYTES = 4096


def gb(num_blocks: int, block_nbytes: int = BLOCK_NBYTES) -> float:
    """GiB holding exactly ``num_blocks`` blocks (a power-of-two ratio: exact in a float)."""
    return num_blocks * block_nbytes / GIB


def block_bytes(seed: int, block_nbytes: int = BLOCK_NBYTES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, block_nbytes, dtype=np.uint8)


def key(i: int, tag: bytes = b"k") -> bytes:
    return tag + i.to_bytes(8, "little") + bytes(23)


def wait_loads(client: KVStoreClient, n: int = 1, timeout_s: float = 10.0):
    results = []
    deadline = time.monotonic() + timeout_s
    while len(results) < n:
        assert time.monotonic() < deadline, "loads did not finish"
        results += client.poll_loads()
        time.sleep(0.002)
    return results


def arena_files(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"kvferry-kvstore-{pid}-")]
