"""Per-tenant quotas and LRU order for a cold tier (no I/O, no torch).

Every block belongs to a pool: its tenant, or the public pool for blocks
inside an operator-declared public prefix. A pool over its quota evicts its
own least recently used blocks to make room (the quota caps the pool; it
never pushes out another tenant). A tier over its capacity evicts the least
recently used block of any pool. A write that cannot fit even then (a
block larger than its pool's quota, a quota of 0) is refused and counted
by the tier.
"""
from __future__ import annotations

from collections import OrderedDict
import dataclasses
from dataclasses import dataclass, field

from kvferry.kvstore.tier import BlockOwner, TenantTierStats, TierStats

# The pool name of public blocks; never a tenant name (tenant names are
# plain identifiers from the API keys file).
PUBLIC_POOL = "<public>"

_GB = 1 << 30


def pool_of(owner: BlockOwner) -> str:
    return PUBLIC_POOL if owner.public else owner.tenant


@dataclass(frozen=True, slots=True)
class TierQuotas:
    """Byte quotas per pool in one tier. None: no cap (only capacity)."""

    tenant_bytes: dict[str, int] = field(default_factory=dict)
    default_tenant_bytes: int | None = None  # tenants not named above
    public_bytes: int | None = None

    def __post_init__(self) -> None:
        for name, value in [*self.tenant_bytes.items(), ("default_tenant_bytes", self.default_tenant_bytes),
                            ("public_bytes", self.public_bytes)]:
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"quotas.{name}: must be an integer >= 0 or None")

    @classmethod
    def from_gb(cls, tenant_gb: dict[str, float] | None = None, *, default_tenant_gb: float | None = None,
                public_gb: float | None = None) -> TierQuotas:
        """Quotas as the flags and the tenants file state them (``disk_gb``)."""
        def to_bytes(gb: float | None) -> int | None:
            return None if gb is None else int(gb * _GB)
        return cls({t: int(gb * _GB) for t, gb in (tenant_gb or {}).items()},
                   to_bytes(default_tenant_gb), to_bytes(public_gb))

    def limit(self, pool: str) -> int | None:
        if pool == PUBLIC_POOL:
            return self.public_bytes
        return self.tenant_bytes.get(pool, self.default_tenant_bytes)


@dataclass(slots=True)
class _Entry:
    pool: str
    nbytes: int


class TenantLRU:
    """Which blocks a tier holds, in LRU order, per pool and overall.

    Not thread-safe: the tier calls it under its own lock."""

    def __init__(self, capacity_bytes: int, quotas: TierQuotas | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes: must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.quotas = quotas or TierQuotas()
        self._all: OrderedDict[bytes, _Entry] = OrderedDict()  # oldest first
        self._pools: dict[str, OrderedDict[bytes, None]] = {}
        self._pool_bytes: dict[str, int] = {}
        self.total_bytes = 0
        self.pool_stats: dict[str, TenantTierStats] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._all

    def __len__(self) -> int:
        return len(self._all)

    def stats_of(self, pool: str) -> TenantTierStats:
        stats = self.pool_stats.get(pool)
        if stats is None:
            stats = self.pool_stats[pool] = TenantTierStats()
        return stats

    def snapshot(self, counters: TierStats) -> TierStats:
        """A copy of the tier's ``counters`` with the block counts and the
        per-pool figures filled in from this index."""
        stats = dataclasses.replace(counters, per_tenant={
            pool: dataclasses.replace(s) for pool, s in self.pool_stats.items()})
        stats.num_blocks = len(self._all)
        stats.num_bytes = self.total_bytes
        return stats

    def pool_bytes(self, pool: str) -> int:
        return self._pool_bytes.get(pool, 0)

    def pool_keys(self, pool: str) -> list[bytes]:
        return list(self._pools.get(pool, ()))

    def pool_of_key(self, key: bytes) -> str | None:
        entry = self._all.get(key)
        return None if entry is None else entry.pool

    def add(self, key: bytes, pool: str, nbytes: int) -> None:
        """Index ``key`` as most recently used (replacing an older entry)."""
        self.remove(key)
        self._all[key] = _Entry(pool, nbytes)
        self._pools.setdefault(pool, OrderedDict())[key] = None
        self._pool_bytes[pool] = self._pool_bytes.get(pool, 0) + nbytes
        self.total_bytes += nbytes
        stats = self.stats_of(pool)
        stats.num_blocks += 1
        stats.num_bytes += nbytes

    def touch(self, key: bytes) -> None:
        entry = self._all.get(key)
        if entry is not None:
            self._all.move_to_end(key)
            self._pools[entry.pool].move_to_end(key)

    def remove(self, key: bytes) -> bool:
        entry = self._all.pop(key, None)
        if entry is None:
            return False
        del self._pools[entry.pool][key]
        self._pool_bytes[entry.pool] -= entry.nbytes
        self.total_bytes -= entry.nbytes
        stats = self.stats_of(entry.pool)
        stats.num_blocks -= 1
        stats.num_bytes -= entry.nbytes
        return True

    def reserve(self, pool: str, nbytes: int) -> None:
        """Count bytes of a block being written (not yet a key), so that
        concurrent writes never overshoot capacity or quota."""
        self._pool_bytes[pool] = self._pool_bytes.get(pool, 0) + nbytes
        self.total_bytes += nbytes

    def release(self, pool: str, nbytes: int) -> None:
        self.reserve(pool, -nbytes)

    def make_room(self, pool: str, nbytes: int) -> tuple[list[bytes], bool]:
        """Evict (remove from the index) what a new ``nbytes`` block of
        ``pool`` needs: first the pool's own LRU blocks down to its quota,
        then anyone's LRU blocks down to capacity. Returns the evicted keys,
        whose storage the caller frees, and whether the block now fits
        (False: refuse it; a block larger than the quota evicts nothing)."""
        quota = self.quotas.limit(pool)
        if nbytes > self.capacity_bytes or (quota is not None and nbytes > quota):
            return [], False
        evicted: list[bytes] = []
        own = self._pools.get(pool, OrderedDict())
        while quota is not None and self.pool_bytes(pool) + nbytes > quota:
            if not own:  # the rest is writes in flight
                return evicted, False
            evicted.append(self._evict(next(iter(own))))
        while self.total_bytes + nbytes > self.capacity_bytes:
            if not self._all:
                return evicted, False
            evicted.append(self._evict(next(iter(self._all))))
        return evicted, True

    def check_integrity(self) -> None:
        """Pools and the overall order hold the same keys and bytes (when
        idle: no write in flight)."""
        assert sum(len(keys) for keys in self._pools.values()) == len(self._all), "a key in no pool"
        for pool, keys in self._pools.items():
            assert all(self._all[k].pool == pool for k in keys), "a key in the wrong pool"
            assert self._pool_bytes[pool] == sum(self._all[k].nbytes for k in keys), "pool bytes drifted"
            assert self.pool_stats[pool].num_blocks == len(keys)
        assert self.total_bytes == sum(e.nbytes for e in self._all.values()), "total bytes drifted"

    def _evict(self, key: bytes) -> bytes:
        self.remove(key)
        return key
