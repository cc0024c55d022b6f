"""The node KV store under tensor parallelism: rank 0 stores and loads
whole blocks, every rank's KV heads in rank order (read from and written to
the ranks' pools in shared memory), so a block is in the store whole or not
at all, and cores of any TP size share them. A real ``kvferry kvstore``
process; greedy output equals HF transformers in float32 whichever layout
wrote the blocks and whichever loads them."""
from __future__ import annotations

import random

import pytest

from kvferry import LLM, SamplingParams
from kvferry.kvstore.client import KVStoreClient
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 6
BLOCK = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tp-tiers"), arch="llama", num_attention_heads=8,
                                    num_key_value_heads=4, vocab_size=387, max_position_embeddings=512))
    hf = load_hf(path)
    rng = random.Random(47)
    prompts = [[rng.randrange(3, 387) for _ in range(n)] for n in (61, 40)]
    return path, hf, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def _llm(path: str, address: str, tp: int) -> LLM:
    return LLM(model=path, dtype="float32", block_size=BLOCK, num_kv_blocks=64, kv_store=address,
               tensor_parallel_size=tp, cpu_threads_per_rank=1)


def _check(llm: LLM, case, want_cached: bool) -> None:
    _, hf, prompts, expected = case
    results = llm.generate(prompts, GREEDY)
    for p, e, r in zip(prompts, expected, results):
        assert_greedy_match(hf, p, r.outputs[0].token_ids, e)
        # A fresh device pool: every cached token came from the store.
        assert (r.num_cached_tokens >= (len(p) - 1) // BLOCK * BLOCK) if want_cached else r.num_cached_tokens == 0
    llm.engine.check_integrity()
    assert not llm.engine.core.scheduler.kv.pinned  # saves done, nothing left pinned


def test_blocks_written_at_one_layout_load_at_another(case, store):
    path, _, prompts, _ = case
    written = sum((len(p) + MAX_NEW - 1) // BLOCK for p in prompts)
    for tp, cached in ((2, False), (1, True), (2, True)):
        llm = _llm(path, store, tp)
        try:
            _check(llm, case, cached)
            if not cached:
                assert llm.engine.stats().kv_saved_blocks == written
        finally:
            llm.engine.core.close()
        with KVStoreClient(store) as client:  # one slot per block, whichever layout wrote it
            assert client.stats().used_slots == written


def test_swap_preemption_through_the_store_over_ranks(case, store):
    # 32 blocks of 8 admit the four prompts (31 blocks) but not their 12
    # tokens of decode each: requests are preempted, their blocks swapped
    # out to the store (every rank's heads) and loaded back when they resume.
    path, hf, _, _ = case
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 387) for _ in range(n)] for n in (61, 64, 45, 70)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(model=path, dtype="float32", block_size=BLOCK, num_kv_blocks=32, kv_store=store,
              tensor_parallel_size=2, cpu_threads_per_rank=1, preemption_mode="swap")
    try:
        results = llm.generate(prompts, params)
        for p, r in zip(prompts, results):
            assert_greedy_match(hf, p, r.outputs[0].token_ids, hf_greedy(hf, p, 12))
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.kv_loaded_tokens > 0
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()
