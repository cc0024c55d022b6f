"""ColdChain in process, over a real DiskTier whose writes are held at a
gate: a block waiting for write-back stays findable and loadable, and a
dropped tenant's pending write-backs never land."""
import threading
import time

import numpy as np

from kvferry.kvstore.arena import Arena
from kvferry.kvstore.chain import ColdChain
from kvferry.kvstore.crypto import TierCrypto
from kvferry.kvstore.disk import DiskTier
from kvferry.kvstore.policy import Entry, State
from kvferry.kvstore.tier import BlockOwner
from tests.kvstore.conftest import SECRET, key

NBYTES = 4096
A, B = BlockOwner("acme"), BlockOwner("bolt")


class GatedDisk(DiskTier):
    """The real disk tier; each put waits for the gate first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def put(self, key, data, owner):
        self.gate.wait(10)
        return super().put(key, data, owner)


def setup(tmp_path):
    arena = Arena.create(4, NBYTES, tmp_path)
    disk = GatedDisk(tmp_path / "ssd", 1 << 20, crypto=TierCrypto(SECRET))
    return arena, disk, ColdChain([disk], io_threads=1)


def wait(predicate):
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_block_waiting_for_write_back_is_found_and_loaded_from_memory(tmp_path):
    arena, disk, chain = setup(tmp_path)
    try:
        arena.view[0] = 7
        chain.write_back(Entry(key(1), 0, A, State.READY), arena)
        arena.view[0] = 0  # the slot is reused at once
        assert chain.contains(key(1)) and not disk.contains(key(1))
        chain.start_load([Entry(key(1), 2, A, State.LOADING)], arena)
        chain.start_load([Entry(key(1), 3, B, State.LOADING)], arena)  # bolt may not read acme's block
        done = []
        wait(lambda: done.extend(chain.completions()) or len(done) == 2)
        assert [(e.slot, ok) for e, ok in done] == [(2, True), (3, False)]
        assert (arena.view[2] == 7).all()
        disk.gate.set()
        wait(lambda: chain.written_back == 1)
        assert disk.contains(key(1)) and disk.get(key(1), A) == bytes([7]) * NBYTES
    finally:
        disk.gate.set()
        chain.close()
        arena.close()


def test_a_dropped_tenants_pending_write_backs_never_land(tmp_path):
    arena, disk, chain = setup(tmp_path)
    try:
        chain.write_back(Entry(key(1), 0, A, State.READY), arena)  # taken by the writer, held at the gate
        chain.write_back(Entry(key(2), 1, A, State.READY), arena)  # still queued
        chain.write_back(Entry(key(3), 2, B, State.READY), arena)
        time.sleep(0.1)
        chain.drop_tenant("acme")
        assert not chain.contains(key(2))
        disk.gate.set()
        wait(lambda: disk.contains(key(3)))
        chain.close()
        assert not disk.contains(key(1)) and not disk.contains(key(2))
    finally:
        disk.gate.set()
        chain.close()
        arena.close()
