"""The node KV store over pipeline stages: stage 0 stores and loads whole
blocks, every stage's layers in order (read from and written to the stages'
pools in shared memory), so a block is in the store whole or not at all,
and cores of any number of stages share them. A real ``kvferry kvstore``
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
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("pp-tiers"), arch="llama", num_hidden_layers=3,
                                    vocab_size=387, max_position_embeddings=512))
    hf = load_hf(path)
    rng = random.Random(48)
    prompts = [[rng.randrange(3, 387) for _ in range(n)] for n in (61, 40)]
    return path, hf, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def _llm(path: str, address: str, pp: int, **extra) -> LLM:
    return LLM(model=path, dtype="float32", block_size=BLOCK, num_kv_blocks=64, kv_store=address,
               pipeline_parallel_size=pp, cpu_threads_per_rank=1, warm_up=False, **extra)


def test_blocks_written_at_one_layout_load_at_another(case, store):
    path, hf, prompts, expected = case
    written = sum((len(p) + MAX_NEW - 1) // BLOCK for p in prompts)
    # 3 layers over 2 stages: stage 0 holds 2, stage 1 holds 1; a slot holds all 3.
    for pp, cached in ((2, False), (1, True), (2, True)):
        llm = _llm(path, store, pp)
        try:
            results = llm.generate(prompts, GREEDY)
            for p, e, r in zip(prompts, expected, results):
                assert_greedy_match(hf, p, r.outputs[0].token_ids, e)
                # A fresh device pool: every cached token came from the store.
                assert r.num_cached_tokens == ((len(p) - 1) // BLOCK * BLOCK if cached else 0)
            if not cached:
                assert llm.engine.stats().kv_saved_blocks == written
            llm.engine.check_integrity()
            assert not llm.engine.core.scheduler.kv.pinned  # saves done, nothing left pinned
        finally:
            llm.engine.core.close()
        with KVStoreClient(store) as client:  # one slot per block, whichever layout wrote it
            assert client.stats().used_slots == written


def test_swap_preemption_through_the_store_over_stages(case, store):
    # 32 blocks of 8 admit the four prompts (31 blocks) but not their 12
    # tokens of decode each: requests are preempted, their blocks swapped
    # out to the store (every stage's layers) and loaded back when they resume.
    path, hf, _, _ = case
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 387) for _ in range(n)] for n in (61, 64, 45, 70)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(model=path, dtype="float32", block_size=BLOCK, num_kv_blocks=32, kv_store=store,
              pipeline_parallel_size=2, cpu_threads_per_rank=1, preemption_mode="swap", warm_up=False)
    try:
        results = llm.generate(prompts, params)
        for p, r in zip(prompts, results):
            assert_greedy_match(hf, p, r.outputs[0].token_ids, hf_greedy(hf, p, 12))
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.kv_loaded_tokens > 0
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()
