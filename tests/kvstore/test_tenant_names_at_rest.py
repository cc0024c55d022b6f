"""Tenant names never rest in a cold tier: SSD records and Redis keys and
values carry an HMAC'd tag keyed by the cache secret instead (Redis keys
are opaque names: not even the tag), the same
across restarts (blocks are found, loaded and dropped after one). Real
store processes, a real SSD directory, a real redis-server."""
import time

import numpy as np
import pytest

from kvferry.kvstore.crypto import TENANT_TAG_BYTES, TierCrypto, tenant_tag
from kvferry.kvstore.tier import BlockOwner
from tests.kvstore.conftest import SECRET
from tests.kvstore.redis_server import RedisServer
from tests.kvstore.store_helpers import block_bytes, gb, key, wait_loads

redis = pytest.importorskip("redis", reason="the redis package (pip install kvferry[remote])")

# Long enough that no ciphertext or checksum holds it by chance.
NAME = "acme-corporation-tenant-7"
OTHER = "bolt-industries-tenant-9"
OWNER = BlockOwner(NAME)


def save(client, keys, owner, seeds):
    slots = client.reserve(keys, [owner] * len(keys))
    assert None not in slots, slots
    arena = client.arena()
    for slot, seed in zip(slots, seeds):
        arena[slot] = block_bytes(seed)
    client.commit(keys, slots)


def load(client, keys, owner=OWNER):
    ticket = client.begin_load(keys, [owner] * len(keys))
    (result,) = wait_loads(client)
    assert result.ticket == ticket
    return result


def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def names_at_rest(disk, server: RedisServer) -> list[str]:
    """Where a tenant name appears: disk files, Redis keys, Redis values."""
    found = []
    names = (NAME.encode(), OTHER.encode())
    for path in disk.rglob("*"):
        if path.is_file() and any(n in path.read_bytes() for n in names):
            found.append(f"file {path.name}")
    r = redis.Redis.from_url(server.url)
    for k in r.keys(b"*"):
        value = r.get(k) if r.type(k) == b"string" else b"".join(r.smembers(k))
        if any(n in k for n in names):
            found.append(f"key {k!r}")
        if any(n in value for n in names):
            found.append(f"value of {k!r}")
    return found


def test_tags_are_keyed_by_the_secret_and_stable_across_instances():
    tag = tenant_tag(TierCrypto(SECRET), NAME)
    assert len(tag) == TENANT_TAG_BYTES and NAME.encode() not in tag
    assert tenant_tag(TierCrypto(SECRET), NAME) == tag  # a restart with the same secret
    assert tenant_tag(TierCrypto(SECRET), OTHER) != tag
    other_secret = tenant_tag(TierCrypto(b"another secret of 32 bytes......"), NAME)
    assert other_secret[:8] != tag[:8] and other_secret[8:] != tag[8:]


def test_no_tenant_name_on_disk_or_in_redis_and_loads_work_across_restarts(store_factory, clients, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    disk = tmp_path / "ssd"
    server = RedisServer(tmp_path)
    server.start()
    try:
        tiers = dict(kv_disk=str(disk), kv_disk_gb=gb(64), kv_remote=server.url, cache_secret_file=str(secret_file),
                     extra_args=["--remote-min-hits", "0"])  # every eviction goes to Redis too
        proc, address = store_factory(2, **tiers)
        client = clients(address, timeout_s=0.5)
        for i in range(6):
            save(client, [key(i)], OWNER, [i])
        save(client, [key(50)], BlockOwner(OTHER), [50])
        save(client, [key(60)], BlockOwner(NAME, public=True), [60])  # a public block: no owner at rest
        save(client, [key(70), key(71)], OWNER, [70, 71])  # pushes the others down
        wait_until(lambda: client.stats().written_back >= 8, "write-back did not finish")
        stats = client.stats()
        assert stats.tiers["disk"].num_blocks == 8 and stats.tiers["remote"].num_blocks == 8
        # The per-tenant view still names the tenants (in memory only).
        assert stats.tiers["disk"].per_tenant[NAME].num_blocks == 6

        assert names_at_rest(disk, server) == []
        # Nor their tags: no key groups a tenant's blocks (remote.py).
        keys = redis.Redis.from_url(server.url).keys(b"*")
        assert len(keys) == 8 and not any(b"tenant:" in k for k in keys)
        assert not any(tenant_tag(TierCrypto(SECRET), n).hex().encode() in k for n in (NAME, OTHER) for k in keys)

        # Loads from disk work, bit exact.
        result = load(client, [key(i) for i in range(2)])
        assert len(result.slots) == 2
        for i, slot in enumerate(result.slots):
            np.testing.assert_array_equal(client.arena()[slot], block_bytes(i))
        client.release(result.ticket)

        # Another node's store (Redis only, same secret) loads them from Redis.
        _, node2 = store_factory(4, at=address + "-node2", kv_remote=server.url, cache_secret_file=str(secret_file))
        other = clients(node2)
        result = load(other, [key(2), key(3)])
        assert len(result.slots) == 2
        for i, slot in zip((2, 3), result.slots):
            np.testing.assert_array_equal(other.arena()[slot], block_bytes(i))
        other.release(result.ticket)
        assert other.stats().tiers["remote"].hits == 2

        # A restarted store finds the tenant's blocks on disk by their tags,
        # serves them, and drops them by the tenant's name.
        proc.terminate()
        assert proc.wait(10) == 0
        store_factory(2, **tiers)
        wait_until(lambda: client.connected, "the client did not reconnect")
        assert client.lookup([key(i) for i in range(4)]) == 4
        result = load(client, [key(4), key(5)])
        for i, slot in zip((4, 5), result.slots):
            np.testing.assert_array_equal(client.arena()[slot], block_bytes(i))
        client.release(result.ticket)
        assert client.drop_tenant(NAME) >= 6
        assert client.lookup([key(i) for i in range(6)]) == 0
        assert other.lookup([key(0)]) == 0  # gone from Redis as well
        assert client.lookup([key(50)]) == 1 and client.lookup([key(60)]) == 1  # not NAME's private blocks
        assert names_at_rest(disk, server) == []
    finally:
        server.kill()
