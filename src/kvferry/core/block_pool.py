"""The device tier: KV block objects, refcounts, LRU free queue, hash -> block map.

A block is in exactly one of three states:

* in use   -- ``ref_cnt > 0``; held by one or more requests, or pinned by
              I/O in flight (a pin is a reference, so a pinned block is never
              in the free queue and can never be evicted under the I/O);
* cached   -- ``ref_cnt == 0`` and it has a hash; in the free queue, reusable
              by a prefix hit until evicted;
* free     -- ``ref_cnt == 0`` and no hash; in the free queue.

``free + cached + in use == num_blocks`` always (``check_integrity``).
The free queue is ordered by eviction priority: the head is evicted first.

Lifecycle: allocated -> written (the owner publishes its hash with
``cache_block`` only after the KV is in the block) -> cached (ref_cnt 0,
evictable) -> evicted. Registrations and evictions are queued as
``BlockStored`` / ``BlockRemoved`` events, in order, for ``take_events``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.core.hashing import BlockHash
from kvferry.types.kv_events import BlockRemoved, BlockStored, KVEvent


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Intrusive links of the free queue; None when not in it.
    prev: "KVBlock | None" = field(default=None, repr=False)
    next: "KVBlock | None" = field(default=None, repr=False)
    in_free_queue: bool = False


def _block_id(block: KVBlock) -> int:
    return block.block_id


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves.

    O(1) removal from the middle is what a prefix hit on a cached block needs;
    a deque would make that O(n).
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None and not block.in_free_queue
        last.next, block.prev, block.next, self._tail.prev = block, last, self._tail, block
        block.in_free_queue = True
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next
        assert first is not None and not block.in_free_queue
        self._head.next, block.prev, block.next, first.prev = block, self._head, first, block
        block.in_free_queue = True
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.in_free_queue and block.prev is not None and block.next is not None
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        block.in_free_queue = False
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next
        if first is None or first is self._tail:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self._events: list[KVEvent] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus cached-but-unused."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue (evicting their
        cached content), each with ``ref_cnt == 1``, returned in ascending
        block id.

        The queue decides *which* blocks go (eviction order); the sort only
        decides which of them holds which part of the sequence. Finished
        requests join the queue in reverse, so the head often holds
        descending runs of ids; handed out as popped, a long prompt's blocks
        would lie backwards in memory, and a decode step over backwards runs
        took 1.25x the time of one over forward runs (batch 8, context 4096;
        bench/decode_roofline.py --table-order)."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        out.sort(key=_block_id)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling cached ones out of
        the free queue so they cannot be evicted while in use."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block. Cached blocks reaching zero join
        the tail of the free queue in the order given (earlier = evicted
        sooner); callers pass a request's blocks in reverse, so that its tail
        blocks, the least likely to be shared, are evicted first. Blocks that
        hold no cached content (partial, refused by a quota, or never
        published) go to the head: reusing them costs nothing, whereas taking
        a cached block first would evict reusable KV while empty blocks wait."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def evict_first(self, blocks: list[KVBlock]) -> None:
        """Move unused cached blocks to the head of the free queue: the next
        allocations evict them before anything else (an owner over quota)."""
        for block in reversed(blocks):
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.free_queue.appendleft(block)

    def peek_free(self, n: int) -> list[KVBlock]:
        """The first ``n`` blocks the next allocation would take."""
        out = []
        for block in self.free_queue:
            if len(out) == n:
                break
            out.append(block)
        return out

    def uncache(self, block: KVBlock) -> None:
        """Drop an unused block's cached content now (a purge): it becomes
        a plain free block at the head of the queue."""
        assert block.ref_cnt == 0 and block.in_free_queue, block
        self._evict(block)
        self.free_queue.remove(block)
        self.free_queue.appendleft(block)

    def pin(self, blocks: list[KVBlock]) -> None:
        """Hold blocks for I/O in flight (a read or write by a transfer):
        they cannot be evicted or reallocated until ``unpin``."""
        self.touch(blocks)

    def unpin(self, blocks: list[KVBlock]) -> None:
        self.free(blocks)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full, written block under its content hash. Returns
        False when another block already holds that content (this one stays
        unregistered and becomes plain free when released)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def cache_blocks(
        self,
        blocks: list[KVBlock],
        hashes: list[BlockHash],
        parent: BlockHash | None,
        token_ids: list[int],
        block_size: int,
        owner: str,
    ) -> None:
        """Register consecutive written blocks of one sequence and publish
        the newly registered ones. ``token_ids`` are the blocks' tokens,
        ``block_size`` each; ``parent`` is the hash before ``hashes[0]``."""
        run: list[int] = []  # indices of a run of newly registered blocks
        for i, (block, block_hash) in enumerate(zip(blocks, hashes)):
            if self.cache_block(block, block_hash):
                run.append(i)
                continue
            self._publish_stored(run, hashes, parent, token_ids, block_size, owner)
            run = []
        self._publish_stored(run, hashes, parent, token_ids, block_size, owner)

    def _publish_stored(self, run, hashes, parent, token_ids, block_size, owner) -> None:
        if not run:
            return
        first, end = run[0], run[-1] + 1
        self._events.append(
            BlockStored(
                block_hashes=hashes[first:end],
                parent_block_hash=hashes[first - 1] if first else parent,
                token_ids=token_ids[first * block_size : end * block_size],
                block_size=block_size,
                owner=owner,
            )
        )

    def take_events(self) -> list[KVEvent]:
        """Drain the events queued since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        self._events.append(BlockRemoved(block_hashes=[block.block_hash]))
        block.block_hash = None
        self.num_evictions += 1

    def counts(self) -> dict[str, int]:
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached = sum(1 for b in self.free_queue if b.block_hash is not None)
        free = sum(1 for b in self.free_queue if b.block_hash is None)
        return {"free": free, "cached": cached, "in_use": in_use}

    def check_integrity(self) -> None:
        """Assert the pool's invariants; cheap enough for tests, not for steps."""
        counts = self.counts()
        assert sum(counts.values()) == self.num_blocks, counts
        queued = list(self.free_queue)
        assert len(queued) == self.free_queue.num_free
        for block in self.blocks:
            assert block.ref_cnt >= 0
            assert block.in_free_queue == (block.ref_cnt == 0), block
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash
