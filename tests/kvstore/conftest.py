import os
import uuid

import numpy as np
import pytest

from kvferry.kvstore.client import KVStoreClient
from kvferry.kvstore.service import GIB, start_store

BLOCK_NBYTES = 4096


def gb(num_blocks: int, block_nbytes: int = BLOCK_NBYTES) -> float:
    """GiB holding exactly ``num_blocks`` blocks (a power-of-two ratio: exact in a float)."""
    return num_blocks * block_nbytes / GIB


def block_bytes(seed: int, block_nbytes: int = BLOCK_NBYTES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, block_nbytes, dtype=np.uint8)


def key(i: int, tag: bytes = b"k") -> bytes:
    return tag + i.to_bytes(8, "little") + bytes(23)


def wait_loads(client: KVStoreClient, n: int = 1, timeout_s: float = 10.0):
    import time

    results = []
    deadline = time.monotonic() + timeout_s
    while len(results) < n:
        assert time.monotonic() < deadline, "loads did not finish"
        results += client.poll_loads()
        time.sleep(0.002)
    return results


@pytest.fixture
def address(tmp_path):
    return f"ipc://{tmp_path}/kvstore-{uuid.uuid4().hex[:6]}.sock"


@pytest.fixture
def store_factory(address):
    started = []

    def start(num_blocks: int = 16, *, block_nbytes: int | None = BLOCK_NBYTES, at: str | None = None, **kwargs):
        proc, addr = start_store(gb(num_blocks), address=at or address, block_nbytes=block_nbytes, **kwargs)
        started.append(proc)
        return proc, addr

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


@pytest.fixture
def clients():
    made = []

    def make(address: str, **kwargs) -> KVStoreClient:
        client = KVStoreClient(address, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def arena_files(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"kvferry-kvstore-{pid}-")]
