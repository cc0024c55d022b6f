"""Levers over pipeline stages: host swap space, where each stage swaps its
own layers' KV of a preempted request's blocks in the steps the one
scheduler orders, a connector from outside the package
(``--kv-connector``), whose worker half runs on every stage over that
stage's layers and whose scheduler half runs once, on stage 0, and both
beside a P/D transfer and the node KV store in one decode core. Greedy
output equals HF transformers in float32 every way."""
from __future__ import annotations

import random

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.engine.kv_connector import HostSwapWorker, NodeStoreWorker
from kvferry.engine.kv_connector.stage_transfer import StageTransferWorker
from tests.disagg.driver import assert_idle, closing_cores, drain, make_core, request, run_disagg, settle, step_until
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.parallel import file_tier_connector as file_tier
from tests.tiny_models import make_tiny_checkpoint

BLOCK = 8
FILE_TIER = "tests.parallel.file_tier_connector:FileTierConnector"
# 3 layers over 2 stages: stage 0 holds layers 0-1, stage 1 layer 2.
ENGINE = dict(dtype="float32", block_size=BLOCK, pipeline_parallel_size=2, cpu_threads_per_rank=1, warm_up=False)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("pp-levers"), arch="llama", num_hidden_layers=3,
                                    vocab_size=387, max_position_embeddings=512))
    return path, load_hf(path)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 387) for _ in range(n)] for n in lengths]


def test_host_swap_over_two_stages_keeps_greedy_output(case):
    # 32 blocks of 8 admit the four prompts (31 blocks) but not their 12
    # tokens of decode each: requests are preempted and swapped out, every
    # stage its own layers, their blocks reused by the others meanwhile.
    path, hf = case
    prompts = _prompts(9, (61, 64, 45, 70))
    llm = LLM(model=path, num_kv_blocks=32, num_swap_blocks=64, **ENGINE)
    try:
        results = llm.generate(prompts, _greedy(12))
        for p, r in zip(prompts, results):
            assert_greedy_match(hf, p, r.outputs[0].token_ids, hf_greedy(hf, p, 12))
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.num_swapped_out > 0
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()


def test_a_connector_from_outside_runs_on_every_stage(case, tmp_path, monkeypatch):
    path, hf = case
    monkeypatch.setenv(file_tier.ENV, str(tmp_path))  # the stages inherit it
    a, b = _prompts(12, (41, 33))
    expected = [hf_greedy(hf, p, 6) for p in (a, b)]
    writer = LLM(model=path, num_kv_blocks=64, kv_connector=FILE_TIER, **ENGINE)
    try:
        assert_greedy_match(hf, a, writer.generate([a], _greedy(6))[0].outputs[0].token_ids, expected[0])
        files_a = set(tmp_path.glob("*.pt"))
        assert_greedy_match(hf, b, writer.generate([b], _greedy(6))[0].outputs[0].token_ids, expected[1])
    finally:
        writer.engine.core.close()
    # Each stage saved its own layers of each full block: 2 on stage 0, 1 on stage 1.
    files_b = set(tmp_path.glob("*.pt")) - files_a
    assert sorted(f.name.rsplit(".", 2)[1] for f in files_a) == ["s0r0"] * 5 + ["s1r0"] * 5  # 41 + 6 tokens
    layers = {f.name.rsplit(".", 2)[1]: torch.load(f).shape[0] for f in files_a}
    assert layers == {"s0r0": 2, "s1r0": 1}
    for f in files_b:  # b's blocks lose stage 1's layer: none is whole now
        if f.name.endswith(".s1r0.pt"):
            f.unlink()
    reader = LLM(model=path, num_kv_blocks=64, kv_connector=FILE_TIER, **ENGINE)
    try:
        results = reader.generate([a, b], _greedy(6))
        assert results[0].num_cached_tokens == 40  # a's 5 full blocks, each stage's layers from its files
        assert results[1].num_cached_tokens == 0
        for p, r, e in zip((a, b), results, expected):
            assert_greedy_match(hf, p, r.outputs[0].token_ids, e)
        reader.engine.check_integrity()
    finally:
        reader.engine.core.close()


def test_transfer_swap_and_store_compose_in_a_decode_core_of_two_stages(case):
    # A P/D decode core of 2 stages with host swap and a KV store beside the
    # transfer: the transfer moves every stage's pool into shared memory, the
    # store saves whole blocks from them, swap copies the pools the steps use.
    path, hf = case
    prompt = _prompts(13, (90,))[0]
    expected = hf_greedy(hf, prompt, 8)
    prefill = make_core(path, block_size=BLOCK)
    decode = make_core(path, block_size=BLOCK, pipeline_parallel_size=2, cpu_threads_per_rank=1,
                       num_swap_blocks=16, kv_dram_gb=0.05)
    with closing_cores(prefill, decode):
        connector = decode.runner.connector
        assert [type(w) for w in connector.workers] == [StageTransferWorker, HostSwapWorker, NodeStoreWorker]
        result = run_disagg(prefill, decode, "pd", prompt, _greedy(8))
        assert_greedy_match(hf, prompt, result.tokens, expected)
        assert not result.transfer_errors
        drain(decode)
        drain(prefill)
        # The block the decode filled (tokens 88..95) went down whole: every stage's layers.
        assert decode.stats().kv_saved_blocks == 1
        # A colocated request on the same core loads nothing yet, then its blocks go down too.
        other = _prompts(14, (40,))[0]
        decode.add_request(request("co", other, _greedy(6)))
        outs = step_until(decode, lambda seen: any(o.finished for o in seen), timeout_s=120)
        tokens = [t for o in outs if o.request_id == "co" for t in o.new_token_ids]
        assert_greedy_match(hf, other, tokens, hf_greedy(hf, other, 6))
        settle(decode, timeout_s=60)
        assert_idle(prefill)  # drained above and not stepped since
