from __future__ import annotations

import uuid

import pytest

from kvferry.kvstore.crypto import TierCrypto
from tests.kvstore.mooncake_master import MooncakeMaster, mooncake_binary

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def crypto() -> TierCrypto:
    return TierCrypto(SECRET)


def block(i: int, nbytes: int = 6000) -> bytes:
    """Deterministic block bytes (distinct per i)."""
    rng = __import__("random").Random(i)
    return rng.randbytes(nbytes)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like a block hash


# -- the store service ----------------------------------------------------------------
@pytest.fixture
def address(tmp_path):
    return f"ipc://{tmp_path}/kvstore-{uuid.uuid4().hex[:6]}.sock"


@pytest.fixture
def store_factory(address):
    """Start store processes (terminated at the end); returns (process, address).
    ``kv_disk``, ``kv_disk_gb``, ``kv_remote``, ``kv_cluster``: the store's cold tiers."""
    from kvferry.config import KVTierConfig
    from kvferry.kvstore.launch import start_store
    from tests.kvstore.store_helpers import BLOCK_NBYTES, gb

    started = []

    def start(num_blocks: int = 16, *, block_nbytes: int | None = BLOCK_NBYTES, at: str | None = None,
              extra_args: list[str] | None = None, kv_disk: str = "", kv_disk_gb: float = 0.0,
              kv_remote: str = "", kv_cluster: str = "", **kwargs):
        tiers = KVTierConfig(kv_store=at or address, kv_dram_gb=gb(num_blocks), kv_disk=kv_disk,
                             kv_disk_gb=kv_disk_gb, kv_remote=kv_remote, kv_cluster=kv_cluster)
        proc, addr = start_store(tiers, block_nbytes=block_nbytes,
                                 extra_args=["--check-integrity", *(extra_args or [])], **kwargs)
        started.append(proc)
        return proc, addr

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            # 0: a clean shutdown with the DRAM index intact after every request
            assert proc.wait(10) == 0, f"the store exited with {proc.returncode}"


@pytest.fixture
def clients():
    """Make KVStoreClients (closed at the end)."""
    from kvferry.kvstore.client import KVStoreClient

    made = []

    def make(address: str, **kwargs) -> KVStoreClient:
        client = KVStoreClient(address, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


# -- the Mooncake pool ----------------------------------------------------------------
@pytest.fixture(scope="module")
def master(tmp_path_factory):
    """A mooncake_master on loopback, one per test module that asks for it."""
    mooncake_binary()  # skips, naming what is missing, without the package or its libraries
    srv = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    srv.start()
    yield srv
    srv.kill()
