"""Levers over tensor-parallel ranks: host swap space, where each rank swaps
its own KV heads of a preempted request's blocks in the steps the one
scheduler orders, and a connector from outside the package
(``--kv-connector``), whose worker half runs on every rank over that rank's
heads and whose scheduler half runs once, on rank 0. Greedy output equals HF
transformers in float32 either way."""
from __future__ import annotations

import random

import pytest
import torch

from kvferry import LLM, SamplingParams
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.parallel import file_tier_connector as file_tier
from tests.tiny_models import make_tiny_checkpoint

BLOCK = 8
FILE_TIER = "tests.parallel.file_tier_connector:FileTierConnector"
ENGINE = dict(dtype="float32", block_size=BLOCK, tensor_parallel_size=2, cpu_threads_per_rank=1)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tp-levers"), arch="llama", num_attention_heads=8,
                                    num_key_value_heads=4, vocab_size=387, max_position_embeddings=512))
    return path, load_hf(path)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 387) for _ in range(n)] for n in lengths]


def test_host_swap_over_two_ranks_keeps_greedy_output(case, store):
    # 32 blocks of 8 admit the four prompts (31 blocks) but not their 12
    # tokens of decode each: requests are preempted and swapped out, every
    # rank its own heads, their blocks reused by the others meanwhile. With
    # a KV store beside it, which moves the ranks' pools into shared memory
    # (swap must copy the pool the steps compute in) and takes every block.
    path, hf = case
    prompts = _prompts(7, (61, 64, 45, 70))
    llm = LLM(model=path, num_kv_blocks=32, num_swap_blocks=64, kv_store=store, **ENGINE)
    try:
        results = llm.generate(prompts, _greedy(12))
        for p, r in zip(prompts, results):
            assert_greedy_match(hf, p, r.outputs[0].token_ids, hf_greedy(hf, p, 12))
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.num_swapped_out > 0  # to host swap, its first choice
        assert stats.kv_saved_blocks > 0
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()


def test_a_connector_from_outside_runs_on_every_rank(case, tmp_path, monkeypatch):
    path, hf = case
    monkeypatch.setenv(file_tier.ENV, str(tmp_path))  # the ranks inherit it
    a, b = _prompts(11, (41, 33))
    expected = [hf_greedy(hf, p, 6) for p in (a, b)]
    writer = LLM(model=path, num_kv_blocks=64, kv_connector=FILE_TIER, **ENGINE)
    try:
        assert_greedy_match(hf, a, writer.generate([a], _greedy(6))[0].outputs[0].token_ids, expected[0])
        files_a = set(tmp_path.glob("*.pt"))
        assert_greedy_match(hf, b, writer.generate([b], _greedy(6))[0].outputs[0].token_ids, expected[1])
    finally:
        writer.engine.core.close()
    # Each rank saved its own heads of each full block: 2 of the 4 KV heads.
    files_b = set(tmp_path.glob("*.pt")) - files_a
    assert sorted(f.name.rsplit(".", 2)[1] for f in files_a) == ["s0r0"] * 5 + ["s0r1"] * 5  # 41 + 6 tokens: 5 blocks
    assert torch.load(min(files_a)).shape == (2, 2, BLOCK, 2, 8)  # [layers, K/V, block, heads 2 of 4, head_dim]
    for f in files_b:  # b's blocks lose rank 1's heads: none is whole now
        if f.name.endswith(".s0r1.pt"):
            f.unlink()
    reader = LLM(model=path, num_kv_blocks=64, kv_connector=FILE_TIER, **ENGINE)
    try:
        results = reader.generate([a, b], _greedy(6))
        assert results[0].num_cached_tokens == 40  # a's 5 full blocks, each rank's heads from its files
        assert results[1].num_cached_tokens == 0
        for p, r, e in zip((a, b), results, expected):
            assert_greedy_match(hf, p, r.outputs[0].token_ids, e)
        reader.engine.check_integrity()
    finally:
        reader.engine.core.close()
