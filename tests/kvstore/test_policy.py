"""DramIndex: exact slots and eviction order, quotas per pool, pins,
retention. Pure bookkeeping: no processes here."""
import pytest

from kvferry.kvstore.policy import DramIndex, PoolQuotas, State
from kvferry.kvstore.tier import BlockOwner

A = BlockOwner("acme")
B = BlockOwner("bolt")
PUB = BlockOwner("acme", public=True)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def write(index: DramIndex, i: int, owner: BlockOwner, now: float = 0.0):
    entry = index.allocate(key(i), owner, State.RESERVED, now, "c")
    if entry is not None:
        index.make_ready(entry)
    return entry


def test_global_lru_evicts_least_recently_used_first_and_reports_it():
    evicted = []
    index = DramIndex(3, 16, on_evict=lambda e: evicted.append(e.key))
    for i in range(3):
        assert write(index, i, A).slot == i
    index.pin(index.entries[key(0)])  # a load touches block 0: now most recent
    index.unpin(index.entries[key(0)])
    assert write(index, 3, A).slot == 1  # block 1 was least recently used
    assert evicted == [key(1)]
    assert not index.holds(key(1)) and index.holds(key(0))
    index.check_integrity()


def test_a_tenant_at_quota_evicts_its_own_lru_never_another_tenants():
    evicted = []
    index = DramIndex(8, 16, PoolQuotas({"acme": 2}), on_evict=lambda e: evicted.append(e.key))
    write(index, 0, B)
    write(index, 1, A)
    write(index, 2, A)
    write(index, 3, A)  # over acme's quota of 2: acme's oldest (1) goes, bolt's (0) stays
    assert evicted == [key(1)]
    assert index.holds(key(0)) and index.holds(key(2)) and index.holds(key(3))
    assert index.pool_slots == {"bolt": 1, "acme": 2}
    index.check_integrity()


def test_over_quota_write_is_refused_and_counted_when_every_own_block_is_pinned():
    index = DramIndex(8, 16, PoolQuotas({"acme": 2}))
    for i in range(2):
        index.pin(write(index, i, A))
    assert write(index, 2, A) is None
    assert index.stats.refused_writes == 1
    assert index.stats.per_tenant["acme"].refused_writes == 1
    assert write(index, 3, B) is not None  # other tenants are unaffected
    index.check_integrity()


def test_zero_quota_refuses_everything():
    index = DramIndex(4, 16, PoolQuotas(default_blocks=0))
    assert write(index, 0, A) is None
    assert index.stats.refused_writes == 1


def test_public_blocks_have_their_own_pool_and_quota():
    index = DramIndex(8, 16, PoolQuotas({"acme": 1}, public_blocks=1))
    write(index, 0, A)
    write(index, 1, PUB)
    assert index.pool_slots == {"acme": 1, None: 1}
    write(index, 2, PUB)  # public pool at quota: evicts its own LRU, acme's block stays
    assert index.holds(key(0)) and not index.holds(key(1)) and index.holds(key(2))


def test_private_block_is_never_readable_by_another_tenant_nor_as_public():
    index = DramIndex(4, 16)
    write(index, 0, A)
    assert index.readable(key(0), A) is not None
    assert index.readable(key(0), B) is None
    assert index.readable(key(0), BlockOwner("acme", public=True)) is None
    write(index, 1, PUB)
    assert index.readable(key(1), BlockOwner("bolt", public=True)) is not None


def test_pinned_blocks_survive_pressure_and_a_full_pinned_arena_refuses():
    index = DramIndex(2, 16)
    index.pin(write(index, 0, A))
    write(index, 1, A)
    write(index, 2, A)  # only block 1 may go
    assert index.holds(key(0)) and not index.holds(key(1))
    index.pin(index.entries[key(2)])
    assert write(index, 3, A) is None
    index.check_integrity()


