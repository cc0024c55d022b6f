"""The interface every tier below host DRAM implements (SSD, Redis, and
later Mooncake Store, Valkey or S3).

A block is an opaque byte string in the device KV layout
(``[num_layers, 2, block_size, num_kv_heads, head_dim]``), keyed by its
block hash. The hash chain's root holds the cache namespace, the model
fingerprint and the KV dtype (``kvferry.core.hashing``), so a key never
names the same bytes in two namespaces. No torch here.

Rules every tier keeps:

* ``get`` never returns bytes other than those ``put`` under the key for
  that owner: a torn, corrupted or foreign block is a miss (and counted),
  never data.
* Private blocks (``owner.public`` false) are encrypted at rest with the
  owner's tenant key where the tier leaves the process (disk, network).
* A refused write (quota, full disk, tier down) returns False and is
  counted; it never raises into the engine.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BlockOwner:
    """Whose block it is: quotas, LRU, encryption keys and stats are per
    tenant. ``public`` blocks lie inside an operator-declared public prefix:
    pooled across tenants under their own quota, and may stay in the clear."""

    tenant: str = ""
    public: bool = False


@dataclass(slots=True)
class TenantTierStats:
    hits: int = 0
    misses: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    refused_writes: int = 0


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    # Blocks found torn or corrupted (or failing authentication), removed
    # from the index and never served.
    quarantined: int = 0
    # Reads refused because the block is another tenant's private block, or
    # it failed authentication (its AES-GCM tag under the reader's key; in a
    # shared tier, its MAC under the cluster secret): misses, never data.
    auth_failures: int = 0
    # Writes not taken: over quota, disk full, tier down.
    refused_writes: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    # Sum of seconds spent in get() calls that returned data (load latency).
    load_seconds: float = 0.0
    per_tenant: dict[str, TenantTierStats] = field(default_factory=dict)


class ColdTier(ABC):
    """A tier below host DRAM. Implementations are thread-safe: the store
    service calls them from its I/O threads."""

    name: str  # "disk", "remote", ...

    @abstractmethod
    def put(self, key: bytes, data: bytes | memoryview, owner: BlockOwner) -> bool:
        """Store one block; True once it is durable and indexed (a reader
        after this sees it), False when refused."""

    @abstractmethod
    def get(self, key: bytes, owner: BlockOwner) -> bytes | None:
        """The block's bytes, or None on a miss (absent, corrupted and now
        quarantined, another tenant's, tier down)."""

    def get_many(self, keys: list[bytes], owner: BlockOwner) -> list[bytes | None]:
        """Batch read; tiers override it to overlap I/O."""
        return [self.get(key, owner) for key in keys]

    def get_into(self, keys: list[bytes], owner: BlockOwner, outs: list[memoryview]) -> list[bool]:
        """Batch read into place: each block found, of exactly its ``outs``
        view's length (a DRAM slot), is written there; True for those. A
        False one's view may hold anything. Tiers override it to skip the
        intermediate copy."""
        oks = []
        for data, out in zip(self.get_many(keys, owner), outs):
            ok = data is not None and memoryview(data).nbytes == out.nbytes
            if ok:
                out.cast("B")[:] = memoryview(data).cast("B")
            oks.append(ok)
        return oks

    def put_many(self, items: list[tuple[bytes, bytes | memoryview, BlockOwner]]) -> list[bool]:
        """Batch write (``put`` per item); tiers override it to batch I/O."""
        return [self.put(key, data, owner) for key, data, owner in items]

    def retain(self, keys: list[bytes], owner: BlockOwner, seconds: float) -> int:
        """Keep ``owner``'s blocks ``keys`` for ``seconds`` where the tier can
        (a paused conversation's); returns how many. Most tiers cannot: 0."""
        return 0

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def delete(self, key: bytes) -> None: ...

    @abstractmethod
    def drop_tenant(self, tenant: str) -> int:
        """Remove every private block of ``tenant``; returns how many."""

    def drop_public(self, keys: list[bytes]) -> int:
        """Remove the public blocks of ``keys`` (a deleted public prefix's
        own), never a private one; returns how many. A tier shared between
        nodes keeps its own (another node may still declare the prefix): 0."""
        return 0

    @abstractmethod
    def stats(self) -> TierStats: ...

    def close(self) -> None:
        """Release files, sockets and threads."""
