"""The cluster KV pool (Mooncake Store) against a real mooncake_master on
loopback: the tier's round trip with sealing and tenants, two node stores
sharing blocks through one pool, and a master killed under a store."""
from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
import xxhash

from kvferry.kvstore.crypto import MAC_BYTES, TierCrypto, tenant_tag
from kvferry.kvstore.tier import BlockOwner
from tests.kvstore.conftest import SECRET, block, key
from tests.kvstore.mooncake_master import MooncakeMaster
from tests.kvstore.store_helpers import block_bytes, wait_loads
from tests.kvstore.store_helpers import key as store_key

ACME = BlockOwner("acme")
BETA = BlockOwner("beta")
PUBLIC = BlockOwner("acme", public=True)


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
    sealed = a._store.get(a.object_key(key(10), ACME))[8 + MAC_BYTES + 16:]
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


def test_a_purge_on_every_node_removes_what_each_wrote(nodes):
    """Object names are opaque: each node removes the tenant's blocks it
    wrote (a purge reaches every node store)."""
    a, b = nodes
    gamma = BlockOwner("gamma")
    assert a.put(key(20), block(20), gamma) and b.put(key(21), block(21), gamma)
    assert a.put(key(22), block(22), BETA) and a.put(key(23), block(23), PUBLIC)
    assert b.drop_tenant("gamma") == 1 and a.drop_tenant("gamma") == 1
    assert a.get_many([key(20), key(21)], gamma) == [None, None]
    assert a.get(key(22), BETA) == block(22) and a.get(key(23), PUBLIC) == block(23)
    # A block dropped and computed again is written again.
    assert a.put(key(20), block(20), gamma) and b.get(key(20), gamma) == block(20)


def test_put_many_writes_each_block_once_and_restores_a_lost_marker(nodes):
    a, b = nodes
    items = [(key(30 + i), block(30 + i), ACME if i % 2 else PUBLIC) for i in range(5)]
    before_a, before_b = a.stats().bytes_written, b.stats().bytes_written
    assert a.put_many(items) == [True] * 5
    assert a.stats().bytes_written - before_a == 5 * 6000
    # Another node computing the same blocks: the pool holds them already.
    assert b.put_many(items) == [True] * 5 and b.stats().bytes_written == before_b
    # A marker evicted: the block is not found until a write puts it back.
    assert a._store.remove(a._marker_key(key(30)), True) == 0 and not b.contains(key(30))
    assert b.put_many(items[:2]) == [True, True] and b.contains(key(30))
    assert b.stats().bytes_written == before_b  # the marker alone went again
    assert b.get_many([key(30), key(31)], PUBLIC) == [block(30), None]  # key 31 is acme's


def test_get_into_opens_each_block_in_place(nodes):
    a, b = nodes
    assert a.put_many([(key(40), block(40), ACME), (key(41), block(41), PUBLIC)]) == [True, True]
    slots = [memoryview(bytearray(6000)) for _ in range(3)]
    assert b.get_into([key(40), key(42)], ACME, slots[:2]) == [True, False]
    assert bytes(slots[0]) == block(40)
    assert b.get_into([key(41)], PUBLIC, slots[2:]) == [True] and bytes(slots[2]) == block(41)
    # A block of another size than the slot is a miss, sealed or not.
    assert b.get_into([key(40)], ACME, [memoryview(bytearray(5999))]) == [False]
    assert b.get_into([key(41)], PUBLIC, [memoryview(bytearray(6001))]) == [False]
    # A forgery (relabelled, put under beta's key) fails its tag in place too.
    sealed = a._store.get(a.object_key(key(40), ACME))[8 + MAC_BYTES + 16:]
    assert a._store.upsert(b.object_key(key(40), BETA), forge(key(40), "beta", sealed)) == 0
    failures = b.stats().auth_failures
    assert b.get_into([key(40)], BETA, slots[:1]) == [False] and b.stats().auth_failures == failures + 1


def test_bad_urls_name_the_field():
    from kvferry.config import KVTierConfig
    from kvferry.kvstore.pool_address import PoolAddress

    for url in ("redis://h:1", "mooncake://host", "mooncake://h:1?segment_gb=-1", "mooncake://h:1?buffer_mb=0",
                "mooncake://h:1?protocol=udp", "mooncake://h:1?colour=red", "mooncake://h:x"):
        with pytest.raises(ValueError, match="kv_cluster"):
            PoolAddress.parse(url)
    addr = PoolAddress.parse("mooncake://10.0.0.1:50051?segment_gb=2&buffer_mb=64")
    assert addr.metadata == "http://10.0.0.1:8080/metadata" and addr.segment_bytes == 2 << 30
    # --kv-cluster alone starts a store with the default DRAM size.
    assert KVTierConfig(kv_cluster="mooncake://h:1").kv_dram_gb > 0


