"""Block keys under a cache scope: namespaces at the root and in every key,
the public/private boundary, and the owners of published blocks."""
from __future__ import annotations

import pytest

from kvferry.core.hashing import ROOT_PARENT, CacheScope, ChainKeys, ExtraKeys, chain_root, extend_block_hashes
from kvferry.core.kv_events import BlockStored
from kvferry.core.kv_manager import KVCacheManager
from kvferry.request import Request
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


def request(rid: str, ns: str, public_blocks: int = 0) -> Request:
    return Request(rid, list(TOKENS) + [7], SamplingParams(max_tokens=1), cache_namespace=ns,
                   public_cache_namespace="pub" if public_blocks else "", num_public_blocks=public_blocks)


def run_prefill(kv: KVCacheManager, req: Request) -> int:
    hit = kv.find_prefix_hit(req)
    kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    kv.free(req)
    return hit.num_tokens


def test_manager_hits_only_own_and_public_blocks_and_events_name_owners():
    kv = KVCacheManager(32, 4, model_fingerprint="m", kv_dtype="bfloat16")
    assert run_prefill(kv, request("a1", "ns-a", public_blocks=2)) == 0
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert [(e.owner, len(e.block_hashes)) for e in stored] == [("pub", 2), ("ns-a", 2)]
    assert run_prefill(kv, request("b1", "ns-b", public_blocks=2)) == 8  # the public blocks only
    assert run_prefill(kv, request("a2", "ns-a", public_blocks=2)) == 16  # its own tail too
    assert run_prefill(kv, request("b2", "ns-b")) == 0  # no public prefix matched: all private
    kv.check_integrity()


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
