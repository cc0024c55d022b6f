"""The tiers below DRAM, in load order (disk, cluster, remote), and the
threads that move blocks between them and the arena. No torch.

    load threads      cold tier get_into -> arena slot (pinned, LOADING)  -> completion queue
    write-back thread evicted block's bytes -> disk; -> remote too once reused enough
    pool writer       blocks once written (or reused enough), in batches     -> cluster pool

The cluster pool (``cluster.py``) is written through rather than back: a
block goes up when it becomes readable in DRAM (``cluster_min_hits`` 0,
the default) or when it has served that many loads, so that another node
finds it while this one still holds it. Eviction does not write to it.

A block waiting for the write-back thread stays findable: ``contains``
sees it and a load copies it straight from the pending bytes, so an
eviction never makes a block briefly vanish.

The store's main loop owns the DRAM index; this module never touches it.
Loads report ``(entry, ok)`` pairs through ``completions()``, which the
main loop applies. Every tier call is guarded: a tier that raises counts as
a miss (or a skipped write) and is logged, never a crash of the store.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from kvferry.kvstore.arena import Arena
from kvferry.kvstore.policy import Entry
from kvferry.kvstore.tier import BlockOwner, ColdTier, TierStats

logger = logging.getLogger(__name__)

# Bytes of evicted blocks waiting for the write-back thread; past this
# they are dropped (and counted) rather than held in memory without bound.
MAX_PENDING_WRITE_BACK_BYTES = 256 << 20
# Blocks per write to the cluster pool (one lookup and one transfer call).
POOL_WRITE_BATCH = 32


class ColdChain:
    def __init__(self, tiers: list[ColdTier], *, io_threads: int = 4, remote_min_hits: int = 2,
                 cluster_min_hits: int = 0) -> None:
        self.tiers = list(tiers)
        self.remote_min_hits = remote_min_hits
        self.cluster_min_hits = cluster_min_hits
        self._pool_tiers = [t for t in self.tiers if t.name == "cluster"]
        self.loads_in_flight = 0  # main loop only
        self.written_back = 0
        self.write_backs_dropped = 0
        self._loaders = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-load")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-writeback")
        self._completions: queue.SimpleQueue[list[tuple[Entry, bool]]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the pending write-backs and their counters
        self._pending: dict[bytes, tuple[bytes, BlockOwner]] = {}  # key -> (bytes, owner), not yet written
        # The same for write-through to the pool, on a thread of its own (a
        # slow pool never holds up the disk's write-backs).
        self._through: dict[bytes, tuple[bytes, BlockOwner]] = {}
        self._pool_writer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-pool-write")
        self._through_order: deque[bytes] = deque()  # keys of _through, oldest first
        self._draining = False  # a _drain_through is queued or running on the pool writer
        self._drops: dict[str, int] = {}  # tenant -> drop_tenant calls so far

    def __bool__(self) -> bool:
        return bool(self.tiers)

    # -- lookups (main loop) ---------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        with self._lock:
            if key in self._pending or key in self._through:
                return True
        return any(self._contains(tier, key) for tier in self.tiers)

    @staticmethod
    def _contains(tier: ColdTier, key: bytes) -> bool:
        try:
            return tier.contains(key)
        except Exception:
            logger.exception("tier %s: contains failed", tier.name)
            return False

    # -- loads ------------------------------------------------------------------------------
    def start_load(self, entries: list[Entry], arena: Arena) -> None:
        """Bring ``entries`` (LOADING, pinned) into their slots in the background."""
        self.loads_in_flight += 1
        self._loaders.submit(self._load, entries, arena)

    def completions(self) -> list[tuple[Entry, bool]]:
        """Entries whose loads finished since the last call: (entry, ok)."""
        done: list[tuple[Entry, bool]] = []
        while True:
            try:
                batch = self._completions.get_nowait()
            except queue.Empty:
                return done
            self.loads_in_flight -= 1
            done += batch

    def _load(self, entries: list[Entry], arena: Arena) -> None:
        """On a load thread: read each block from the first tier that has it
        into its slot. A block of the wrong size is a miss."""
        loaded: set[int] = set()
        try:
            missing = []
            for entry in entries:
                with self._lock:
                    data, owner = self._pending.get(entry.key) or self._through.get(entry.key, (None, None))
                if data is not None and _same_owner(owner, entry.owner):
                    arena.view[entry.slot] = memoryview(data).cast("B")
                    loaded.add(entry.slot)
                else:
                    missing.append(entry)
            for tier in self.tiers:
                if not missing:
                    break
                by_owner: dict[BlockOwner, list[Entry]] = {}
                for entry in missing:
                    by_owner.setdefault(entry.owner, []).append(entry)
                missing = []
                for owner, group in by_owner.items():
                    try:
                        # Straight into the slots (LOADING: nobody reads them
                        # until the completion says ok).
                        oks = tier.get_into([e.key for e in group], owner,
                                            [memoryview(arena.view[e.slot]) for e in group])
                    except Exception:
                        logger.exception("tier %s: get_into failed", tier.name)
                        oks = [False] * len(group)
                    for entry, ok in zip(group, oks):
                        if ok:
                            loaded.add(entry.slot)
                        else:
                            missing.append(entry)
        finally:
            self._completions.put([(e, e.slot in loaded) for e in entries])

    # -- write-back ---------------------------------------------------------------------------
    def write_back(self, entry: Entry, arena: Arena) -> None:
        """``entry`` is about to leave DRAM: copy its bytes out now (the slot
        is reused next) and write them down on the write-back thread."""
        if not self.tiers:
            return
        tiers = [t for t in self.tiers
                 if t.name != "cluster" and (t.name != "remote" or entry.hits >= self.remote_min_hits)]
        with self._lock:
            if entry.key in self._pending:
                return
            if not self._room_for(arena.block_nbytes):
                self.write_backs_dropped += 1
                return
            data = arena.view[entry.slot].tobytes()
            self._pending[entry.key] = (data, entry.owner)
        self._writer.submit(self._write_down, entry.key, data, entry.owner, tiers, self._pending)

    def write_through(self, entry: Entry, arena: Arena) -> None:
        """``entry`` became readable in DRAM (a commit) or served another
        load: once it has served ``cluster_min_hits`` loads, copy its bytes
        now (the slot may be reused later) and write them to the pool on
        the pool writer thread. The pool's ``put`` skips a block it already
        holds, so each block crosses the network once."""
        if not self._pool_tiers or entry.hits != self.cluster_min_hits:
            return
        with self._lock:
            if entry.key in self._through:
                return
            if not self._room_for(arena.block_nbytes):
                self.write_backs_dropped += 1
                return
            self._through[entry.key] = (arena.view[entry.slot].tobytes(), entry.owner)
            self._through_order.append(entry.key)
            if self._draining:
                return
            self._draining = True
        self._pool_writer.submit(self._drain_through)

    def _drain_through(self) -> None:
        """On the pool writer: write what waits for the pool in batches of
        up to ``POOL_WRITE_BATCH`` (what is pending, when less), one
        ``put_many`` a batch, until nothing waits."""
        while True:
            with self._lock:
                batch: list[tuple[bytes, bytes, BlockOwner]] = []
                while self._through_order and len(batch) < POOL_WRITE_BATCH:
                    key = self._through_order.popleft()
                    if key in self._through and all(key != k for k, _, _ in batch):  # else dropped meanwhile
                        batch.append((key, *self._through[key]))
                if not batch:
                    self._draining = False
                    return
                drops = {owner.tenant: self._drops.get(owner.tenant, 0) for _, _, owner in batch}
            try:
                for tier in self._pool_tiers:
                    try:
                        tier.put_many(batch)
                    except Exception:
                        logger.exception("tier %s: write-through failed", tier.name)
            finally:
                with self._lock:
                    dropped = [key for key, _, owner in batch
                               if not owner.public and self._drops.get(owner.tenant, 0) != drops[owner.tenant]]
                    for key, _, _ in batch:
                        self._through.pop(key, None)
            for key in dropped:  # drop_tenant ran while these were being written
                for tier in self._pool_tiers:
                    try:
                        tier.delete(key)
                    except Exception:
                        logger.exception("tier %s: delete failed", tier.name)

    def retain(self, keys: list[bytes], owner: BlockOwner, seconds: float) -> None:
        """A paused conversation's blocks: soft-pin them in the pool for
        ``seconds``, on the pool writer, after the writes queued before."""
        if self._pool_tiers and seconds > 0 and keys:
            self._pool_writer.submit(self._retain, list(keys), owner, seconds)

    def _retain(self, keys: list[bytes], owner: BlockOwner, seconds: float) -> None:
        for tier in self._pool_tiers:
            try:
                tier.retain(keys, owner, seconds)
            except Exception:
                logger.exception("tier %s: retain failed", tier.name)

    def _room_for(self, nbytes: int) -> bool:
        return (len(self._pending) + len(self._through) + 1) * nbytes <= MAX_PENDING_WRITE_BACK_BYTES

    def _write_down(self, key: bytes, data: bytes, owner: BlockOwner, tiers: list[ColdTier],
                    pending: dict[bytes, tuple[bytes, BlockOwner]]) -> None:
        with self._lock:
            if key not in pending:
                return  # its tenant was dropped meanwhile
            drops = self._drops.get(owner.tenant, 0)
        try:
            for tier in tiers:
                try:
                    if not tier.contains(key):
                        tier.put(key, data, owner)
                except Exception:
                    logger.exception("tier %s: write-back failed", tier.name)
        finally:
            with self._lock:
                dropped = not owner.public and self._drops.get(owner.tenant, 0) != drops
                pending.pop(key, None)
                if pending is self._pending:
                    self.written_back += 1
        if dropped:  # drop_tenant ran while this was being written
            for tier in tiers:
                try:
                    tier.delete(key)
                except Exception:
                    logger.exception("tier %s: delete failed", tier.name)

    # -- the rest -------------------------------------------------------------------------------
    def drop_tenant(self, tenant: str) -> int:
        with self._lock:
            # Pending write-backs of the tenant's are cancelled; one being
            # written now deletes what it wrote (see _write_down).
            for pending in (self._pending, self._through):
                for key in [k for k, (_, owner) in pending.items() if not owner.public and owner.tenant == tenant]:
                    del pending[key]
            self._drops[tenant] = self._drops.get(tenant, 0) + 1
        n = 0
        for tier in self.tiers:
            try:
                n += tier.drop_tenant(tenant)
            except Exception:
                logger.exception("tier %s: drop_tenant failed", tier.name)
        return n

    def drop_public(self, keys: list[bytes]) -> int:
        """A deleted public prefix's own blocks: pending write-downs of them
        are cancelled and each tier drops what it holds (tiers shared
        between nodes keep theirs: ``ColdTier.drop_public``)."""
        doomed = set(keys)
        with self._lock:
            for pending in (self._pending, self._through):
                for key in [k for k, (_, owner) in pending.items() if owner.public and k in doomed]:
                    del pending[key]
        n = 0
        for tier in self.tiers:
            try:
                n += tier.drop_public(list(keys))
            except Exception:
                logger.exception("tier %s: drop_public failed", tier.name)
        return n

    def stats(self) -> dict[str, TierStats]:
        out: dict[str, TierStats] = {}
        for tier in self.tiers:
            try:
                out[tier.name] = tier.stats()
            except Exception:
                logger.exception("tier %s: stats failed", tier.name)
        return out

    def close(self) -> None:
        self._loaders.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)  # write-backs in flight finish (durable or refused)
        self._pool_writer.shutdown(wait=True)  # a clean stop flushes what the pool has not got yet
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                logger.exception("tier %s: close failed", tier.name)


def _same_owner(a: BlockOwner, b: BlockOwner) -> bool:
    """Whether a load by ``b`` may read ``a``'s block (as DramIndex.readable)."""
    return a.public == b.public and (a.public or a.tenant == b.tenant)
