"""Fixtures the parallel modules share."""
from __future__ import annotations

import pytest

from kvferry.config import KVTierConfig
from kvferry.kvstore.launch import start_store


@pytest.fixture(scope="module")
def store():
    """A real `kvferry kvstore` with a small DRAM tier, one per module: its address."""
    process, address = start_store(KVTierConfig(kv_dram_gb=0.02))
    yield address
    process.terminate()
    process.wait(timeout=10)
