"""The shared tiers against a stranger who reaches the server but holds no
cluster secret (issue 45's probe), on a real redis-server and a real
mooncake_master on loopback:

* list the keys, rewrite a private block's value as "not sealed" (its
  tenant tag kept, a valid xxh3 checksum), or rewrite a public block: the
  reading tier answers a miss, counts it, logs it and deletes the value;
* a value written by a node without the secret is refused the same way;
* a shared tier without a secret is refused at start, unless
  --insecure-shared-tier;
* the pool's key listing names neither tenants nor which blocks belong
  together;
* Mooncake's transfer ports are tied to the pool's (loopback) interface.
"""
from __future__ import annotations

import logging
import re
import struct
import subprocess
import urllib.request

import pytest
import xxhash

from kvferry.kvstore.crypto import MAC_BYTES, TierCrypto, tenant_tag
from kvferry.kvstore.tier import BlockOwner
from tests.kvstore.conftest import SECRET, block, key
from tests.kvstore.mooncake_master import MooncakeMaster
from tests.kvstore.redis_server import RedisServer

redis = pytest.importorskip("redis", reason="the redis package (pip install kvferry[remote])")
from kvferry.kvstore.remote import RedisTier  # noqa: E402 (needs redis)

ACME = BlockOwner("acme")
PUBLIC = BlockOwner("acme", public=True)
HEADER = struct.Struct("<4sBBH")
FORGED = b"\x00" * 6000  # what the stranger wants served: zeros (the probe's engine answered '')


def forge(block_key: bytes, value: bytes, payload: bytes = FORGED) -> bytes:
    """The probe's forgery of a stored value: the same label (public, or
    the tenant tag that is in the clear), "not sealed", the stranger's
    payload, and a valid xxh3-128 checksum over key, header, tag and
    payload (the format a node without a secret writes)."""
    magic, version, flags, tag_len = HEADER.unpack_from(value)
    tag = value[HEADER.size:HEADER.size + tag_len]
    header = HEADER.pack(magic, version, flags & 1, tag_len)  # flag 1: public; sealed (and keyed) cleared
    h = xxhash.xxh3_128()
    for part in (block_key, header, tag, payload):
        h.update(part)
    return header + tag + h.digest() + payload


# -- Redis ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    yield srv
    srv.kill()


@pytest.mark.parametrize("owner", [ACME, PUBLIC], ids=["private", "public"])
def test_redis_forged_blocks_are_misses_counted_logged_and_deleted(redis_server, owner, caplog):
    writer = RedisTier(redis_server.url, crypto=TierCrypto(SECRET))
    reader = RedisTier(redis_server.url, crypto=TierCrypto(SECRET))  # another node, same secret
    k = key(100 + owner.public)
    assert writer.put(k, block(1), owner) and reader.get(k, owner) == block(1)
    # The stranger lists the keys and rewrites the block's value (its
    # name is opaque: the test knows which one it is), keeping its purge tag.
    stranger = redis.Redis.from_url(redis_server.url)
    name = writer.redis_key(k)
    assert name in stranger.keys(b"kvferry:kv:*")
    value = stranger.get(name)
    stranger.set(name, value[:MAC_BYTES] + forge(k, value[MAC_BYTES:]))
    caplog.set_level(logging.WARNING, logger="kvferry.kvstore.remote")
    before = reader.stats()
    assert reader.get(k, owner) is None
    after = reader.stats()
    assert after.quarantined == before.quarantined + 1 and after.auth_failures == before.auth_failures + 1
    assert stranger.exists(name) == 0  # quarantined: deleted from the server
    assert any("failed authentication" in r.getMessage() for r in caplog.records)


