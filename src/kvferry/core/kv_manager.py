"""Allocate, free and look up KV blocks for requests.

Results are typed (``PrefixHit``, ``NewBlocks | None`` for "not enough
blocks") rather than -1 sentinels. The manager never mutates anything on a
request except its lazily grown ``block_hashes``, which are a pure function
of the request's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.core.block_pool import BlockPool, KVBlock
from kvferry.core.hashing import CacheScope, ChainKeys, extend_block_hashes
from kvferry.types.kv_events import KVEvent
from kvferry.core.request import Request


@dataclass(slots=True)
class PrefixHit:
    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0


@dataclass(slots=True)
class NewBlocks:
    """What ``allocate_slots`` added to a request's block table, in order."""

    hit_block_ids: list[int]  # prefix-hit blocks (first scheduling only)
    block_ids: list[int]  # freshly allocated

    @property
    def all_block_ids(self) -> list[int]:
        return self.hit_block_ids + self.block_ids


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found
    public_hits: int = 0  # of hits, tokens in public-prefix blocks
    # Per owner (a tenant, or the public pool under its namespace):
    # OWNER_STAT_FIELDS[:5]. Bounded by the number of tenants.
    by_owner: dict[str, list[int]] = field(default_factory=dict)

    def of(self, owner: str) -> list[int]:
        return self.by_owner.setdefault(owner, [0, 0, 0, 0, 0])


