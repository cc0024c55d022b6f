"""Greedy output must equal HF transformers token for token (float32)."""
from __future__ import annotations

import random

import pytest

from kvferry import LLM, SamplingParams
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 12


def mixed_prompts(vocab: int, lengths=(1, 3, 17, 64, 150, 333)) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, max_position_embeddings=1024)
    hf = load_hf(str(path))
    prompts = mixed_prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return str(path), hf, prompts, expected


@pytest.fixture(scope="module")
def preempt_case(checkpoint):
    path, hf, _, _ = checkpoint
    prompts = mixed_prompts(hf.config.vocab_size, lengths=(64,) * 6)
    return path, hf, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def run(path, prompts, **engine_kwargs):
    llm = LLM(model=path, dtype="float32", **engine_kwargs)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return llm, llm.generate(prompts, params)


def check(hf, prompts, expected, results):
    for prompt, exp, res in zip(prompts, expected, results):
        assert_greedy_match(hf, prompt, res.token_ids, exp)


def test_batch_of_mixed_lengths(checkpoint):
    path, hf, prompts, expected = checkpoint
    llm, results = run(path, prompts)
    check(hf, prompts, expected, results)
    llm.engine.check_integrity()


def test_chunked_prefill_small_budget(checkpoint):
    path, hf, prompts, expected = checkpoint
    llm, results = run(path, prompts, max_num_batched_tokens=40)
    check(hf, prompts, expected, results)


def test_preemption_small_pool(preempt_case):
    path, hf, prompts, expected = preempt_case
    # 48 blocks of 8 = 384 tokens: six 64-token prompts fill the pool exactly,
    # so the first decode needs a 9th block each and must preempt.
    llm, results = run(path, prompts, block_size=8, num_kv_blocks=48, enable_prefix_caching=False)
    assert llm.engine.stats().num_preemptions > 0
    check(hf, prompts, expected, results)


def test_prefix_cache_second_run(checkpoint):
    path, hf, prompts, expected = checkpoint
    llm, first = run(path, prompts)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    second = llm.generate(prompts, params)
    assert sum(r.num_cached_tokens for r in second) > 0
    assert all(r.num_cached_tokens == 0 for r in first)
    assert second[-1].num_cached_tokens >= 320
    check(hf, prompts, expected, second)
    stats = llm.engine.stats()
    assert stats.prefix_hits > 0 and stats.prefix_queries >= stats.prefix_hits
