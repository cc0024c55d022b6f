"""Allocate, free and look up KV blocks for requests.

Results are typed (``PrefixHit``, ``list[int] | None`` for "not enough
blocks") rather than -1 sentinels. The manager never mutates anything on a
request except its lazily grown ``block_hashes``, which are a pure function
of the request's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.core.block_pool import BlockPool, KVBlock
from kvferry.core.hashing import ExtraKeys, extend_block_hashes
from kvferry.request import Request


@dataclass(slots=True)
class PrefixHit:
    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        model_fingerprint: str = "",
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.model_fingerprint = model_fingerprint
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # How many of a request's blocks are registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    # -- hashing ---------------------------------------------------------
    def _extra(self, request: Request) -> bytes:
        return ExtraKeys(self.model_fingerprint, request.cache_namespace).encode()

    def _update_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, self._extra(request))

    # -- lookup ----------------------------------------------------------
    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """Longest chain of cached blocks matching the request's prefix.

        At most ``num_tokens - 1`` tokens may hit: the last token must be
        computed to produce logits for the next one.
        """
        if not self.enable_caching:
            return PrefixHit()
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit = PrefixHit()
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.blocks.append(block)
        hit.num_tokens = len(hit.blocks) * self.block_size
        return hit

    def record_lookup(self, request: Request, hit: PrefixHit) -> None:
        """Count a lookup once, when the request is admitted (a request that
        waits for blocks is looked up again each step)."""
        if self.enable_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += hit.num_tokens

    # -- allocation ------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``hit`` (first scheduling only) is a prefix hit whose blocks become the
        request's first blocks. Returns the ids of newly allocated blocks, or
        None if the pool cannot supply them (nothing is changed then).
        """
        hit_blocks = hit.blocks if hit else []
        held = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        needed = _cdiv(num_computed + num_new_tokens, self.block_size) - len(held) - len(hit_blocks)
        # Hit blocks sitting in the free queue count as free, but touching them
        # takes them out of it, so they cannot also be allocated.
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - num_evictable_hits:
            return None
        self.pool.touch(hit_blocks)
        new_blocks = self.pool.allocate(max(needed, 0))
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(hit_blocks)
        blocks.extend(new_blocks)
        self.num_cached_blocks.setdefault(request.request_id, len(hit_blocks))
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return [b.block_id for b in new_blocks]

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register blocks that will be full once this step has run. Safe to do
        before the forward pass: within a step every layer writes all new KV
        before any attention reads it, so a same-step hit reads fresh KV."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        self._update_hashes(request)
        blocks = self.req_blocks[request.request_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def free(self, request: Request) -> None:
        """Release all of a request's blocks, tail first (see BlockPool.free)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def can_fit(self, num_tokens: int) -> bool:
        return _cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), (b, refs.get(b.block_id, 0))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
