"""Block lifecycle events that the device pool publishes for routers and tiers.

A block's hash is stored only once its KV has been written (after the step's
runner output came back), and removed when the block is evicted for reuse.
Events are msgspec structs so that a subscriber in another process receives
them through the one serializer (``kvferry.messages.encode``).
"""
from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Consecutive full blocks of one request became reusable by content."""

    block_hashes: list[bytes]
    # Hash of the block before the first one; None for the first block of a sequence.
    parent_block_hash: bytes | None
    # The tokens of all the blocks, len == block_size * len(block_hashes).
    token_ids: list[int]
    block_size: int
    # Cache namespace (tenant) of the request that wrote them; "" is public.
    owner: str


class BlockRemoved(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """These hashes are no longer in the pool (evicted to make room)."""

    block_hashes: list[bytes]


KVEvent = BlockStored | BlockRemoved
