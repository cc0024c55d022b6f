"""The Redis tier against a real redis-server: round trips, sealing,
tenants, quotas, corruption, and a server killed and restarted."""
from __future__ import annotations

import array
import logging
import time

import pytest
import xxhash

from kvferry.kvstore.crypto import MAC_BYTES, TierCrypto, tenant_tag
from kvferry.kvstore.tenant_lru import PUBLIC_POOL, TierQuotas
from kvferry.kvstore.tier import BlockOwner
from tests.kvstore.conftest import SECRET, block, key
from tests.kvstore.redis_server import RedisServer

redis = pytest.importorskip("redis", reason="the redis package (pip install kvferry[remote])")
from kvferry.kvstore.remote import RedisTier  # noqa: E402 (needs redis)

ACME = BlockOwner("acme")
BETA = BlockOwner("beta")
PUBLIC = BlockOwner("acme", public=True)


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    srv.kill()


def raw_client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url)


@pytest.mark.parametrize("sealed", [False, True])
def test_round_trip_is_bit_exact(server, sealed):
    tier = RedisTier(server.url, crypto=TierCrypto(SECRET) if sealed else None, insecure=not sealed)
    for i, n in enumerate([1, 4096, 70_000]):
        assert tier.put(key(i), block(i, n), ACME)
    assert tier.put(key(9), memoryview(block(9)), PUBLIC)
    got = tier.get_many([key(2), key(5), key(0), key(1), key(9)], ACME)
    assert got == [block(2, 70_000), None, block(0, 1), block(1, 4096), block(9)]
    assert tier.get(key(9), BETA) == block(9)
    assert tier.contains(key(1)) and not tier.contains(key(5))
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.num_blocks) == (5, 1, 4)
    assert stats.per_tenant["acme"].hits == 4 and stats.per_tenant["beta"].hits == 1
    tier.close()


def test_private_blocks_are_sealed_in_redis_and_public_ones_are_not(server):
    tier = RedisTier(server.url, crypto=TierCrypto(SECRET))
    tier.put(key(1), block(1), ACME)
    tier.put(key(2), block(2), PUBLIC)
    client = raw_client(server)
    assert block(1)[:256] not in client.get(tier.redis_key(key(1)))
    assert block(2)[:256] in client.get(tier.redis_key(key(2)))


def forge(key_: bytes, tenant: str, sealed_payload: bytes) -> bytes:
    """A value tagged as ``tenant``'s with a valid checksum, as someone with
    write access to the shared Redis (who can tell the tags apart, but not
    open the blocks) could make it."""
    tenant = tenant_tag(TierCrypto(SECRET), tenant)
    header = b"KVFR" + bytes([2, 2]) + len(tenant).to_bytes(2, "little")
    h = xxhash.xxh3_128()
    for part in (key_, header, tenant, sealed_payload):
        h.update(part)
    return header + tenant + h.digest() + sealed_payload


def test_another_tenants_private_block_fails_authentication(server):
    tier = RedisTier(server.url, crypto=TierCrypto(SECRET))
    tier.put(key(1), block(1), ACME)
    other = RedisTier(server.url, crypto=TierCrypto(SECRET))  # another node, same secret
    assert other.get(key(1), BETA) is None
    assert other.stats().auth_failures == 1 and other.stats().quarantined == 0  # kept for acme
    client = raw_client(server)
    value = client.get(tier.redis_key(key(1)))
    purge_tag, sealed = value[:MAC_BYTES], value[MAC_BYTES + 8 + MAC_BYTES + 16:]
    # Relabelled to beta: beta's key cannot open it.
    client.set(tier.redis_key(key(1)), purge_tag + forge(key(1), "beta", sealed))
    assert other.get(key(1), BETA) is None
    # Moved to another block key under acme: the associated data differs.
    client.set(tier.redis_key(key(2)), purge_tag + forge(key(2), "acme", sealed))
    assert tier.get(key(2), ACME) is None
    assert other.stats().auth_failures == 2 and tier.stats().auth_failures == 1
    # Both forgeries are deleted from the server.
    assert other.stats().quarantined == 1 and tier.stats().quarantined == 1
    assert client.exists(tier.redis_key(key(1))) == 0
    assert client.exists(tier.redis_key(key(2))) == 0


def test_a_corrupted_value_is_a_miss_and_deleted(server):
    tier = RedisTier(server.url, crypto=TierCrypto(SECRET))
    tier.put(key(1), block(1), ACME)
    client = raw_client(server)
    value = bytearray(client.get(tier.redis_key(key(1))))
    value[500] ^= 1
    client.set(tier.redis_key(key(1)), bytes(value))
    client.set(tier.redis_key(key(2)), b"junk")
    assert tier.get_many([key(1), key(2)], ACME) == [None, None]
    assert tier.stats().quarantined == 2
    assert client.exists(tier.redis_key(key(1))) == 0