def test_retained_blocks_outlive_unretained_until_expiry():
    index = DramIndex(3, 16, PoolQuotas({"acme": 3}))
    for i in range(3):
        write(index, i, A)
    assert index.retain([key(0), key(1)], A, until=10.0, now=0.0) == 2
    write(index, 3, A, now=1.0)  # retained 0 and 1 are older, yet 2 goes
    assert index.holds(key(0)) and index.holds(key(1)) and not index.holds(key(2))
    index.pin(index.entries[key(3)])
    assert write(index, 4, A, now=2.0) is None  # without a cold tier retained blocks are never dropped
    index.unpin(index.entries[key(3)])
    write(index, 5, A, now=11.0)  # expired: the least recently used goes again
    assert not index.holds(key(0))
    index.check_integrity()


def test_retained_blocks_are_demoted_last_when_a_cold_tier_exists():
    evicted = []
    index = DramIndex(2, 16, PoolQuotas({"acme": 2}), can_demote=True, on_evict=lambda e: evicted.append(e.key))
    write(index, 0, A)
    write(index, 1, A)
    index.retain([key(0), key(1)], A, until=10.0, now=0.0)
    write(index, 2, A, now=1.0)
    assert evicted == [key(0)]  # handed to write-back, not refused


def test_retention_without_a_quota_is_bounded_by_half_the_arena():
    index = DramIndex(4, 16)
    for i in range(4):
        write(index, i, A)
    assert index.retain([key(i) for i in range(4)], A, until=5.0, now=0.0) == 2


def test_retention_is_bounded_by_the_pool_quota():
    index = DramIndex(8, 16, PoolQuotas({"acme": 3}))
    for i in range(3):
        write(index, i, A)
    assert index.retain([key(0), key(1)], A, until=5.0, now=0.0) == 2
    index.quotas.tenant_blocks["acme"] = 2  # lowered: no room for a third
    assert index.retain([key(2)], A, until=5.0, now=0.0) == 0
    assert index.retain([key(0)], A, until=9.0, now=0.0) == 1  # extending one already retained is fine
    assert index.retain([key(0)], B, until=9.0, now=0.0) == 0  # not bolt's to retain


def test_removing_a_pinned_block_frees_its_slot_at_the_last_unpin():
    index = DramIndex(2, 16)
    entry = write(index, 0, A)
    index.pin(entry)
    assert index.drop_pool("acme") == 1
    assert not index.holds(key(0)) and entry.state is State.DEAD
    assert 0 not in index.free  # still pinned: a reader may be copying it
    index.check_integrity()
    index.unpin(entry)
    assert 0 in index.free
    index.check_integrity()


def test_reserved_blocks_are_not_readable_nor_evictable():
    index = DramIndex(1, 16)
    entry = index.allocate(key(0), A, State.RESERVED, 0.0, "c")
    assert not index.holds(key(0)) and index.readable(key(0), A) is None
    assert index.allocate(key(1), A, State.RESERVED, 0.0, "c") is None
    index.remove(entry)
    assert index.allocate(key(1), A, State.RESERVED, 0.0, "c").slot == 0
    index.check_integrity()


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_keep_integrity(seed):
    import random

    rng = random.Random(seed)
    index = DramIndex(16, 8, PoolQuotas({"acme": 6, "bolt": 10}, public_blocks=4))
    owners = [A, B, PUB, BlockOwner("cato")]
    pinned = []
    for step in range(2000):
        op = rng.random()
        owner = rng.choice(owners)
        i = rng.randrange(60)
        k = key(i)
        if op < 0.5 and k not in index.entries:
            write(index, i, owner, now=step)
        elif op < 0.7:
            entry = index.readable(k, owner)
            if entry is not None:
                index.pin(entry)
                pinned.append(entry)
        elif op < 0.85 and pinned:
            index.unpin(pinned.pop(rng.randrange(len(pinned))))
        elif op < 0.95:
            index.retain([k], owner, until=step + rng.randrange(50), now=step)
        else:
            index.drop_pool(owner.tenant)
        index.check_integrity()
        for pool, quota in (("acme", 6), ("bolt", 10), (None, 4)):
            assert index.pool_slots.get(pool, 0) <= quota
