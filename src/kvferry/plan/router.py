"""Router policies of the simulator: round-robin, least-loaded, prefix-aware.

- least-loaded: the instance with the fewest outstanding requests. Above
  ``SCAN_LIMIT`` instances it compares two instances drawn at random (the
  "power of two choices", nearly as good and O(1): a fleet-scale run cannot
  scan a thousand instances per request).
- prefix-aware: the router's own index of the blocks it sent to each
  instance (what KV events would tell a real router), LRU-bounded by the
  instance's pool. The instance holding the longest prefix wins when it
  covers at least half the prompt and is not more than
  ``PREFIX_BALANCE_SLACK`` requests busier than the least-loaded choice;
  otherwise least-loaded (cache affinity must not pile every request on
  one instance).
"""
from __future__ import annotations

import itertools
import random
from collections import OrderedDict

ROUTERS = ("round-robin", "least-loaded", "prefix-aware")
SCAN_LIMIT = 64
PREFIX_BALANCE_SLACK = 4


class PrefixIndex:
    """Which instances hold which chained block keys. Keys are chained, so
    holding key d means holding the prefix up to d: the longest match is the
    deepest key that any instance holds (one dict lookup per block)."""

    def __init__(self, num_instances: int, capacity: int | None) -> None:
        self.capacity = capacity
        self.holders: dict[int, set[int]] = {}
        self.lru = [OrderedDict() for _ in range(num_instances)]

    def longest(self, keys: tuple[int, ...]) -> tuple[int, set[int]]:
        """(blocks matched, instances holding them)."""
        for depth in range(len(keys), 0, -1):
            holders = self.holders.get(keys[depth - 1])
            if holders:
                return depth, holders
        return 0, set()

    def add(self, i: int, keys: tuple[int, ...]) -> None:
        lru = self.lru[i]
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
                self.holders.setdefault(k, set()).add(i)
        while self.capacity is not None and len(lru) > self.capacity:
            k, _ = lru.popitem(last=False)
            held = self.holders[k]
            held.discard(i)
            if not held:
                del self.holders[k]


class Router:
    """Picks an instance of a pool; an instance exposes ``num_outstanding``
    (and ``expire(now)`` when it computes it lazily)."""

    def __init__(self, policy: str, instances: list, capacity_blocks: int | None, seed: int = 0) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"router must be one of {'/'.join(ROUTERS)}, got {policy!r}")
        self.policy, self.instances = policy, instances
        self._next = itertools.cycle(range(len(instances)))
        self._rng = random.Random(seed)
        self.index = PrefixIndex(len(instances), capacity_blocks) if policy == "prefix-aware" else None

    def pick(self, keys: tuple[int, ...], now: float):
        if self.policy == "round-robin":
            i = next(self._next)
        else:
            i = self._least_loaded(range(len(self.instances)), now)
            if self.index is not None:
                i = self._prefix_choice(keys, i, now)
        if self.index is not None:
            self.index.add(i, keys)
        return self.instances[i]

    def _load(self, i: int, now: float) -> int:
        inst = self.instances[i]
        expire = getattr(inst, "expire", None)
        if expire is not None:
            expire(now)
        return inst.num_outstanding

    def _least_loaded(self, candidates, now: float) -> int:
        candidates = list(candidates) if not isinstance(candidates, range) else candidates
        if len(candidates) > SCAN_LIMIT:
            candidates = self._rng.sample(candidates, 2)
        return min(candidates, key=lambda j: (self._load(j, now), j))

    def _prefix_choice(self, keys: tuple[int, ...], least: int, now: float) -> int:
        depth, holders = self.index.longest(keys)
        if not holders or 2 * depth < len(keys):
            return least
        best = self._least_loaded(sorted(holders) if len(holders) <= SCAN_LIMIT else list(holders), now)
        if self._load(best, now) <= self._load(least, now) + PREFIX_BALANCE_SLACK:
            return best
        return least