def test_quotas_evict_the_tenants_own_blocks(server):
    size = len(RedisTier(server.url, crypto=TierCrypto(SECRET))._encode(key(0), block(0), ACME))
    tier = RedisTier(server.url, crypto=TierCrypto(SECRET), quotas=TierQuotas({"acme": 2 * size, "zero": 0}, public_bytes=0))
    tier.put(key(0), block(0), BETA)
    for i in range(1, 4):
        assert tier.put(key(i), block(i), ACME)
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert not tier.put(key(4), block(4), BlockOwner("zero"))
    assert not tier.put(key(5), block(5), PUBLIC)
    stats = tier.stats()
    assert stats.refused_writes == 2 and stats.per_tenant[PUBLIC_POOL].refused_writes == 1
    assert stats.per_tenant["acme"].num_bytes == 2 * size
    tier.check_integrity()


def test_drop_tenant_reaches_blocks_other_nodes_wrote(server):
    node_a, node_b = RedisTier(server.url, crypto=TierCrypto(SECRET)), RedisTier(server.url, crypto=TierCrypto(SECRET))
    node_a.put(key(1), block(1), ACME)
    node_b.put(key(2), block(2), ACME)
    node_b.put(key(3), block(3), BETA)
    assert node_a.drop_tenant("acme") == 2
    assert node_b.get_many([key(1), key(2), key(3)], ACME) == [None, None, None]
    assert node_b.get(key(3), BETA) == block(3)


def test_redis_killed_mid_run_means_misses_one_warning_then_back(server, caplog):
    tier = RedisTier(server.url, crypto=TierCrypto(SECRET), timeout_s=0.5, retry_initial_s=0.2, retry_max_s=0.4)
    assert tier.put(key(1), block(1), ACME)
    server.kill()
    caplog.set_level(logging.INFO, logger="kvferry.kvstore.remote")
    start = time.monotonic()
    for i in range(30):  # nothing raises; every call is a miss or a refused write
        assert tier.get(key(1), ACME) is None
        assert not tier.put(key(100 + i), block(i), ACME)
        assert not tier.contains(key(1))
        assert tier.get_many([key(1), key(2)], ACME) == [None, None]
        time.sleep(0.02)
    assert time.monotonic() - start < 10
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "down" in warnings[0].getMessage() and tier.down
    stats = tier.stats()
    assert stats.misses >= 90 and stats.refused_writes >= 30
    server.start()  # empty: no persistence
    deadline = time.monotonic() + 5
    while not tier.put(key(2), block(2), ACME):
        assert time.monotonic() < deadline, "the tier did not come back"
        time.sleep(0.05)
    assert not tier.down
    assert tier.get(key(2), ACME) == block(2)
    assert tier.get(key(1), ACME) is None  # lost with the server: a plain miss
    assert any("back" in r.getMessage() for r in caplog.records)
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_a_server_that_is_never_there(caplog):
    from tests.kvstore.redis_server import free_port
    tier = RedisTier(f"redis://127.0.0.1:{free_port()}/0", crypto=TierCrypto(SECRET), timeout_s=0.2, retry_initial_s=0.1)
    caplog.set_level(logging.WARNING, logger="kvferry.kvstore.remote")
    assert not tier.put(key(1), block(1), ACME)
    assert tier.get(key(1), ACME) is None
    assert tier.drop_tenant("acme") == 0
    assert len(caplog.records) == 1


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="url"):
        RedisTier("http://localhost:6379")
    with pytest.raises(ValueError, match="ttl_s"):
        RedisTier("redis://127.0.0.1:1/0", ttl_s=0)


def test_a_typed_buffer_is_stored_as_its_bytes(server):
    values = array.array("f", range(1000))
    tier = RedisTier(server.url, crypto=TierCrypto(SECRET))
    assert tier.put(key(1), memoryview(values), ACME)
    assert tier.get(key(1), ACME) == values.tobytes() and tier.stats().bytes_written == 4000


def test_ttl_expires_blocks(server):
    tier = RedisTier(server.url, crypto=TierCrypto(SECRET), ttl_s=0.2)
    tier.put(key(1), block(1), ACME)
    assert tier.get(key(1), ACME) == block(1)
    time.sleep(0.4)
    assert tier.get(key(1), ACME) is None
