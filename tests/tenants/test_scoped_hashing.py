"""Block keys under a cache scope: namespaces at the root and in every key,
the public/private boundary, and the owners of published blocks."""
from __future__ import annotations

import pytest

from kvferry.core.hashing import ROOT_PARENT, CacheScope, ChainKeys, ExtraKeys, chain_root, extend_block_hashes
from kvferry.types.kv_events import BlockStored
from kvferry.core.kv_manager import KVCacheManager
from kvferry.core.request import Request
from kvferry.sampling import SamplingParams
from kvferry.serve.public_prefixes import PublicPrefixes, TokenTrie
from kvferry.serve.tenants import CacheNamespaces

TOKENS = list(range(100, 116))  # four blocks of 4


def hashes(scope: CacheScope, tokens=TOKENS, fingerprint="m", kv_dtype="bfloat16") -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, 4, ChainKeys.of(scope, fingerprint, kv_dtype))
    return out


def test_namespaces_share_no_key_and_public_blocks_are_shared():
    a, b = hashes(CacheScope("ns-a")), hashes(CacheScope("ns-b"))
    assert not set(a) & set(b)
    pa = hashes(CacheScope("ns-a", "pub", num_public_blocks=2))
    pb = hashes(CacheScope("ns-b", "pub", num_public_blocks=2))
    assert pa[:2] == pb[:2]  # inside the public prefix: one key for every tenant
    assert not set(pa[2:]) & set(pb[2:])  # past it: private, though the parent is shared
    assert not set(pa[2:]) & set(a)  # and not the keys of a fully private chain either
    assert chain_root("ns-a") != chain_root("ns-b") != ROOT_PARENT == chain_root("")


def test_kv_dtype_and_model_are_in_every_key():
    base = hashes(CacheScope("ns"))
    assert not set(base) & set(hashes(CacheScope("ns"), kv_dtype="float32"))
    assert not set(base) & set(hashes(CacheScope("ns"), fingerprint="m2"))
    assert ExtraKeys("m", "n", "a").encode() != ExtraKeys("m", "na", "").encode()


def test_scope_rejects_public_blocks_without_a_namespace():
    with pytest.raises(ValueError, match="public_namespace"):
        CacheScope("ns", "", 1)
    with pytest.raises(ValueError, match="num_public_blocks"):
        CacheScope("ns", "pub", -1)


def request(rid: str, ns: str, public_blocks: int = 0, writes: bool = False, tokens=None) -> Request:
    scope = CacheScope(ns, "pub" if public_blocks else "", public_blocks, writes_public=writes)
    return Request(rid, list(tokens or TOKENS) + [7], SamplingParams(max_tokens=1), cache_scope=scope)


def declaration(rid: str = "decl", public_blocks: int = 2) -> Request:
    """A declaration's own prefill: the prefix alone, in the public namespace."""
    return Request(rid, list(TOKENS[: public_blocks * 4]), SamplingParams(max_tokens=1),
                   cache_scope=CacheScope("pub", "pub", public_blocks, writes_public=True))


def run_prefill(kv: KVCacheManager, req: Request) -> int:
    hit = kv.find_prefix_hit(req)
    kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    kv.free(req)
    return hit.num_tokens


def stored_owners(kv: KVCacheManager) -> list[tuple[str, int]]:
    return [(e.owner, len(e.block_hashes)) for e in kv.take_events() if isinstance(e, BlockStored)]


def test_only_the_declaration_writes_public_blocks_and_readers_hit_them():
    kv = KVCacheManager(32, 4, model_fingerprint="m", kv_dtype="bfloat16")
    # A tenant's prompt that matches a prefix not yet prefilled stays private:
    # nothing it computes is keyed public.
    assert run_prefill(kv, request("a1", "ns-a", public_blocks=2)) == 0
    assert stored_owners(kv) == [("ns-a", 4)]
    assert run_prefill(kv, declaration()) == 0
    assert stored_owners(kv) == [("pub", 2)]
    assert run_prefill(kv, request("b1", "ns-b", public_blocks=2)) == 8  # the public blocks only
    assert stored_owners(kv) == [("ns-b", 2)]  # its own tail, private
    # A keeps its private hits after the declaration (its private chain is longer).
    assert run_prefill(kv, request("a2", "ns-a", public_blocks=2)) == 16
    assert run_prefill(kv, request("b2", "ns-b")) == 0  # no public prefix matched: all private
    kv.check_integrity()


