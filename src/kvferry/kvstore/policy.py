"""The DRAM tier's bookkeeping: which arena slot holds which block, for
whom, pinned or retained, and what to evict. No I/O, no torch, one thread
(the service's main loop).

Policy:

* **Write-through into DRAM.** Every block an engine saves takes a slot
  (``reserve`` -> the engine writes it -> ``commit``).
* **Pools and quotas.** Each tenant's private blocks form one pool, public
  blocks (inside declared public prefixes) another, each with its own
  quota in blocks (None: bounded by the arena alone). A pool at its quota
  evicts its own least recently used block to make room (per-tenant LRU
  inside the quota); if every block it holds is pinned or retained, the
  write is refused and counted. One tenant never evicts another's block
  to get past its quota.
* **Arena full.** The globally least recently used evictable block goes.
* **Evictable:** not pinned (a load in flight or a load result the engine
  still copies), not reserved, and not retained, except that retained
  blocks may be demoted when a cold tier exists below: they are written
  back rather than dropped. Retained blocks go after all unretained ones.
* **Write-back.** Each eviction is handed to ``on_evict`` (the service
  copies the bytes out and writes them down the tiers asynchronously
  before the slot is reused).
* **Retention** (``retain``): a soft pin until an expiry, for a paused
  conversation; a pool's retained blocks are bounded by its quota (or by
  half the arena without one), and expiry is checked at every eviction.
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from kvferry.kvstore.tenant_lru import PUBLIC_POOL
from kvferry.kvstore.tier import BlockOwner, TenantTierStats, TierStats

Pool = str | None  # a tenant's name, or None for the public pool


def pool_of(owner: BlockOwner) -> Pool:
    return None if owner.public else owner.tenant


class State(enum.Enum):
    RESERVED = "reserved"  # a slot handed to a writer, not yet readable
    LOADING = "loading"  # an I/O thread is bringing the block up from a cold tier
    READY = "ready"  # indexed: readers see it
    DEAD = "dead"  # out of the index; the slot frees once the last pin goes


@dataclass(slots=True, eq=False)
class Entry:
    key: bytes
    slot: int
    owner: BlockOwner
    state: State
    client_id: str = ""  # the writer of a RESERVED entry
    pins: int = 0
    retain_until: float = 0.0
    hits: int = 0  # loads served from this slot since it came in
    since: float = 0.0  # when the slot was allocated (reservations time out)


@dataclass(slots=True)
class PoolQuotas:
    """Quota in blocks per pool; a missing tenant has ``default_blocks``."""

    tenant_blocks: dict[str, int] = field(default_factory=dict)
    default_blocks: int | None = None
    public_blocks: int | None = None

    def of(self, pool: Pool) -> int | None:
        if pool is None:
            return self.public_blocks
        return self.tenant_blocks.get(pool, self.default_blocks)


class DramIndex:
    def __init__(self, num_slots: int, block_nbytes: int, quotas: PoolQuotas | None = None,
                 can_demote: bool = False, on_evict: Callable[[Entry], None] | None = None) -> None:
        self.num_slots = num_slots
        self.block_nbytes = block_nbytes
        self.quotas = quotas or PoolQuotas()
        # True when a cold tier lies below: retained blocks may then be
        # written back and evicted instead of holding DRAM.
        self.can_demote = can_demote
        self.on_evict = on_evict or (lambda entry: None)
        # Pop from the end: slot 0 is handed out first (tests read exact slots).
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.entries: dict[bytes, Entry] = {}  # RESERVED, LOADING, READY by key
        self.by_slot: dict[int, Entry] = {}  # every slot in use, DEAD ones included
        # READY entries, least recently used first: globally and per pool.
        self.lru: OrderedDict[bytes, Entry] = OrderedDict()
        self.pool_lru: dict[Pool, OrderedDict[bytes, Entry]] = {}
        self.pool_slots: dict[Pool, int] = {}  # slots a pool holds (all live states)
        self.stats = TierStats()
        self.evictions = 0

    # -- reads ------------------------------------------------------------------
    def holds(self, key: bytes) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.state in (State.READY, State.LOADING)

    def readable(self, key: bytes, owner: BlockOwner) -> Entry | None:
        """The entry a load of ``key`` by ``owner`` may use: ready or on its
        way up, and the owner's (a private block is never served to another
        tenant, whatever key was asked for)."""
        entry = self.entries.get(key)
        if entry is None or entry.state not in (State.READY, State.LOADING):
            return None
        if entry.owner.public != owner.public or (not owner.public and entry.owner.tenant != owner.tenant):
            return None
        return entry

    def pin(self, entry: Entry) -> None:
        entry.pins += 1
        if entry.state is State.READY:
            self._touch(entry)

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        assert entry.pins >= 0, "unpinned more often than pinned"
        if entry.pins == 0 and entry.state is State.DEAD:
            self._free_slot(entry)

    # -- writes -----------------------------------------------------------------
    def allocate(self, key: bytes, owner: BlockOwner, state: State, now: float, client_id: str = "") -> Entry | None:
        """A slot for ``key`` (absent from the index), evicting as the policy
        says; None when the pool's quota or the arena has no evictable
        block (counted as a refused write)."""
        assert key not in self.entries
        pool = pool_of(owner)
        quota = self.quotas.of(pool)
        if quota is not None and self.pool_slots.get(pool, 0) >= quota:
            victim = self._victim(self.pool_lru.get(pool), now)
            if victim is None or quota == 0:
                return self._refuse(owner)
            self._evict(victim)
        if not self.free:
            victim = self._victim(self.lru, now)
            if victim is None:
                return self._refuse(owner)
            self._evict(victim)
        entry = Entry(key, self.free.pop(), owner, state, client_id, since=now)
        self.entries[key] = entry
        self.by_slot[entry.slot] = entry
        self.pool_slots[pool] = self.pool_slots.get(pool, 0) + 1
        return entry

    def make_ready(self, entry: Entry) -> None:
        """A reserved block was written, or a loading one came up: index it."""
        assert entry.state in (State.RESERVED, State.LOADING)
        entry.state = State.READY
        entry.client_id = ""
        self.lru[entry.key] = entry
        self.pool_lru.setdefault(pool_of(entry.owner), OrderedDict())[entry.key] = entry
        self.stats.bytes_written += self.block_nbytes

    def remove(self, entry: Entry) -> None:
        """Out of the index now (abandoned, failed, dropped); the slot frees
        when the last pin goes."""
        if entry.state is State.DEAD:
            return
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
        if entry.state is State.READY:
            del self.lru[entry.key]
            del self.pool_lru[pool_of(entry.owner)][entry.key]
        pool = pool_of(entry.owner)
        self.pool_slots[pool] -= 1
        entry.state = State.DEAD
        if entry.pins == 0:
            self._free_slot(entry)

    def retain(self, keys: list[bytes], owner: BlockOwner, until: float, now: float) -> int:
        """Retain the owner's blocks of ``keys`` held in DRAM until ``until``
        (``until <= now`` lifts retention); returns how many are retained,
        at most what the pool's bound leaves."""
        pool = pool_of(owner)
        bound = self.quotas.of(pool)
        if bound is None:
            bound = self.num_slots // 2
        already = sum(1 for e in self.pool_lru.get(pool, {}).values() if e.retain_until > now)
        done = 0
        for key in keys:
            entry = self.readable(key, owner)
            if entry is None:
                continue
            if until > now and entry.retain_until <= now:
                if already >= bound:
                    continue
                already += 1
            entry.retain_until = until
            done += 1
        return done

    def drop_pool(self, pool: Pool) -> int:
        doomed = [e for e in self.entries.values() if pool_of(e.owner) == pool]
        for entry in doomed:
            self.remove(entry)
        return len(doomed)

    def drop_public(self, keys: list[bytes]) -> int:
        """Public entries of ``keys`` that readers see (ready): out of the
        index now, each slot freed when its last load lets go. A private
        entry, or one still being written or loaded, stays."""
        doomed = [e for key in keys if (e := self.entries.get(key)) is not None
                  and e.owner.public and e.state is State.READY]
        for entry in doomed:
            self.remove(entry)
        return len(doomed)

    # -- accounting ---------------------------------------------------------------
    def count_hit(self, owner: BlockOwner, hit: bool) -> None:
        tenant = self.tenant_stats(owner)
        if hit:
            self.stats.hits += 1
            self.stats.bytes_read += self.block_nbytes
            tenant.hits += 1
        else:
            self.stats.misses += 1
            tenant.misses += 1

    def tenant_stats(self, owner: BlockOwner) -> TenantTierStats:
        name = PUBLIC_POOL if owner.public else owner.tenant
        stats = self.stats.per_tenant.get(name)
        if stats is None:
            stats = self.stats.per_tenant[name] = TenantTierStats()
        return stats

    def snapshot(self) -> TierStats:
        """The tier's stats with occupancy filled in (per tenant too)."""
        s = self.stats
        s.num_blocks = len(self.lru)
        s.num_bytes = s.num_blocks * self.block_nbytes
        for tenant in s.per_tenant.values():
            tenant.num_blocks = 0
        for pool, lru in self.pool_lru.items():
            t = self.tenant_stats(BlockOwner(pool or "", pool is None))
            t.num_blocks = len(lru)
            t.num_bytes = len(lru) * self.block_nbytes
        return s

    def check_integrity(self) -> None:
        """Every slot is free or used exactly once; the LRUs hold exactly
        the READY entries; pool counts match. For tests (and when idle)."""
        used = set(self.by_slot)
        assert not used & set(self.free), "a slot is both free and used"
        assert len(used) + len(self.free) == self.num_slots, "a slot was lost"
        ready = {k for k, e in self.entries.items() if e.state is State.READY}
        assert ready == set(self.lru), "the LRU and the READY entries differ"
        assert ready == {k for lru in self.pool_lru.values() for k in lru}, "the pool LRUs and READY entries differ"
        for key, entry in self.entries.items():
            assert entry.key == key and self.by_slot[entry.slot] is entry
        counts: dict[Pool, int] = {}
        for entry in self.entries.values():
            counts[pool_of(entry.owner)] = counts.get(pool_of(entry.owner), 0) + 1
        assert counts == {p: n for p, n in self.pool_slots.items() if n}, "pool slot counts drifted"
        for entry in self.by_slot.values():
            assert entry.pins >= 0
            if entry.state is State.DEAD:
                assert entry.pins > 0, "a dead entry without pins still holds its slot"

    # -- internals ------------------------------------------------------------------
    def _touch(self, entry: Entry) -> None:
        self.lru.move_to_end(entry.key)
        self.pool_lru[pool_of(entry.owner)].move_to_end(entry.key)

    def _victim(self, lru: OrderedDict[bytes, Entry] | None, now: float) -> Entry | None:
        """The least recently used evictable entry: unretained ones first,
        then (only when a cold tier can take them) retained ones."""
        if not lru:
            return None
        retained = None
        for entry in lru.values():
            if entry.pins:
                continue
            if entry.retain_until <= now:
                return entry
            if retained is None and self.can_demote:
                retained = entry
        return retained

    def _evict(self, entry: Entry) -> None:
        self.on_evict(entry)  # before the slot can be reused: the bytes are still there
        self.evictions += 1
        self.remove(entry)

    def _refuse(self, owner: BlockOwner) -> None:
        self.stats.refused_writes += 1
        self.tenant_stats(owner).refused_writes += 1
        return None

    def _free_slot(self, entry: Entry) -> None:
        del self.by_slot[entry.slot]
        self.free.append(entry.slot)
