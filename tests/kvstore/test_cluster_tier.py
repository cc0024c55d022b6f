"""The cluster KV pool (Mooncake Store) against a real mooncake_master on
loopback: the tier's round trip with sealing and tenants, two node stores
sharing blocks through one pool, and a master killed under a store."""
from __future__ import annotations

import time

import numpy as np
import pytest
import xxhash

from kvferry.kvstore.crypto import TENANT_TAG_BYTES, TierCrypto, tenant_tag
from kvferry.kvstore.tier import BlockOwner
from tests.kvstore.conftest import SECRET, block, key
from tests.kvstore.mooncake_master import MooncakeMaster, mooncake_binary
from tests.kvstore.store_helpers import block_bytes, wait_loads
from tests.kvstore.store_helpers import key as store_key

ACME = BlockOwner("acme")
BETA = BlockOwner("beta")
PUBLIC = BlockOwner("acme", public=True)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    mooncake_binary()  # skips, naming what is missing, without the package or its libraries
    srv = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def nodes(master):
    """Two nodes' tiers on one pool (the same secret, as nodes of one cluster)."""
    from kvferry.kvstore.cluster import MooncakeTier

    a = MooncakeTier(master.url + "&namespace=tier", crypto=TierCrypto(SECRET))
    b = MooncakeTier(master.url + "&namespace=tier", crypto=TierCrypto(SECRET))
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def secret_file(tmp_path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return str(path)


def forge(key_: bytes, tenant: str, sealed_payload: bytes) -> bytes:
    """A value labelled as ``tenant``'s with a valid checksum: what anyone
    with access to the pool (who cannot open the blocks) could write."""
    tag = tenant_tag(TierCrypto(SECRET), tenant)
    header = b"KVFR" + bytes([2, 2]) + len(tag).to_bytes(2, "little")
    h = xxhash.xxh3_128()
    for part in (key_, header, tag, sealed_payload):
        h.update(part)
    return header + tag + h.digest() + sealed_payload


def test_round_trip_across_nodes_sealed_and_per_tenant(nodes):
    a, b = nodes
    assert a.put(key(1), block(1, 70_000), ACME)
    assert a.put(key(2), memoryview(block(2)), PUBLIC)
    # Another node reads what this one wrote, bit-exact, as the same tenant.
    assert b.get_many([key(1), key(3)], ACME) == [block(1, 70_000), None]
    assert b.get(key(2), BlockOwner("beta", public=True)) == block(2)  # public: every tenant's
    assert b.get(key(1), BETA) is None  # private: another tenant's is a miss
    assert a.contains(key(1)) and b.contains(key(2)) and not b.contains(key(3))
    # At rest a private block is sealed, a public one in the clear.
    raw_private = a._store.get(a.object_key(key(1), ACME))
    assert len(raw_private) > 70_000 and block(1, 70_000)[:256] not in raw_private
    assert block(2)[:256] in a._store.get(a.object_key(key(2), PUBLIC))
    stats = b.stats()
    assert (stats.hits, stats.misses) == (2, 2) and stats.per_tenant["acme"].hits == 1
    assert a.stats().bytes_written == 70_000 + len(block(2))


def test_another_tenants_key_cannot_open_a_private_block(nodes):
    a, b = nodes
    assert a.put(key(10), block(10), ACME)
    sealed = a._store.get(a.object_key(key(10), ACME))[8 + TENANT_TAG_BYTES + 16:]
    before = b.stats()
    # Relabelled as beta's and put under beta's key: beta's AES key fails.
    assert a._store.upsert(b.object_key(key(10), BETA), forge(key(10), "beta", sealed)) == 0
    assert b.get(key(10), BETA) is None
    # Moved under another block key of acme's: bound to its key, it fails too.
    assert a._store.upsert(a.object_key(key(11), ACME), forge(key(11), "acme", sealed)) == 0
    assert b.get(key(11), ACME) is None
    after = b.stats()
    assert after.auth_failures - before.auth_failures == 2
    assert after.quarantined - before.quarantined == 2  # both forgeries removed from the pool
    assert a._store.is_exist(b.object_key(key(10), BETA)) == 0
    assert b.get(key(10), ACME) == block(10)  # the real one is untouched


def test_drop_tenant_reaches_what_any_node_wrote(nodes):
    a, b = nodes
    assert a.put(key(20), block(20), ACME) and b.put(key(21), block(21), ACME)
    assert a.put(key(22), block(22), BETA) and a.put(key(23), block(23), PUBLIC)
    assert b.drop_tenant("acme") == 2
    assert a.get_many([key(20), key(21)], ACME) == [None, None]
    assert a.get(key(22), BETA) == block(22) and a.get(key(23), PUBLIC) == block(23)
    # A block dropped and computed again is written again.
    assert a.put(key(20), block(20), ACME) and b.get(key(20), ACME) == block(20)


def test_bad_urls_name_the_field():
    from kvferry.config import KVTierConfig
    from kvferry.kvstore.cluster import PoolAddress

    for url in ("redis://h:1", "mooncake://host", "mooncake://h:1?segment_gb=0", "mooncake://h:1?protocol=udp",
                "mooncake://h:1?colour=red", "mooncake://h:x"):
        with pytest.raises(ValueError, match="kv_cluster"):
            PoolAddress.parse(url)
    addr = PoolAddress.parse("mooncake://10.0.0.1:50051?segment_gb=2&buffer_mb=64")
    assert addr.metadata == "http://10.0.0.1:8080/metadata" and addr.segment_bytes == 2 << 30
    # --kv-cluster alone starts a store with the default DRAM size.
    assert KVTierConfig(kv_cluster="mooncake://h:1").kv_dram_gb > 0


# -- node stores ----------------------------------------------------------------------
def save(client, keys, owner, seeds):
    slots = client.reserve(keys, [owner] * len(keys))
    assert None not in slots, slots
    arena = client.arena()
    for slot, seed in zip(slots, seeds):
        arena[slot] = block_bytes(seed)
    client.commit(keys, slots)


def load(client, keys, owner):
    ticket = client.begin_load(keys, [owner] * len(keys))
    (result,) = wait_loads(client)
    assert result.ticket == ticket
    client.release(ticket)
    return result


def wait_for(condition, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_two_node_stores_share_blocks_through_the_pool(master, store_factory, clients, secret_file, tmp_path):
    url = master.url + "&namespace=stores"
    _, address_a = store_factory(16, at=f"ipc://{tmp_path}/a.sock", kv_cluster=url, cache_secret_file=secret_file)
    _, address_b = store_factory(16, at=f"ipc://{tmp_path}/b.sock", kv_cluster=url, cache_secret_file=secret_file)
    a, b = clients(address_a), clients(address_b)
    keys = [store_key(i, b"pool") for i in range(3)]
    save(a, keys, ACME, [0, 1, 2])  # written through to the pool at commit
    wait_for(lambda: b.lookup(keys) == 3, "store B never saw store A's blocks in the pool")
    # Another tenant: the pool holds a block of that hash, but not beta's.
    assert load(b, keys, BETA).slots == []
    result = load(b, keys, ACME)
    assert len(result.slots) == 3
    arena = b.arena()
    for seed, slot in enumerate(result.slots):
        np.testing.assert_array_equal(arena[slot], block_bytes(seed))
    cluster = b.stats().tiers["cluster"]
    assert cluster.hits == 3 and cluster.misses >= 1
    assert cluster.per_tenant["acme"].hits == 3 and cluster.per_tenant["beta"].hits == 0
    assert a.stats().tiers["cluster"].bytes_written == 3 * len(block_bytes(0))


def test_a_killed_master_leaves_the_store_answering_misses(tmp_path, store_factory, clients, secret_file, capfd):
    master = MooncakeMaster(tmp_path)
    master.start()
    try:
        url = master.url + "&namespace=outage"
        _, address_a = store_factory(16, at=f"ipc://{tmp_path}/a.sock", kv_cluster=url,
                                     cache_secret_file=secret_file)
        _, address_b = store_factory(16, at=f"ipc://{tmp_path}/b.sock", kv_cluster=url,
                                     cache_secret_file=secret_file)
        a, b = clients(address_a), clients(address_b)
        keys = [store_key(i, b"out") for i in range(2)]
        save(a, keys, ACME, [5, 6])
        wait_for(lambda: b.lookup(keys) == 2, "the blocks never reached the pool")
        master.kill()
        # Store B answers: the pool's blocks are misses now, its load short.
        assert load(b, keys, ACME).slots == []
        assert b.lookup(keys) == 0
        more = [store_key(i, b"late") for i in range(2)]
        save(b, more, ACME, [7, 8])  # committed to DRAM; the pool refuses the write-through
        result = load(b, more, ACME)
        assert len(result.slots) == 2  # DRAM still serves
        wait_for(lambda: b.stats().tiers["cluster"].refused_writes >= 1, "the write-through was not refused")
        # The master comes back (empty: no HA): the client reconnects and
        # write-through resumes.
        master.start()
        again = [store_key(i, b"again") for i in range(8)]
        for i, k in enumerate(again):
            save(b, [k], ACME, [20 + i])
            if a.lookup([again[0]]) == 1:
                break
            time.sleep(1.0)
        wait_for(lambda: a.lookup([again[0]]) == 1, "the pool never came back", timeout_s=40)
        err = capfd.readouterr().err
        # One warning per outage from each store that saw it, not one per
        # call (nor the client library's own lines per failed RPC).
        assert 1 <= err.count("is unreachable") <= 2, err[-3000:]
        assert "RPC call failed" not in err
        assert "is back" in err
    finally:
        master.kill()