def test_redis_refuses_a_value_from_a_node_without_the_secret(redis_server):
    insecure = RedisTier(redis_server.url, insecure=True)
    secure = RedisTier(redis_server.url, crypto=TierCrypto(SECRET))
    assert insecure.put(key(110), block(2), PUBLIC) and insecure.get(key(110), PUBLIC) == block(2)
    # The two name their keys apart (opaque names under the secret): neither finds the other's.
    assert secure.get(key(110), PUBLIC) is None
    # Copied under the secret's name (a stranger can list it), it is refused.
    stranger = redis.Redis.from_url(redis_server.url)
    unkeyed = stranger.get(insecure.redis_key(key(110)))
    assert secure.put(key(110), block(2), PUBLIC)
    value = stranger.get(secure.redis_key(key(110)))
    stranger.set(secure.redis_key(key(110)), value[:MAC_BYTES] + unkeyed)
    before = secure.stats()
    assert secure.get(key(110), PUBLIC) is None
    assert secure.stats().quarantined == before.quarantined + 1
    # And the other way round: a node without the secret cannot check a keyed value.
    assert secure.put(key(111), block(3), PUBLIC)
    stranger.set(insecure.redis_key(key(111)), stranger.get(secure.redis_key(key(111)))[MAC_BYTES:])
    assert insecure.get(key(111), PUBLIC) is None


def test_redis_listing_names_no_tenant_no_block_and_no_grouping(redis_server):
    """Issue 45: listing Redis showed each tenant's stable tag, its block
    count and which blocks belong together (a set per tenant). Now every
    key is an opaque name, nothing groups a tenant's blocks, and a purge
    still reaches the blocks other nodes wrote."""
    prefix = b"kvferry:listing:"
    node_a, node_b = (RedisTier(redis_server.url, crypto=TierCrypto(SECRET), prefix=prefix) for _ in range(2))
    tenants = [BlockOwner(f"tenant-{i}") for i in range(3)]
    written = {}
    for i, owner in enumerate(tenants):
        for j in range(4):
            k = key(400 + 10 * i + j)
            assert (node_a if j % 2 else node_b).put(k, block(j), owner)  # each tenant's on both nodes
            written[k] = owner
    for j in range(2):
        assert node_a.put(key(490 + j), block(j), BlockOwner("tenant-0", public=True))
    stranger = redis.Redis.from_url(redis_server.url)
    names = sorted(stranger.scan_iter(match=prefix + b"*"))
    assert sorted(stranger.keys(prefix + b"*")) == names
    assert len(names) == 14  # one key per block: no index, no tenant set
    crypto = TierCrypto(SECRET)
    tags = [tenant_tag(crypto, owner.tenant) for owner in tenants]
    block_keys = list(written) + [key(490), key(491)]
    for name in names:  # an opaque name each: no tenant tag, no block hash
        assert re.fullmatch(rb"[0-9a-f]{32}", name[len(prefix):]), name
        assert stranger.type(name) == b"string"
        for secret_part in tags + block_keys:
            assert secret_part.hex().encode() not in name and secret_part not in name
    # Nor do the values: no tag, no block key, and their per-value MACs
    # (the purge tag before the value, the label in it) all differ.
    values = [stranger.get(name) for name in names]
    for value in values:
        for secret_part in tags + block_keys:
            assert secret_part not in value and secret_part.hex().encode() not in value
    purge_tags = [v[:MAC_BYTES] for v in values]
    labels = [v[MAC_BYTES + 8:MAC_BYTES + 8 + v[MAC_BYTES + 6]] for v in values if v[MAC_BYTES + 6]]
    assert len(set(purge_tags)) == 14 and len(labels) == 12 and len(set(labels)) == 12
    # A restarted node (it wrote nothing since) purges tenant-0: the blocks
    # both nodes wrote go, the other tenants' and the public ones stay.
    restarted = RedisTier(redis_server.url, crypto=TierCrypto(SECRET), prefix=prefix)
    assert restarted.drop_tenant("tenant-0") == 4
    assert node_a.get_many([key(400 + j) for j in range(4)], tenants[0]) == [None] * 4
    assert node_b.get_many([key(410 + j) for j in range(4)], tenants[1]) == [block(j) for j in range(4)]
    assert node_b.get(key(490), BlockOwner("tenant-2", public=True)) == block(0)
    assert len(stranger.keys(prefix + b"*")) == 10


