"""The store's tier chain as real processes: DRAM evictions written back to
a real SSD directory (and to a real redis-server after enough reuse),
loads promoted back up bit-exact, corruption and restarts."""
import time
from pathlib import Path

import numpy as np
import pytest

from kvferry.kvstore.tier import BlockOwner
from tests.kvstore.conftest import SECRET
from tests.kvstore.store_helpers import block_bytes, gb, key, wait_loads

A = BlockOwner("acme")


def save(client, keys, owner, seeds):
    slots = client.reserve(keys, [owner] * len(keys))
    assert None not in slots, slots
    arena = client.arena()
    for slot, seed in zip(slots, seeds):
        arena[slot] = block_bytes(seed)
    client.commit(keys, slots)


def load(client, keys, owner=A):
    ticket = client.begin_load(keys, [owner] * len(keys))
    (result,) = wait_loads(client)
    assert result.ticket == ticket
    return result


def wait_written_back(client, n: int, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while client.stats().written_back < n:
        assert time.monotonic() < deadline, "write-back did not finish"
        time.sleep(0.01)


@pytest.fixture
def secret_file(tmp_path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return str(path)


def test_evicted_blocks_go_to_disk_and_come_back_bit_exact(store_factory, clients, tmp_path, secret_file):
    disk = tmp_path / "ssd"
    _, address = store_factory(8, kv_disk=str(disk), kv_disk_gb=gb(64), cache_secret_file=secret_file)
    client = clients(address)
    for i in range(14):
        save(client, [key(i)], A, [i])
    wait_written_back(client, 6)
    assert client.lookup([key(i) for i in range(14)]) == 14  # 0..5 on disk, 6..13 in DRAM
    # Bringing 0..5 up evicts 8..13, never 6 and 7: this load pinned them first.
    result = load(client, [key(i) for i in range(8)])
    assert len(result.slots) == 8
    arena = client.arena()
    for i, slot in enumerate(result.slots):
        np.testing.assert_array_equal(arena[slot], block_bytes(i))
    client.release(result.ticket)
    stats = client.stats()
    assert stats.tiers["disk"].hits == 6 and stats.tiers["dram"].misses == 6 and stats.tiers["dram"].hits == 2
    assert stats.tiers["dram"].per_tenant["acme"].misses == 6


def test_the_disk_tier_survives_a_store_restart(store_factory, clients, tmp_path, secret_file):
    disk = tmp_path / "ssd"
    proc, address = store_factory(2, kv_disk=str(disk), kv_disk_gb=gb(64), cache_secret_file=secret_file)
    client = clients(address, timeout_s=0.3)
    for i in range(6):
        save(client, [key(i)], A, [i])
    wait_written_back(client, 4)
    proc.terminate()
    assert proc.wait(10) == 0
    store_factory(2, kv_disk=str(disk), kv_disk_gb=gb(64), cache_secret_file=secret_file)
    deadline = time.monotonic() + 5
    while not client.connected:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.lookup([key(i) for i in range(4)]) == 4
    result = load(client, [key(0), key(1)])
    for i, slot in enumerate(result.slots):
        np.testing.assert_array_equal(client.arena()[slot], block_bytes(i))


def test_a_corrupted_block_on_disk_ends_the_load_there_and_is_quarantined(store_factory, clients, tmp_path,
                                                                          secret_file):
    disk = tmp_path / "ssd"
    _, address = store_factory(4, kv_disk=str(disk), kv_disk_gb=gb(64), cache_secret_file=secret_file)
    client = clients(address)
    for i in range(8):
        save(client, [key(i)], A, [i])
    wait_written_back(client, 4)  # 0..3 on disk, in slab slots 0..3 (written in eviction order)
    (slab,) = disk.glob("slab-*.dat")
    slot_bytes = int(slab.name.split("-")[1].split(".")[0])
    with open(slab, "r+b") as f:
        f.seek(2 * slot_bytes + slot_bytes // 2)  # inside key(2)'s payload
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = load(client, [key(i) for i in range(4)])
    assert len(result.slots) == 2  # the run stops at the corrupted block: the engine recomputes from there
    for i, slot in enumerate(result.slots):
        np.testing.assert_array_equal(client.arena()[slot], block_bytes(i))
    client.release(result.ticket)
    stats = client.stats()
    assert stats.tiers["disk"].quarantined == 1
    assert client.lookup([key(2)]) == 0  # never served again
    # 0, 1 and 3 came up (3 past the run, unpinned at once); 2's slot was freed.
    assert stats.pinned_slots == 0 and stats.used_slots == 3


def test_retained_blocks_are_demoted_to_disk_not_dropped(store_factory, clients, tmp_path, secret_file):
    _, address = store_factory(4, kv_disk=str(tmp_path / "ssd"), kv_disk_gb=gb(64), cache_secret_file=secret_file)
    client = clients(address)
    save(client, [key(0), key(1)], A, [0, 1])
    assert client.retain([key(0), key(1)], A, 60) == 2
    for i in range(2, 12):
        save(client, [key(i)], A, [i])
    wait_written_back(client, 8)
    # 2..9 were unretained and older than the newest: they went first.
    assert client.lookup([key(0), key(1)]) == 2
    assert client.stats().tiers["disk"].num_blocks >= 6


def test_only_reused_blocks_reach_the_remote_tier(store_factory, clients, tmp_path, secret_file):
    from tests.kvstore.redis_server import RedisServer

    redis = RedisServer(tmp_path)
    redis.start()
    try:
        _, address = store_factory(2, kv_remote=redis.url, cache_secret_file=secret_file,
                                   extra_args=["--remote-min-hits", "1"])
        client = clients(address)
        save(client, [key(0), key(1)], A, [0, 1])
        client.release(load(client, [key(0)]).ticket)  # key(0) served one load; key(1) none
        save(client, [key(2), key(3)], A, [2, 3])  # evicts both
        wait_written_back(client, 2)
        remote = client.stats().tiers["remote"]
        assert remote.num_blocks == 1
        assert client.lookup([key(0)]) == 1 and client.lookup([key(1)]) == 0

        # Another node's store with the same remote (and secret) finds it.
        _, other_address = store_factory(2, at=address + "-node2", kv_remote=redis.url, cache_secret_file=secret_file)
        other = clients(other_address)
        result = load(other, [key(0)])
        np.testing.assert_array_equal(other.arena()[result.slots[0]], block_bytes(0))
    finally:
        redis.kill()


def test_a_redis_outage_leaves_dram_and_disk_serving(store_factory, clients, tmp_path, secret_file):
    from tests.kvstore.redis_server import RedisServer

    redis = RedisServer(tmp_path)
    redis.start()
    try:
        _, address = store_factory(2, kv_disk=str(tmp_path / "ssd"), kv_disk_gb=gb(64), kv_remote=redis.url,
                                   cache_secret_file=secret_file, extra_args=["--remote-min-hits", "0"])
        client = clients(address)
        redis.kill()
        for i in range(6):  # evictions go to disk; the remote writes fail and are counted
            save(client, [key(i)], A, [i])
        wait_written_back(client, 4)
        assert client.lookup([key(i) for i in range(6)]) == 6
        result = load(client, [key(0), key(1)])
        for i, slot in enumerate(result.slots):
            np.testing.assert_array_equal(client.arena()[slot], block_bytes(i))
        client.release(result.ticket)
        assert client.lookup([key(99)]) == 0  # a miss everywhere asks the dead remote too, and answers
        stats = client.stats()
        assert stats.tiers["remote"].refused_writes >= 1 and stats.tiers["remote"].num_blocks == 0
    finally:
        redis.kill()


def test_loading_a_block_that_is_being_written_again_is_a_miss_not_a_crash(store_factory, clients, tmp_path,
                                                                         secret_file):
    _, address = store_factory(3, kv_disk=str(tmp_path / "ssd"), kv_disk_gb=gb(64), cache_secret_file=secret_file)
    writer, reader = clients(address), clients(address)
    for i in range(4):
        save(writer, [key(i)], A, [i])
    wait_written_back(writer, 1)  # key(0) is on disk only; 1, 2, 3 in DRAM
    (slot,) = writer.reserve([key(0)], [A])  # key(0) is being written into DRAM again (1 goes)
    assert slot is not None
    result = load(reader, [key(2), key(0)])
    assert len(result.slots) == 1  # the run ends at the block being written
    reader.release(result.ticket)
    assert reader.stats().pinned_slots == 0
    writer.arena()[slot] = block_bytes(0)
    writer.commit([key(0)], [slot])
    result = load(reader, [key(0)])
    np.testing.assert_array_equal(reader.arena()[result.slots[0]], block_bytes(0))
