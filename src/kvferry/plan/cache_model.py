"""A prefix cache over chained block keys, for cache-only and fast runs.

Like the real pool, a request hits the longest run of its leading blocks
present in the cache; then all its blocks are inserted (its KV is written)
and become the most recently used. A full cache evicts least recently used
blocks; ``capacity=None`` never evicts (the trace's reuse ceiling).
"""
from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.query_blocks = 0
        self.hit_blocks = 0

    def match(self, keys: tuple[int, ...]) -> int:
        """Leading blocks of ``keys`` in the cache (no side effects)."""
        n = 0
        for k in keys:
            if k not in self.blocks:
                break
            n += 1
        return n

    def access(self, keys: tuple[int, ...]) -> int:
        """Serve one prompt: count and return its hit blocks, then cache all its blocks."""
        hit = self.match(keys)
        self.query_blocks += len(keys)
        self.hit_blocks += hit
        for k in keys:
            if k in self.blocks:
                self.blocks.move_to_end(k)
            else:
                self.blocks[k] = None
        if self.capacity is not None:
            while len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)
        return hit

    @property
    def block_hit_ratio(self) -> float | None:
        return self.hit_blocks / self.query_blocks if self.query_blocks else None
