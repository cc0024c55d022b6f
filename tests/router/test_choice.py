"""The router's choice: prefix overlap from block events, the KV-aware
prefill cost, power-of-two decode choice, and tenant isolation of overlap."""
from __future__ import annotations

import random

import pytest

from kvferry.core.hashing import CacheScope, ChainKeys, extend_block_hashes
from kvferry.types.kv_events import BlockRemoved, BlockStored
from kvferry.router.policy import Candidate, choose_decode, choose_prefill, prefill_cost, uncached_tokens
from kvferry.router.prefix_index import PrefixIndex

BS = 4


def chain(tokens: list[int], namespace: str = "", public_namespace: str = "", num_public_blocks: int = 0):
    keys = ChainKeys.of(CacheScope(namespace, public_namespace, num_public_blocks), "model-fp", "float32")
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BS, keys)
    return hashes


def stored(hashes, owner=""):
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[0] * (BS * len(hashes)),
                       block_size=BS, owner=owner)


def cand(name, cached=0, queued=0, active=0, in_flight=0, last=0, usage=0.0, running=0):
    return Candidate(name, cached, queued, active, in_flight, usage, running, last)


def test_overlap_counts_leading_blocks_and_follows_removals():
    index = PrefixIndex()
    h = chain(list(range(16)))  # 4 blocks
    index.apply("w0", [stored(h[:3])])
    assert index.overlap_blocks("w0", h) == 3
    assert index.overlap_blocks("w1", h) == 0
    index.apply("w0", [BlockRemoved(block_hashes=[h[1]])])
    assert index.overlap_blocks("w0", h) == 1  # a gap ends the chain hit
    index.drop("w0")
    assert index.overlap_blocks("w0", h) == 0


def test_another_tenants_private_blocks_never_count():
    """Tenant B's chain is rooted in B's namespace, so A's stored blocks of
    the very same tokens match none of B's hashes: B's request is placed as
    if the prompt were unseen, and placement reveals nothing about A."""
    tokens = list(range(32))
    index = PrefixIndex()
    index.apply("w0", [stored(chain(tokens, "tenant-a"), owner="tenant-a")])
    assert index.overlap_blocks("w0", chain(tokens, "tenant-a")) == 8
    assert index.overlap_blocks("w0", chain(tokens, "tenant-b")) == 0
    # Blocks in a declared public prefix are shared by design: they do count.
    public_a = chain(tokens, "tenant-a", "public", 2)
    index.apply("w1", [stored(public_a[:2], owner="public")])
    assert index.overlap_blocks("w1", chain(tokens, "tenant-b", "public", 2)) == 2
    # ... and stop at the first private block of the other tenant.
    index.apply("w1", [stored(public_a[2:], owner="tenant-a")])
    assert index.overlap_blocks("w1", chain(tokens, "tenant-b", "public", 2)) == 2
    # The choice for B is then the same with or without A's private blocks.
    b = chain(tokens, "tenant-b")
    with_a = [cand(w, index.overlap_blocks(w, b), last=i) for i, w in enumerate(["w0", "w2"])]
    without_a = [cand(w, 0, last=i) for i, w in enumerate(["w0", "w2"])]
    assert choose_prefill(with_a, 32, BS).name == choose_prefill(without_a, 32, BS).name


def test_uncached_tokens_always_leaves_the_last_token():
    assert uncached_tokens(16, 0, BS) == 16
    assert uncached_tokens(16, 2, BS) == 8
    assert uncached_tokens(16, 4, BS) == 1  # a full hit still computes the last token


def test_the_worker_holding_the_prefix_wins_until_its_queue_outweighs_it():
    holder, other = cand("holder", cached=50, last=2), cand("other", last=1)
    assert choose_prefill([holder, other], 256, BS).name == "holder"
    # 200 tokens saved; a 150-token queue does not outweigh them, 250 does.
    assert choose_prefill([cand("holder", 50, queued=150, last=2), other], 256, BS).name == "holder"
    assert choose_prefill([cand("holder", 50, queued=250, last=2), other], 256, BS).name == "other"
    assert prefill_cost(cand("x", 0, queued=10, active=32), 20, BS) == 10 + 20 + 32


def test_ties_go_to_fewer_in_flight_then_round_robin():
    assert choose_prefill([cand("a", in_flight=2), cand("b", in_flight=1)], 64, BS).name == "b"
    assert choose_prefill([cand("a", last=5), cand("b", last=3)], 64, BS).name == "b"
    with pytest.raises(ValueError, match="candidates"):
        choose_prefill([], 64, BS)


def test_decode_choice_takes_the_less_loaded_of_two():
    rng = random.Random(0)
    light, heavy = cand("light", usage=0.1, running=1), cand("heavy", usage=0.9, running=8)
    assert {choose_decode([light, heavy], rng).name for _ in range(20)} == {"light"}
    # With many workers, the most loaded one is never chosen (it loses every pair).
    pool = [cand(f"w{i}", usage=i / 10) for i in range(6)]
    picks = [choose_decode(pool, rng).name for _ in range(300)]
    assert "w5" not in picks and len(set(picks)) >= 3  # spread, not herded onto w0