def test_a_reader_never_publishes_public_blocks_and_they_stay_pinned():
    kv = KVCacheManager(32, 4, model_fingerprint="m", kv_dtype="bfloat16")
    # A prompt that ends inside the prefix computes the prefix's last block
    # itself: it stays unpublished (only the declaration writes public keys).
    assert run_prefill(kv, request("a1", "ns-a", public_blocks=4, tokens=TOKENS[:12])) == 0
    assert stored_owners(kv) == [("ns-a", 3)]
    assert run_prefill(kv, declaration(public_blocks=4)) == 0
    assert stored_owners(kv) == [("pub", 4)]
    reader = request("b1", "ns-b", public_blocks=4, tokens=TOKENS[:15])
    assert run_prefill(kv, reader) == 12 and reader.num_public_blocks == 4
    assert stored_owners(kv) == []
    # Public blocks are pinned: pressure never evicts them (the order
    # readers touched them must not decide which survive).
    public_ids = {b.block_id for b in kv.pinned["public-prefixes"]}
    assert len(public_ids) == 4
    for i in range(8):
        run_prefill(kv, Request(f"f{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 20)),
                                SamplingParams(max_tokens=1), cache_scope=CacheScope("ns-f")))
    assert all(kv.pool.blocks[i].block_hash is not None for i in public_ids)
    assert run_prefill(kv, request("c1", "ns-c", public_blocks=4)) == 16
    # A purge of the public pool lets them go.
    assert kv.purge("pub") == 4 and "public-prefixes" not in kv.pinned
    assert run_prefill(kv, request("c2", "ns-c", public_blocks=4)) == 0
    kv.check_integrity()


def test_a_deleted_declaration_drops_its_own_blocks_and_keeps_the_shared_ones():
    kv = KVCacheManager(32, 4, model_fingerprint="m", kv_dtype="bfloat16")
    shorter = TOKENS[:8]  # a declaration of the first two blocks; the other holds all four
    assert run_prefill(kv, declaration(public_blocks=4)) == 0
    assert run_prefill(kv, declaration("decl-2", public_blocks=2)) == 4  # its last token is computed
    assert run_prefill(kv, request("a1", "ns-a", tokens=TOKENS)) == 0  # a private copy of the same tokens
    private = {b.block_id for b in kv.pool.cached.values()} - {b.block_id for b in kv.pinned["public-prefixes"]}
    # A running reader holds the first three.
    held = request("b1", "ns-b", public_blocks=3, tokens=TOKENS[:12])
    kv.allocate_slots(held, held.num_tokens, kv.find_prefix_hit(held))
    # The four-block declaration is deleted; the other begins with its first two.
    assert kv.drop_public("pub", TOKENS, first_block=2) == 1  # block 3; block 2 is in use
    assert len(kv.pinned["public-prefixes"]) == 2
    kv.free(held)
    assert run_prefill(kv, request("c1", "ns-c", public_blocks=2, tokens=shorter)) == 8  # still hit
    stored_owners(kv)
    assert run_prefill(kv, declaration("decl-3", public_blocks=2)) == 4 and stored_owners(kv) == []  # no new block
    assert len(kv.owned["pub"]) == 3  # the block a reader held stays cached until evicted, unpinned
    assert {b.block_id for b in kv.pool.cached.values()} >= private  # nothing private touched
    assert kv.drop_public("pub", shorter) == 2 and kv.pinned["public-prefixes"] == []
    assert kv.drop_public("pub", shorter) == 0  # twice: nothing left
    assert kv.drop_public("ns-a", TOKENS) == 0  # a private namespace is never dropped this way
    kv.check_integrity()


def test_the_trie_counts_the_blocks_a_remaining_declaration_shares():
    prefixes = PublicPrefixes(block_size=4)
    long, short = prefixes.register(list(range(12))), prefixes.register(list(range(6)))
    other = prefixes.register(list(range(9)) + [99, 98, 97])
    prefixes.remove(long.id)
    # Tokens 0..8 begin "other": blocks 0 and 1 (tokens 0..7) are shared, block 2 is not.
    assert prefixes.num_shared_blocks(list(range(12))) == 2
    prefixes.remove(other.id)
    assert prefixes.num_shared_blocks(list(range(12))) == 1  # "short" holds 6 tokens: one whole block
    prefixes.remove(short.id)
    assert prefixes.num_shared_blocks(list(range(12))) == 0


def test_token_trie_longest_registered_prefix():
    trie = TokenTrie()
    assert trie.insert([1, 2, 3]) and trie.insert([1, 2, 3, 4, 5]) and not trie.insert([1, 2, 3])
    assert trie.longest_prefix_of([1, 2, 3, 4, 9]) == 3
    assert trie.longest_prefix_of([1, 2, 3, 4, 5, 6]) == 5
    assert trie.longest_prefix_of([1, 2]) == 0 and trie.longest_prefix_of([]) == 0
    prefixes = PublicPrefixes(block_size=4)
    r = prefixes.register(list(range(10)))
    assert (r.num_tokens, r.num_blocks, r.new) == (10, 2, True)


