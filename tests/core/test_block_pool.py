from kvferry.core.block_pool import BlockPool
from kvferry.core.hashing import ROOT_PARENT, ExtraKeys, extend_block_hashes, hash_block


def test_allocate_takes_lowest_ids_first():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.counts() == {"free": 3, "cached": 0, "in_use": 3}
    pool.check_integrity()


def test_free_order_sets_eviction_order():
    pool = BlockPool(4)
    a = pool.allocate(4)
    for i, b in enumerate(a):
        pool.cache_block(b, bytes([i]) * 32)
    # A request frees its blocks in reverse: tail blocks are evicted first.
    pool.free(list(reversed(a)))
    assert [b.block_id for b in pool.free_queue] == [3, 2, 1, 0]
    assert pool.counts() == {"free": 0, "cached": 4, "in_use": 0}
    evicted = pool.allocate(1)[0]
    assert evicted.block_id == 3
    assert evicted.block_hash is None and bytes([3]) * 32 not in pool.cached
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_touch_pulls_cached_block_out_of_free_queue():
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.cache_block(a[0], b"h0")
    pool.free(a)
    hit = pool.lookup(b"h0")
    assert hit is a[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and not hit.in_free_queue
    # The hit block can no longer be handed out: remaining order is 1 (plain,
    # freed to the head), 2.
    assert [b.block_id for b in pool.allocate(2)] == [1, 2]
    assert pool.counts() == {"free": 0, "cached": 0, "in_use": 3}
    pool.check_integrity()


def test_shared_block_refcount():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"x")
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free([b])
    assert b.ref_cnt == 1 and not b.in_free_queue
    pool.free([b])
    assert b.in_free_queue
    assert pool.counts() == {"free": 1, "cached": 1, "in_use": 0}


def test_duplicate_content_keeps_first_registration():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    assert pool.cached[b"same"] is a and b.block_hash is None
    pool.free([b, a])
    assert pool.counts() == {"free": 1, "cached": 1, "in_use": 0}


def test_hash_chain_depends_on_parent_namespace_and_model():
    tokens = list(range(8))
    h = []
    extend_block_hashes(h, tokens, 4, ExtraKeys("m", "").encode())
    assert len(h) == 2 and h[0] == hash_block(ROOT_PARENT, [0, 1, 2, 3], ExtraKeys("m", "").encode())
    other_ns = []
    extend_block_hashes(other_ns, tokens, 4, ExtraKeys("m", "tenant-a").encode())
    assert other_ns[0] != h[0]
    other_model = []
    extend_block_hashes(other_model, tokens, 4, ExtraKeys("m2", "").encode())
    assert other_model[0] != h[0]
    # Same block content under a different parent hashes differently.
    shifted = []
    extend_block_hashes(shifted, [9, 9, 9, 9] + tokens[4:], 4, ExtraKeys("m", "").encode())
    assert shifted[1] != h[1]
    # Tagged fields: moving bytes between model and namespace changes the key.
    assert ExtraKeys("ab", "c").encode() != ExtraKeys("a", "bc").encode()


def test_hash_is_stable_across_processes():
    import subprocess
    import sys

    code = (
        "from kvferry.core.hashing import *;"
        "h=[];extend_block_hashes(h,list(range(16)),16,ExtraKeys('m','n').encode());print(h[0].hex())"
    )
    runs = {subprocess.check_output([sys.executable, "-c", code], text=True).strip() for _ in range(2)}
    mine = []
    extend_block_hashes(mine, list(range(16)), 16, ExtraKeys("m", "n").encode())
    assert runs == {mine[0].hex()}