def test_redis_a_rewritten_purge_tag_is_quarantined(redis_server):
    """A value whose purge tag is not its owner's would escape the
    owner's purge: it is never served, and is deleted."""
    prefix = b"kvferry:purgetag:"
    writer = RedisTier(redis_server.url, crypto=TierCrypto(SECRET), prefix=prefix)
    reader = RedisTier(redis_server.url, crypto=TierCrypto(SECRET), prefix=prefix)
    assert writer.put(key(500), block(1), ACME) and writer.put(key(501), block(2), ACME)
    stranger = redis.Redis.from_url(redis_server.url)
    first, second = (stranger.get(writer.redis_key(k)) for k in (key(500), key(501)))
    stranger.set(writer.redis_key(key(500)), second[:MAC_BYTES] + first[MAC_BYTES:])  # another block's tag
    assert reader.get(key(500), ACME) is None and reader.stats().quarantined == 1
    assert stranger.exists(writer.redis_key(key(500))) == 0
    assert reader.get(key(501), ACME) == block(2)


def test_shared_tiers_without_a_secret_are_refused_at_start(redis_server, caplog):
    with pytest.raises(ValueError, match="cluster secret.*--insecure-shared-tier"):
        RedisTier(redis_server.url)
    caplog.set_level(logging.WARNING, logger="kvferry.kvstore.remote")
    RedisTier(redis_server.url, insecure=True).close()
    assert any("INSECURE" in r.getMessage() for r in caplog.records)
    from kvferry.kvstore.cluster import MooncakeTier

    with pytest.raises(ValueError, match="cluster secret.*--insecure-shared-tier"):
        MooncakeTier("mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2/metadata")


def test_the_store_takes_insecure_shared_tier_from_its_config(redis_server, capfd):
    from kvferry.config import KVTierConfig
    from kvferry.kvstore.launch import start_store, store_argv

    tiers = KVTierConfig(kv_dram_gb=0.01, kv_remote=redis_server.url, insecure_shared_tier=True)
    assert "--insecure-shared-tier" in store_argv(tiers, "ipc:///x")
    assert "--insecure-shared-tier" not in store_argv(KVTierConfig(kv_dram_gb=0.01), "ipc:///x")
    proc, _ = start_store(tiers, block_nbytes=4096)
    try:
        assert "INSECURE" in capfd.readouterr().err
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


# -- the Mooncake pool ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(master):
    """Two nodes with the secret and one without, on one namespace."""
    from kvferry.kvstore.cluster import MooncakeTier

    a = MooncakeTier(master.url + "&namespace=probe", crypto=TierCrypto(SECRET))
    b = MooncakeTier(master.url + "&namespace=probe", crypto=TierCrypto(SECRET))
    yield a, b
    a.close()
    b.close()


def listed_keys(master: MooncakeMaster) -> list[str]:
    """The master's HTTP key listing: what any stranger on the network reads."""
    with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/get_all_keys", timeout=10) as r:
        return r.read().decode().split()


@pytest.mark.parametrize("owner", [ACME, PUBLIC], ids=["private", "public"])
def test_pool_forged_blocks_are_misses_counted_logged_and_removed(master, pool, owner, caplog, monkeypatch):
    from kvferry.kvstore import shared_tier

    monkeypatch.setattr(shared_tier, "LOG_EVERY_S", 0.0)  # each test sees its warning (one per 10 s otherwise)
    a, b = pool
    k = key(200 + owner.public)
    assert a.put(k, block(4), owner) and b.get(k, owner) == block(4)
    name = a.object_key(k, owner)
    assert name in listed_keys(master)
    # The stranger's client rewrites the listed value (any client of the pool may).
    stranger = a._store
    assert stranger.upsert(name, forge(k, stranger.get(name))) == 0
    caplog.set_level(logging.WARNING, logger="kvferry.kvstore.cluster")
    before = b.stats()
    assert b.get(k, owner) is None
    slot = memoryview(bytearray(6000))
    assert b.get_into([k], owner, [slot]) == [False]  # the load path: nothing written into the slot
    after = b.stats()
    assert after.quarantined >= before.quarantined + 1 and after.auth_failures >= before.auth_failures + 1
    assert stranger.is_exist(name) == 0  # quarantined: removed from the pool
    assert any("failed authentication" in r.getMessage() for r in caplog.records)