def test_auto_is_checked_and_refused_outside_serve_ray(tmp_path):
    """``--kv-cluster auto``: its options are checked where it is given, and
    anything that would connect to it (a store, a server without --ray)
    refuses it with the reason; only kvferry serve --ray resolves it
    (tests/fleet/test_cluster_master.py)."""
    import subprocess
    import sys

    from kvferry.config import EngineArgs, KVTierConfig
    from kvferry.kvstore.pool_address import auto_url
    from kvferry.kvstore.launch import start_store

    assert KVTierConfig(kv_cluster="auto").kv_dram_gb > 0
    assert EngineArgs(kv_cluster="auto?segment_gb=0.5&buffer_mb=32").kv_cluster.startswith("auto")
    for value, named in (("auto?segment_gb=-1", "segment_gb must be >= 0"), ("auto?colour=red", "unknown option"),
                         ("auto?metadata=http://h:1/metadata", "drop the metadata option")):
        with pytest.raises(ValueError, match=f"kv_cluster: .*{named}"):
            KVTierConfig(kv_cluster=value)
    assert (auto_url("auto?segment_gb=0.5", "10.0.0.7", 5001, 5002)
            == "mooncake://10.0.0.7:5001?metadata=http://10.0.0.7:5002/metadata&segment_gb=0.5")
    with pytest.raises(ValueError, match="kv_cluster: 'auto' .*needs kvferry serve --ray"):
        start_store(KVTierConfig(kv_dram_gb=0.01, kv_cluster="auto"))
    proc = subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", "--kv-cluster", "auto"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs kvferry serve --ray" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("broken, named", [("libs", r"libibverbs\.so\.1 not found \(apt-get install"),
                                           ("package", r"mooncake package is not installed: pip install")])
