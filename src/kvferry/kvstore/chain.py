"""The tiers below DRAM, in load order (disk, then remote), and the
threads that move blocks between them and the arena. No torch.

    load threads      cold tier get_many -> arena slot (pinned, LOADING)  -> completion queue
    write-back thread evicted block's bytes -> disk; -> remote too once reused enough

The store's main loop owns the DRAM index; this module never touches it.
Loads report ``(entry, ok)`` pairs through ``completions()``, which the
main loop applies. Every tier call is guarded: a tier that raises counts as
a miss (or a skipped write) and is logged, never a crash of the store.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from kvferry.kvstore.arena import Arena
from kvferry.kvstore.policy import Entry
from kvferry.kvstore.tier import BlockOwner, ColdTier, TierStats

logger = logging.getLogger(__name__)

# Bytes of evicted blocks waiting for the write-back thread; past this
# they are dropped (and counted) rather than held in memory without bound.
MAX_PENDING_WRITE_BACK_BYTES = 256 << 20


class ColdChain:
    def __init__(self, tiers: list[ColdTier], *, io_threads: int = 4, remote_min_hits: int = 2) -> None:
        self.tiers = list(tiers)
        self.remote_min_hits = remote_min_hits
        self.loads_in_flight = 0  # main loop only
        self.written_back = 0
        self.write_backs_dropped = 0
        self._loaders = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-load")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-writeback")
        self._completions: queue.SimpleQueue[list[tuple[Entry, bool]]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the write-back counters
        self._pending_write_backs = 0

    def __bool__(self) -> bool:
        return bool(self.tiers)

    # -- lookups (main loop) ---------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
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
            missing = list(entries)
            for tier in self.tiers:
                if not missing:
                    break
                by_owner: dict[BlockOwner, list[Entry]] = {}
                for entry in missing:
                    by_owner.setdefault(entry.owner, []).append(entry)
                missing = []
                for owner, group in by_owner.items():
                    try:
                        datas = tier.get_many([e.key for e in group], owner)
                    except Exception:
                        logger.exception("tier %s: get_many failed", tier.name)
                        datas = [None] * len(group)
                    for entry, data in zip(group, datas):
                        if data is not None and len(data) == arena.block_nbytes:
                            arena.view[entry.slot] = memoryview(data).cast("B")
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
        tiers = [t for t in self.tiers if t.name != "remote" or entry.hits >= self.remote_min_hits]
        with self._lock:
            if (self._pending_write_backs + 1) * arena.block_nbytes > MAX_PENDING_WRITE_BACK_BYTES:
                self.write_backs_dropped += 1
                return
            self._pending_write_backs += 1
        data = arena.view[entry.slot].tobytes()
        self._writer.submit(self._write_down, entry.key, data, entry.owner, tiers)

    def _write_down(self, key: bytes, data: bytes, owner: BlockOwner, tiers: list[ColdTier]) -> None:
        try:
            for tier in tiers:
                try:
                    if not tier.contains(key):
                        tier.put(key, data, owner)
                except Exception:
                    logger.exception("tier %s: write-back failed", tier.name)
        finally:
            with self._lock:
                self._pending_write_backs -= 1
                self.written_back += 1

    # -- the rest -------------------------------------------------------------------------------
    def drop_tenant(self, tenant: str) -> int:
        n = 0
        for tier in self.tiers:
            try:
                n += tier.drop_tenant(tenant)
            except Exception:
                logger.exception("tier %s: drop_tenant failed", tier.name)
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
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                logger.exception("tier %s: close failed", tier.name)