def test_pool_refuses_a_value_from_a_node_without_the_secret(master, pool):
    from kvferry.kvstore.cluster import MooncakeTier

    a, _ = pool
    insecure = MooncakeTier(master.url + "&namespace=insecure", insecure=True)
    try:
        assert insecure.put(key(210), block(5), PUBLIC) and insecure.get(key(210), PUBLIC) == block(5)
        # Put where a node with the secret reads it: refused all the same.
        value = a._store.get(insecure.object_key(key(210), PUBLIC))
        assert a._store.upsert(a.object_key(key(210), PUBLIC), value) == 0
        before = a.stats()
        assert a.get(key(210), PUBLIC) is None and a.stats().quarantined == before.quarantined + 1
    finally:
        insecure.close()


def test_pool_listing_names_no_tenant_and_no_grouping(master, pool):
    a, b = pool
    tenants = [BlockOwner(f"tenant-{i}") for i in range(3)]
    for i, owner in enumerate(tenants):
        assert a.put_many([(key(300 + 10 * i + j), block(j), owner) for j in range(3)]) == [True] * 3
    assert b.put(key(399), block(9), PUBLIC)
    names = [n for n in listed_keys(master) if n.startswith("probe/")]
    assert len(names) >= 2 * 10  # each block's value and its marker
    for n in names:  # one opaque name each: no owner part, no block hash
        assert re.fullmatch(r"probe/[0-9a-f]{32}", n), n
    listing = " ".join(names)
    for owner in tenants:
        assert tenant_tag(TierCrypto(SECRET), owner.tenant).hex() not in listing
    for i in range(300, 400):
        assert key(i).hex() not in listing
    # Nor do the values read back: no tenant tag, and one tenant's labels all differ.
    values = [a._store.get(n) for n in names]
    tags = [tenant_tag(TierCrypto(SECRET), owner.tenant) for owner in tenants]
    assert not any(tag in value for tag in tags for value in values)
    labels = [v[8:8 + v[6]] for v in values if len(v) > 8 and v[6]]
    assert len(labels) >= 9 and len(set(labels)) == len(labels)
    # Still every owner's own: a purge on the node that wrote them removes them.
    assert a.drop_tenant("tenant-0") == 3 and a.get(key(300), tenants[0]) is None
    assert a.get(key(310), tenants[1]) == block(0)


def _wildcard_listeners(pid: int) -> list[str]:
    """``ss``'s listening sockets of ``pid`` on every interface (a socket
    tied to one interface shows as ``0.0.0.0%lo``)."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    local = [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]
    return [addr for addr in local if re.match(r"(0\.0\.0\.0|\*|\[::\]):\d+$", addr)]


def test_pool_transfer_ports_listen_only_on_the_pool_interface(master, pool, store_factory, tmp_path):
    from kvferry.kvstore.mooncake_lib import bound_device, listening_sockets

    a, _ = pool
    # This process's clients: every listening socket is loopback's alone.
    for inode, (address, port) in listening_sockets().items():
        if address in ("0.0.0.0", "::"):
            assert bound_device(inode) == "lo", f"{address}:{port} listens on every interface"
    # And they advertise loopback (not the first LAN address) to the pool.
    hostname = a._store.get_hostname()
    with urllib.request.urlopen(f"{master.metadata}?key=mooncake%2Fram%2F{hostname.replace(':', '%3A')}",
                                timeout=10) as r:
        assert '"tcp_data_host":"127.0.0.1"' in r.read().decode().replace(" ", "")
    # A node store's process: nothing on every interface (ss -ltnp).
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    proc, _ = store_factory(kv_cluster=master.url + "&namespace=probe", cache_secret_file=str(secret))
    listeners = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    assert f"pid={proc.pid}," in listeners  # the store's Mooncake client listens (tied to lo)
    assert _wildcard_listeners(proc.pid) == []


def test_pool_delete_finds_opaque_names_through_the_index(pool):
    """``delete`` (a purge that raced a write) has no owner: the node's
    index names its private objects, the public one and the marker are
    computed."""
    a, b = pool
    assert a.put(key(400), block(1), ACME) and a.put(key(401), block(2), PUBLIC)
    a.delete(key(400))
    a.delete(key(401))
    assert b.get(key(400), ACME) is None and b.get(key(401), PUBLIC) is None
    assert not b.contains(key(400)) and not b.contains(key(401))