def test_a_store_without_mooncake_names_what_is_missing(tmp_path, monkeypatch, secret_file, broken, named):
    """No Mooncake needed: a ``mooncake`` earlier on the path stands in for
    a machine without the package, or without the libraries it loads."""
    import subprocess
    import sys

    from kvferry.config import KVTierConfig
    from kvferry.kvstore.launch import start_store

    if broken == "libs":
        (tmp_path / "mooncake").mkdir()
        (tmp_path / "mooncake" / "__init__.py").write_text("")
        (tmp_path / "mooncake" / "store.py").write_text(
            'raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")')
    else:
        (tmp_path / "mooncake.py").write_text("")  # a module, not the package: no mooncake.store
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    url = "mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2/metadata"
    # Starting one for a server or an engine: refused before the child starts.
    with pytest.raises(ValueError, match="kv_cluster: .*" + named):
        start_store(KVTierConfig(kv_dram_gb=0.01, kv_cluster=url))
    # kvferry kvstore itself: exit 2 with the reason.
    proc = subprocess.run([sys.executable, "-m", "kvferry.kvstore.service", "--address", f"ipc://{tmp_path}/s.sock",
                           "--kv-dram-gb", "0.01", "--kv-cluster", url, "--cache-secret-file", secret_file],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and re.search(named, proc.stderr), proc.stderr


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


def test_a_clean_stop_flushes_the_pending_writes(master, store_factory, clients, secret_file):
    from kvferry.kvstore.cluster import MooncakeTier

    url = master.url + "&namespace=flush"
    # The blocks live in the other node's segment: a store lending the pool
    # nothing (segment_gb=0), so that they outlive it.
    reader = MooncakeTier(url, crypto=TierCrypto(SECRET))
    try:
        proc, address = store_factory(16, kv_cluster=url + "&segment_gb=0", cache_secret_file=secret_file)
        client = clients(address)
        keys = [store_key(i, b"flush") for i in range(6)]
        save(client, keys, ACME, range(6))
        proc.terminate()  # at once: the write-throughs may still be queued
        assert proc.wait(20) == 0
        assert reader.get_many(keys, ACME) == [block_bytes(i).tobytes() for i in range(6)]
    finally:
        reader.close()


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
        # Blocks committed until the pool takes one again (the client first
        # mounts its segment on the new master).
        deadline = time.monotonic() + 40
        for i in range(1000):
            assert time.monotonic() < deadline, f"the pool never came back: {b.stats().tiers['cluster']}"
            k = store_key(i, b"again")
            save(b, [k], ACME, [20 + i % 8])
            time.sleep(0.5)
            if a.lookup([k]) == 1:
                break
        err = capfd.readouterr().err
        # One warning per outage from each store that saw it, not one per call.
        assert 1 <= err.count("is unreachable") <= 2, err[-3000:]
        assert "is back" in err
    finally:
        master.kill()


# -- engines on two nodes --------------------------------------------------------------
def test_a_prompt_computed_on_one_node_is_a_hit_on_another(master, tmp_path, secret_file):
    """Two engines, each on its own node store, the stores on one pool:
    the second engine loads the prompt the first computed, and its greedy
    output is HF's."""
    import random

    from kvferry import LLM, SamplingParams
    from kvferry.config import KVTierConfig
    from kvferry.kvstore.client import KVStoreClient
    from kvferry.kvstore.launch import start_store
    from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
    from tests.tiny_models import make_tiny_checkpoint

    block, max_new = 8, 8
    greedy = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    path = str(make_tiny_checkpoint(tmp_path / "model", arch="llama", max_position_embeddings=256))
    hf = load_hf(path)
    rng = random.Random(3)
    prompt = [rng.randrange(3, hf.config.vocab_size) for _ in range(70)]
    tiers = KVTierConfig(kv_dram_gb=0.02, kv_cluster=master.url + "&namespace=engines")
    stores = [start_store(tiers, cache_secret_file=secret_file) for _ in range(2)]
    try:
        (_, address_a), (_, address_b) = stores
        first = LLM(model=path, dtype="float32", block_size=block, num_kv_blocks=64, kv_store=address_a)
        out_a = first.generate([prompt], greedy)[0]
        first.engine.core.close()
        written = (len(prompt) + max_new - 1) // block
        with KVStoreClient(address_a) as client:
            wait_for(lambda: client.stats().tiers["cluster"].bytes_written >= written * client.stats().block_nbytes,
                     "the first node's blocks never reached the pool")
        second = LLM(model=path, dtype="float32", block_size=block, num_kv_blocks=64, kv_store=address_b)
        out_b = second.generate([prompt], greedy)[0]
        second.engine.core.close()
        assert out_b.token_ids == out_a.token_ids
        assert_greedy_match(hf, prompt, out_b.token_ids, hf_greedy(hf, prompt, max_new))
        loaded = (len(prompt) - 1) // block * block
        assert out_b.num_cached_tokens == loaded
        with KVStoreClient(address_b) as client:
            assert client.stats().tiers["cluster"].hits == loaded // block
    finally:
        for process, _ in stores:
            process.terminate()
            assert process.wait(timeout=10) == 0


def test_a_master_absent_at_start_is_joined_when_it_comes(tmp_path, store_factory, clients, secret_file):
    master = MooncakeMaster(tmp_path)  # ports chosen, nothing listening yet
    try:
        url = master.url + "&namespace=late"
        start = time.monotonic()
        _, address = store_factory(16, kv_cluster=url, cache_secret_file=secret_file)
        assert time.monotonic() - start < 10  # serves at once, not after the client's own retries
        client = clients(address)
        keys = [store_key(i, b"early") for i in range(2)]
        save(client, keys, ACME, [1, 2])
        assert client.stats().tiers["cluster"].hits == 0 and client.lookup(keys) == 2  # DRAM serves
        master.start()
        # Blocks committed until the pool takes one (the store probes the
        # master with backoff: 1, 2, 4 s).
        deadline = time.monotonic() + 30
        for i in range(1000):
            assert time.monotonic() < deadline, f"never joined the pool: {client.stats().tiers['cluster']}"
            save(client, [store_key(i, b"joined")], ACME, [i % 8])
            time.sleep(0.5)
            if client.stats().tiers["cluster"].bytes_written > 0:
                break
    finally:
        master.kill()


# -- soft pin (kv_retention_s) ------------------------------------------------------------
def test_retained_blocks_are_soft_pinned_and_outlive_unpinned_ones(tmp_path, store_factory, clients, secret_file):
    """A paused conversation's blocks (the store's Retain) are soft-pinned in
    the pool: when its 32 MiB fill up, the master evicts unpinned blocks and
    keeps the pinned ones, readable."""
    from kvferry.kvstore.cluster import MooncakeTier

    # Leases of 50 ms (10 s by default): a block read or written a moment
    # ago can be evicted at once, so that the pressure below takes seconds.
    master = MooncakeMaster(tmp_path, extra_args=["--default_kv_lease_ttl=50"])
    master.start()
    filler = None
    try:
        url = master.url + "&namespace=pin"
        filler = MooncakeTier(url, crypto=TierCrypto(SECRET))  # the pool's only segment (32 MiB)
        _, address = store_factory(16, kv_cluster=url + "&segment_gb=0", cache_secret_file=secret_file)
        client = clients(address)
        kept, paused = [store_key(i, b"kept") for i in range(2)], [store_key(i, b"paused") for i in range(2)]
        save(client, kept + paused, ACME, range(4))
        wait_for(lambda: all(filler.contains(k) for k in kept + paused), "the blocks never reached the pool")
        assert client.retain(paused, ACME, 600) == 2  # a conversation paused for 10 minutes
        # The pin is set on the store's pool writer, in order: once a block
        # committed after it is in the pool, the pin is done.
        save(client, [store_key(0, b"after")], ACME, [9])
        wait_for(lambda: filler.contains(store_key(0, b"after")), "the pool writer never got past the pin")
        # Pressure: twice the pool in unpinned 1 MiB blocks from another node.
        big = os.urandom(1 << 20)
        for i in range(0, 64, 4):
            filler.put_many([(key(1000 + j), big, ACME) for j in range(i, i + 4)])
            time.sleep(0.05)
        time.sleep(0.5)
        assert filler.get_many(paused, ACME) == [block_bytes(i).tobytes() for i in (2, 3)]
        assert all(filler.contains(k) for k in paused)  # the markers were pinned with them
        assert filler.get_many(kept, ACME) == [None, None]  # unpinned: evicted first
    finally:
        if filler is not None:
            filler.close()
        master.kill()
