"""Which worker holds which KV blocks, as their block events tell it.

Each engine core ships ``BlockStored`` / ``BlockRemoved`` events with its
step outputs; the router applies them here and asks, for a request's own
chain of block hashes, how many leading blocks each worker holds.

Tenants: a request's hashes are computed from its own chain, whose root and
extra keys carry its cache namespace (its tenant, or the public namespace
for a declared public prefix). Another tenant's private block has a hash in
another namespace, which no hash of this request can equal, so it never adds
to this request's overlap. Placement therefore depends on the request's own
tenant's blocks, public blocks and load, never on another tenant's private
prefixes: routing reveals nothing that the caller could not have cached itself.
"""
from __future__ import annotations

from collections.abc import Iterable

from kvferry.core.hashing import BlockHash
from kvferry.types.kv_events import BlockRemoved, BlockStored, KVEvent


class PrefixIndex:
    """worker name -> the set of block hashes it holds now."""

    def __init__(self) -> None:
        self._held: dict[str, set[BlockHash]] = {}

    def apply(self, worker: str, events: Iterable[KVEvent]) -> None:
        """Apply one worker's events in the order it emitted them."""
        held = self._held.setdefault(worker, set())
        for event in events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)

    def drop(self, worker: str) -> None:
        """Forget a worker (it died or left): its blocks are gone with it."""
        self._held.pop(worker, None)

    def overlap_blocks(self, worker: str, block_hashes: list[BlockHash]) -> int:
        """How many leading blocks of this chain ``worker`` holds. A chain
        hit stops at the first missing block (the block after it is keyed
        by its parent, so it cannot be reused without it)."""
        held = self._held.get(worker)
        if not held:
            return 0
        n = 0
        for h in block_hashes:
            if h not in held:
                break
            n += 1
        return n

    def num_blocks(self, worker: str) -> int:
        return len(self._held.get(worker, ()))