# The columns of ``KVCacheManager.owner_stats``: cumulative tokens looked
# up, hit, hit in public blocks; cumulative blocks refused by the quota,
# evicted (cached content lost to make room); blocks cached now.
OWNER_STAT_FIELDS = ("queries", "hits", "public_hits", "refused_blocks", "evicted_blocks", "cached_blocks")
# A tenant holding more than this times its weighted share of the tenants'
# cached blocks loses its blocks first when the pool must evict (the slack
# keeps near-equal tenants from trading places on every allocation).
FAIR_EVICTION_SLACK = 1.1
# The pin that holds every public block a declaration wrote: public blocks
# are never evicted by pressure, only dropped when no declaration holds
# them any more (``drop_public``) or by a purge of the public pool. Were they evictable, the order in which readers
# touched them would tell a publisher which of its prefixes another tenant
# read (its candidates' survival under eviction pressure).
PUBLIC_PIN = "public-prefixes"


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        model_fingerprint: str = "",
        kv_dtype: str = "",
        lookahead_tokens: int = 0,
    ) -> None:
        """``lookahead_tokens``: slots every request holds past the tokens it
        is given room for, where a drafter writes KV before the next step is
        planned (a draft model on a pipeline's last stage drafts right after
        sampling, before the next step gives its drafts room)."""
        self.block_size = block_size
        self.lookahead_tokens = lookahead_tokens
        self.enable_caching = enable_caching
        self.model_fingerprint = model_fingerprint
        self.kv_dtype = kv_dtype
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # How many of a request's blocks are registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Blocks of finished requests still read by a send in flight.
        self.delayed_free: dict[str, list[KVBlock]] = {}
        # Extra references held by I/O in flight, by I/O id.
        self.pinned: dict[str, list[KVBlock]] = {}
        self.stats = PrefixCacheStats()
        # Owners of the blocks whose hash they published, for quotas and
        # fair eviction: owner -> block ids, and back. The owner is the
        # request's tenant (all its cache_salt namespaces share one quota),
        # else its namespace (an engine without tenants), and the public
        # namespace for public blocks. A block leaves when it is reallocated
        # (its cached content evicted) or purged.
        self.owned: dict[str, set[int]] = {}
        self._owner_of: dict[int, str] = {}
        self.public_owners: set[str] = set()
        self.owner_weight: dict[str, float] = {}  # latest weight seen per tenant
        # Requests that hit their quota: their later blocks are not cached
        # either (a chain with a gap could never be hit past the gap).
        self._quota_refused: set[str] = set()

    # -- hashing ---------------------------------------------------------
    def _scope(self, request: Request) -> CacheScope:
        return request.cache_scope

    def _settle_public_scope(self, request: Request) -> None:
        """Whether a reader of a public prefix keeps its public blocks.

        Only a declaration's own prefill writes public blocks. Any other
        request whose prompt begins with a declared prefix reads the public
        chain only if it is cached in full (every block of the prefix the
        request may hit) and gives at least as many hits as the request's
        private chain; otherwise the request drops to its private namespace
        for good, and what it computes is never keyed public::

            prompt     | p p p p | p p p p | p x x x |
            public     |  hit    |  hit    |  ...     -> read public, compute privately after
            public     |  hit    |  miss   |          -> private chain for every block
        """
        if not request.num_public_blocks or request.writes_public_blocks:
            return
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        needed = min(request.num_public_blocks, max_blocks)
        public_hits = self._num_cached(request.block_hashes[:max_blocks])
        private = ChainKeys.of(CacheScope(request.cache_namespace), self.model_fingerprint, self.kv_dtype)
        private_hashes: list = []
        extend_block_hashes(private_hashes, request.all_token_ids, self.block_size, private)
        if public_hits >= needed and public_hits >= self._num_cached(private_hashes[:max_blocks]):
            return
        request.num_public_blocks = 0
        request.block_hashes[:] = private_hashes

    def _num_cached(self, hashes: list) -> int:
        """How many leading blocks of a chain are cached on this pool."""
        for i, block_hash in enumerate(hashes):
            if self.pool.lookup(block_hash) is None:
                return i
        return len(hashes)

    def _update_hashes(self, request: Request) -> None:
        if len(request.block_hashes) >= len(request.all_token_ids) // self.block_size:
            return  # nothing new (skip building the keys: this runs every step)
        keys = ChainKeys.of(self._scope(request), self.model_fingerprint, self.kv_dtype)
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, keys)

    # -- lookup ----------------------------------------------------------
    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """Longest chain of cached blocks matching the request's prefix.

        At most ``num_tokens - 1`` tokens may hit: the last token must be
        computed to produce logits for the next one.
        """
        if not self.enable_caching:
            return PrefixHit()
        self._settle_public_scope(request)
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
            # Public blocks lead the chain, so the hit's first ones are public.
            public = min(len(hit.blocks), request.num_public_blocks) * self.block_size
            self.stats.queries += request.num_tokens
            self.stats.hits += hit.num_tokens
            self.stats.public_hits += public
            counts = self.stats.of(owner_of(request))
            counts[0] += request.num_tokens
            counts[1] += hit.num_tokens
            counts[2] += public

    # -- allocation ------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        num_external_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> NewBlocks | None:
        """Make room for tokens after the request's computed ones::

            | computed | hit (first scheduling) | external | new | lookahead |
            '--------- held ----------'

        ``hit`` blocks (a prefix hit) become the request's first blocks.
        ``num_external_tokens`` get blocks that a load order fills (KV from a
        tier, another worker, or the host swap space). ``num_lookahead_tokens``
        reserve slots beyond the new tokens (draft tokens of the next step).
        Returns the newly allocated blocks, or None if the pool cannot supply
        them (nothing is changed then).
        """
        hit_blocks = hit.blocks if hit else []
        held = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        num_total = (num_computed + num_external_tokens + num_new_tokens + num_lookahead_tokens
                     + self.lookahead_tokens)
        needed = _cdiv(num_total, self.block_size) - len(held) - len(hit_blocks)
        # Hit blocks sitting in the free queue count as free, but touching them
        # takes them out of it, so they cannot also be allocated.
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - num_evictable_hits:
            return None
        self.pool.touch(hit_blocks)
        self._evict_fairly(needed)
        new_blocks = self.pool.allocate(max(needed, 0))
        self._disown(new_blocks)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(hit_blocks)
        blocks.extend(new_blocks)
        self.num_cached_blocks.setdefault(request.request_id, len(hit_blocks))
        return NewBlocks([b.block_id for b in hit_blocks], [b.block_id for b in new_blocks])

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's blocks whose KV is now written: every full
        block below ``num_computed_tokens``. Call only once the runner has
        run the step (a hash published earlier could be hit by a request
        that then reads KV not yet written)."""
        if not self.enable_caching or request.request_id not in self.req_blocks:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks[request.request_id]
        if request.writes_public_blocks and num_full:
            # The declaration holds its public blocks, those it hit (cached by
            # an earlier declaration, unpinned by a purge) and those it writes.
            self._update_hashes(request)
            self._publish_public(request, start, num_full)
        if num_full <= start:
            return
        self._update_hashes(request)
        # One run per owner: public blocks first, then the tenant's.
        scope = self._scope(request)
        split = min(max(start, scope.num_public_blocks), num_full)
        # (Public-range blocks were published above for a declaration; a
        # reader computes some only where its prompt ends inside the prefix,
        # and they stay unpublished: never written public.)
        if split < num_full:
            end = self._within_quota(request, split, num_full)
            if split < end:
                owner = owner_of(request)
                self.owner_weight[owner] = request.tenant_weight
                self._publish(request, split, end, scope.namespace, owner)
        self.num_cached_blocks[request.request_id] = num_full

    def _within_quota(self, request: Request, start: int, end: int) -> int:
        """How far the tenant's quota lets ``request`` publish: blocks past
        it are refused (counted) and stay uncached. An owner already over
        its quota (lowered since) has its unused blocks moved to be evicted first."""
        quota, owner = request.cache_quota_blocks, owner_of(request)
        if quota is None:
            return end
        if request.request_id in self._quota_refused:
            return start
        owned = self.owned.get(owner, set())
        if len(owned) > quota:
            self.pool.evict_first(sorted((self.pool.blocks[i] for i in owned), key=lambda b: b.block_id)
                                  [: len(owned) - quota])
        room = max(0, quota - len(owned))
        if end - start > room:
            self.stats.of(owner)[3] += end - start - room
            self._quota_refused.add(request.request_id)
            return start + room
        return end

    def _publish(self, request: Request, start: int, end: int, namespace: str, owner: str) -> None:
        bs = self.block_size
        blocks = self.req_blocks[request.request_id][start:end]
        fresh = [b for b in blocks if b.block_hash is None]
        self.pool.cache_blocks(
            self.req_blocks[request.request_id][start:end],
            request.block_hashes[start:end],
            parent=request.block_hashes[start - 1] if start else None,
            token_ids=request.all_token_ids[start * bs : end * bs],
            block_size=bs,
            owner=namespace,
        )
        for b in fresh:
            if b.block_hash is not None:  # registered now (not a duplicate of cached content)
                self.owned.setdefault(owner, set()).add(b.block_id)
                self._owner_of[b.block_id] = owner

    def _disown(self, blocks: list[KVBlock]) -> None:
        """Freshly allocated blocks lost their cached content (if any): an
        eviction, counted against the owner."""
        for b in blocks:
            owner = self._owner_of.pop(b.block_id, None)
            if owner is not None:
                self.owned[owner].discard(b.block_id)
                self.stats.of(owner)[4] += 1

    def _evict_fairly(self, needed: int) -> None:
        """Before taking ``needed`` blocks from the free queue: if that would
        evict cached blocks of tenants, take them from the tenant most over
        its weighted share of the tenants' cached blocks (its unused blocks,
        least recently used first, move to the head of the queue). LRU alone
        would let a flooding tenant push everyone else's blocks out."""
        if needed <= 0 or len(self.owned) - len(self.public_owners) < 2:
            return
        head = self.pool.peek_free(needed)
        plain = [b for b in head if b.block_hash is None]
        victims = {self._owner_of.get(b.block_id) for b in head if b.block_hash is not None}
        if not victims:
            return  # plain free blocks only: nothing is evicted
        owner = self._most_over_share()
        if owner is None or victims == {owner}:
            return
        # The plain free blocks still go first; the evictions come from owner.
        blocks = [b for b in self.pool.free_queue if self._owner_of.get(b.block_id) == owner]
        self.pool.evict_first(plain + blocks[: needed - len(plain)])

    def _most_over_share(self) -> str | None:
        tenants = {o: len(ids) for o, ids in self.owned.items() if o not in self.public_owners and ids}
        total_weight = sum(self.owner_weight.get(o, 1.0) for o in tenants)
        total = sum(tenants.values())
        if not tenants or total_weight <= 0:
            return None
        over = {o: n / (total * self.owner_weight.get(o, 1.0) / total_weight) for o, n in tenants.items()}
        owner = max(over, key=over.__getitem__)
        return owner if over[owner] > FAIR_EVICTION_SLACK else None

    def _publish_public(self, request: Request, start: int, num_full: int) -> None:
        """A declaration's prefill: publish its new public blocks and hold
        every public block it has under PUBLIC_PIN (each once)."""
        scope = self._scope(request)
        split = min(scope.num_public_blocks, num_full)
        if not split:
            return
        self.public_owners.add(scope.public_namespace)
        if start < split:
            self._publish(request, start, split, scope.public_namespace, scope.public_namespace)
        held = {b.block_id for b in self.pinned.get(PUBLIC_PIN, ())}
        blocks = [b for h in request.block_hashes[:split]
                  if (b := self.pool.lookup(h)) is not None and b.block_id not in held]
        if blocks:
            self.pin(PUBLIC_PIN, [b.block_id for b in blocks])

    def purge(self, owner: str) -> int:
        """Drop the owner's cached blocks that no request uses (they become
        plain free blocks, first in line); blocks in use stay cached. Returns
        how many were dropped. Purging a public pool first lets go of the
        public pin (its declarations' prefills write them again)."""
        if owner in self.public_owners:
            self.unpin(PUBLIC_PIN)
        unused = [self.pool.blocks[i] for i in self.owned.get(owner, ()) if self.pool.blocks[i].ref_cnt == 0]
        for b in unused:
            self.pool.uncache(b)
            self._owner_of.pop(b.block_id, None)
            self.owned[owner].discard(b.block_id)
        return len(unused)

    def public_block_hashes(self, public_namespace: str, token_ids: list[int]) -> list:
        """The chain hashes a declaration's prefill gives the full blocks of
        ``token_ids`` in ``public_namespace`` (the keys of the device pool
        and of every KV tier)."""
        num_blocks = len(token_ids) // self.block_size
        if not public_namespace or not num_blocks:
            return []
        scope = CacheScope(public_namespace=public_namespace, num_public_blocks=num_blocks)
        block_hashes: list = []
        extend_block_hashes(block_hashes, token_ids, self.block_size,
                            ChainKeys.of(scope, self.model_fingerprint, self.kv_dtype))
        return block_hashes

    def drop_public(self, public_namespace: str, token_ids: list[int], first_block: int = 0) -> int:
        """A deleted declaration's own public blocks: those of ``token_ids``
        from ``first_block`` on (the caller leaves out the leading blocks
        another declaration shares), keyed as its prefill keyed them. Let go
        of their public pin and drop those no request uses, as a purge does;
        a block a running request holds stays cached until evicted. Every
        other public block stays pinned: nothing needs prefilling again.
        Returns how many were dropped."""
        own = self.public_block_hashes(public_namespace, token_ids)[first_block:]
        if not own:
            return 0
        pinned = self.pinned.get(PUBLIC_PIN, [])
        gone = {b.block_id for h in own if (b := self.pool.lookup(h)) is not None
                and self._owner_of.get(b.block_id) in self.public_owners}
        if not gone:
            return 0
        released = [b for b in pinned if b.block_id in gone]
        self.pinned[PUBLIC_PIN] = [b for b in pinned if b.block_id not in gone]
        self.pool.unpin(list(reversed(released)))
        dropped = 0
        for block_id in gone:
            block = self.pool.blocks[block_id]
            if block.ref_cnt == 0:
                self.pool.uncache(block)
                self.owned[self._owner_of.pop(block_id)].discard(block_id)
                dropped += 1
        return dropped

    def owner_stats(self) -> dict[str, list[int]]:
        """Per owner (tenant, or public namespace): OWNER_STAT_FIELDS."""
        out = {o: [*c, len(self.owned.get(o, ()))] for o, c in self.stats.by_owner.items()}
        for o, blocks in self.owned.items():
            out.setdefault(o, [0, 0, 0, 0, 0, len(blocks)])
        return out

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def free(self, request: Request, delay: bool = False) -> None:
        """Release all of a request's blocks, tail first (see BlockPool.free).

        ``delay``: I/O still reads them (a send in flight); they stay held
        until ``release_delayed(request_id)``.
        """
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self._quota_refused.discard(request.request_id)
        if delay:
            self.delayed_free[request.request_id] = blocks
            return
        self.pool.free(list(reversed(blocks)))

    def release_delayed(self, request_id: str) -> None:
        blocks = self.delayed_free.pop(request_id, [])
        self.pool.free(list(reversed(blocks)))

    def pin(self, io_id: str, block_ids: list[int]) -> None:
        """Pin blocks under an I/O id (a transfer reading or writing them):
        they cannot be evicted or reallocated until ``unpin(io_id)``."""
        blocks = [self.pool.blocks[i] for i in block_ids]
        self.pool.pin(blocks)
        self.pinned.setdefault(io_id, []).extend(blocks)

    def unpin(self, io_id: str) -> None:
        self.pool.unpin(list(reversed(self.pinned.pop(io_id, []))))

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def can_fit(self, num_tokens: int) -> bool:
        return _cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in [*self.req_blocks.values(), *self.delayed_free.values(), *self.pinned.values()]:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), (b, refs.get(b.block_id, 0))
        for owner, ids in self.owned.items():
            for i in ids:
                assert self.pool.blocks[i].block_hash is not None and self._owner_of[i] == owner, (owner, i)


def owner_of(request: Request) -> str:
    """Whose quota a request's private blocks count against."""
    return request.tenant or request.cache_namespace


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