def test_namespaces_are_keyed_by_the_secret_and_salt_only_narrows():
    one, two = CacheNamespaces(b"s" * 32), CacheNamespaces(b"t" * 32)
    assert one.tenant("acme") == CacheNamespaces(b"s" * 32).tenant("acme")
    assert one.tenant("acme") != two.tenant("acme") and one.tenant("acme") != one.tenant("beta")
    assert one.public not in {one.tenant("public"), one.tenant("")}
    salted = {one.tenant("acme", "x"), one.tenant("beta", "x"), one.tenant("acme")}
    assert len(salted) == 3
    with pytest.raises(ValueError, match="cache_secret"):
        CacheNamespaces(b"short")


def quota_request(rid: str, ns: str, first: int, quota: int | None) -> Request:
    tokens = list(range(first, first + 16)) + [7]  # four private blocks of 4
    return Request(rid, tokens, SamplingParams(max_tokens=1), cache_scope=CacheScope(ns, quota_blocks=quota))


def test_quota_refuses_writes_past_it_and_counts_them():
    kv = KVCacheManager(32, 4)
    run_prefill(kv, quota_request("a1", "ns-a", 100, quota=2))
    assert len(kv.owned["ns-a"]) == 2 and kv.stats.of("ns-a")[3] == 2  # two cached, two refused
    assert run_prefill(kv, quota_request("a2", "ns-a", 100, quota=2)) == 8  # the two cached blocks hit
    run_prefill(kv, quota_request("a3", "ns-a", 500, quota=2))  # at quota: nothing new is cached
    assert len(kv.owned["ns-a"]) == 2 and kv.stats.of("ns-a")[3] == 2 + 2 + 4
    run_prefill(kv, quota_request("b1", "ns-b", 100, quota=None))  # no quota: everything cached
    assert len(kv.owned["ns-b"]) == 4 and kv.owner_stats()["ns-b"][3:] == [0, 0, 4]
    kv.check_integrity()


def test_owner_over_a_lowered_quota_is_evicted_first():
    kv = KVCacheManager(16, 4)
    run_prefill(kv, quota_request("b1", "ns-b", 300, quota=None))  # 4 cached blocks of b (older)
    run_prefill(kv, quota_request("a1", "ns-a", 100, quota=None))  # then 4 of a (newer)
    # a's quota drops to 1: its next request is refused any new block, and
    # a's three unused blocks over quota move to the head of the free queue,
    # behind only plain (uncached) blocks.
    run_prefill(kv, quota_request("a2", "ns-a", 700, quota=1))
    assert kv.stats.of("ns-a")[3] == 4 and len(kv.owned["ns-a"]) == 4
    queue = list(kv.pool.free_queue)
    first_cached = next(i for i, b in enumerate(queue) if b.block_hash is not None)
    assert all(b.block_hash is None for b in queue[:first_cached])
    assert {b.block_id for b in queue[first_cached:first_cached + 3]} <= kv.owned["ns-a"]
    # The next allocations (8 plain blocks, then 3 more) evict them before
    # b's older blocks (LRU alone would take b's).
    assert kv.pool.counts()["free"] == 8
    run_prefill(kv, Request("c1", list(range(1, 42)), SamplingParams(max_tokens=1), cache_scope=CacheScope("ns-c")))
    assert len(kv.owned["ns-a"]) == 1 and len(kv.owned["ns-b"]) == 4
    assert run_prefill(kv, quota_request("b2", "ns-b", 300, quota=None)) == 16
    kv.check_integrity()


def test_public_prefix_limits_per_tenant_and_server():
    from kvferry.serve.public_prefixes import PrefixLimitError, PrefixLimits

    prefixes = PublicPrefixes(4, limits=PrefixLimits(max_prefixes=5, max_total_tokens=100, max_tokens_per_prefix=40,
                                                     max_prefixes_per_tenant=2, max_tokens_per_tenant=60))
    a1 = prefixes.register(list(range(30)), "a")
    assert prefixes.register(list(range(30)), "a") == type(a1)(30, 7, False, a1.id)  # the same declaration
    prefixes.register(list(range(100, 125)), "a")
    with pytest.raises(PrefixLimitError, match="this tenant already holds 2"):
        prefixes.register([7, 8, 9], "a")
    with pytest.raises(PrefixLimitError, match="more than the 40"):
        prefixes.register(list(range(41)), "b")
    with pytest.raises(PrefixLimitError, match="more than 60 tokens"):
        prefixes.register(list(range(200, 240)), "b") and prefixes.register(list(range(300, 330)), "b")
    prefixes.register(list(range(400, 404)), "c")  # 99 tokens on the server
    with pytest.raises(PrefixLimitError, match="server's public prefixes would hold more than 100"):
        prefixes.register(list(range(500, 510)), "d")
    # A deleted declaration frees its room, and the trie forgets it.
    prefixes.remove(a1.id)
    assert prefixes.match(list(range(35))) == 0 and prefixes.match(list(range(100, 130))) == 25
    prefixes.register(list(range(500, 505)), "d")
    assert {d.owner for d in prefixes.of()} == {"a", "b", "c", "d"} and len(prefixes.of("a")) == 1
