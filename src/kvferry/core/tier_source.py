"""The scheduler's side of the node's KV store (``kvferry.kvstore``).

Prefix lookup continues the request's hash chain past the device pool's hit
into the store's tiers::

    block_hashes:  | device hit | held by the store (load) | compute ...   | last token |
                   0            hit                        hit + loaded

The runner's connector executes the load and save orders; this module only
asks the store how far the chain goes (``lookup``) and pins paused
conversations (``retain``). The store never raises into the engine: a store
that is down answers every lookup with a miss. No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

from kvferry.kvstore.tier import BlockOwner
from kvferry.core.request import Request


class KVStoreIndex(Protocol):
    """What the scheduler needs of ``KVStoreClient``."""

    @property
    def connected(self) -> bool: ...

    def lookup(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` some tier holds."""
        ...

    def retain(self, keys: list[bytes], owner: BlockOwner, seconds: float) -> object:
        """Soft-pin ``keys`` for ``seconds`` (bounded by the owner's quota)."""
        ...


def block_owners(tenant: str, num_public_blocks: int, first: int, count: int) -> list[BlockOwner]:
    """Owners of the request's blocks ``first .. first + count``: public
    blocks lead the chain (a declared public prefix), the tenant's follow."""
    return [BlockOwner(tenant, public=i < num_public_blocks) for i in range(first, first + count)]


@dataclass(slots=True)
class TierLookupStats:
    queries: int = 0  # tokens looked up past the device hit
    hits: int = 0  # of those, tokens the store holds (before the load cap)


class StoreKVSource:
    """``ExternalKVSource`` backed by the store: the tokens after the device
    hit whose KV some tier holds, capped per request by ``max_load_tokens``
    (0: no cap) so that one request cannot monopolize the store's I/O."""

    def __init__(self, store: KVStoreIndex, block_size: int, max_load_tokens: int = 0,
                 is_up: Callable[[], bool] | None = None) -> None:
        self.store = store
        self.block_size = block_size
        self.max_load_tokens = max_load_tokens
        # Whether to ask the store at all. Lookups run on the step's path:
        # a store that went away would stall each reconnect attempt, so
        # the engine passes the view of a background thread that owns the
        # reconnecting (default: ask the client, which reconnects in place).
        self.is_up = is_up or (lambda: store.connected)
        self.stats = TierLookupStats()

    def num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        bs = self.block_size
        first = num_computed_tokens // bs
        # The last prompt token is always computed (it yields the logits).
        end = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        if self.max_load_tokens:
            end = min(end, first + self.max_load_tokens // bs)
        if end <= first or not self.is_up():
            return 0
        held = min(self.store.lookup(list(request.block_hashes[first:end])), end - first)
        self.stats.queries += (end - first) * bs
        self.stats.hits += held * bs
        return held * bs

    def retain(self, request: Request, num_blocks: int, seconds: float) -> None:
        """Pin the request's first ``num_blocks`` blocks for ``seconds``:
        one call per owner (the public prefix, then the tenant's part)."""
        if num_blocks <= 0 or not self.is_up():
            return
        keys = list(request.block_hashes[:num_blocks])
        split = min(request.num_public_blocks, num_blocks)
        if split:
            self.store.retain(keys[:split], BlockOwner(request.tenant, public=True), seconds)
        if split < num_blocks:
            self.store.retain(keys[split:], BlockOwner(request.tenant), seconds)
