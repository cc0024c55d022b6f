"""Per-pool quotas and LRU order of the cold tiers, without I/O."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.kvstore.tenant_lru import PUBLIC_POOL, TenantLRU, TierQuotas, pool_of
from kvferry.kvstore.tier import BlockOwner


def test_pool_of_public_blocks_is_the_public_pool():
    assert pool_of(BlockOwner("acme", public=True)) == PUBLIC_POOL
    assert pool_of(BlockOwner("acme")) == "acme"


def test_a_pool_over_quota_evicts_its_own_oldest_first():
    lru = TenantLRU(1000, TierQuotas({"a": 30}))
    for k, pool in [(b"a1", "a"), (b"b1", "b"), (b"a2", "a"), (b"a3", "a")]:
        evicted, fits = lru.make_room(pool, 10)
        assert fits and evicted == []
        lru.add(k, pool, 10)
    lru.touch(b"a1")
    evicted, fits = lru.make_room("a", 20)
    assert fits and evicted == [b"a2", b"a3"]  # a1 was used last; b1 untouched


def test_capacity_evicts_the_oldest_of_any_pool():
    lru = TenantLRU(30)
    for k, pool in [(b"a1", "a"), (b"b1", "b"), (b"a2", "a")]:
        lru.make_room(pool, 10)
        lru.add(k, pool, 10)
    assert lru.make_room("c", 10) == ([b"a1"], True)


def test_what_can_never_fit_evicts_nothing():
    lru = TenantLRU(100, TierQuotas({"a": 10}, public_bytes=0))
    lru.add(b"a1", "a", 10)
    assert lru.make_room("a", 11) == ([], False)
    assert lru.make_room(PUBLIC_POOL, 1) == ([], False)
    assert lru.make_room("b", 101) == ([], False)
    assert b"a1" in lru


def test_reserved_bytes_count_against_quota_and_capacity():
    lru = TenantLRU(30, TierQuotas({"a": 20}))
    lru.reserve("a", 20)  # a write in flight
    assert lru.make_room("a", 10) == ([], False)
    lru.release("a", 20)
    assert lru.make_room("a", 10) == ([], True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get", "del"]), st.integers(0, 15),
                          st.sampled_from(["a", "b", PUBLIC_POOL]), st.integers(1, 40)), max_size=80))
def test_quota_and_capacity_always_hold(ops):
    quotas = TierQuotas({"a": 60}, default_tenant_bytes=None, public_bytes=45)
    lru = TenantLRU(100, quotas)
    for op, k, pool, nbytes in ops:
        key = bytes([k])
        if op == "put":
            lru.remove(key)
            evicted, fits = lru.make_room(pool, nbytes)
            assert key not in evicted
            if fits:
                lru.add(key, pool, nbytes)
        elif op == "get":
            lru.touch(key)
        else:
            lru.remove(key)
        lru.check_integrity()
        assert lru.total_bytes <= 100
        assert lru.pool_bytes("a") <= 60 and lru.pool_bytes(PUBLIC_POOL) <= 45
