"""The runner side of the step contract: the persistent batch tracks the
scheduler's view, and the host swap space moves KV blocks bit-exactly."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.core.outputs import KVOrders, SwapOrder, TransferOrder
from kvferry.engine.kv_connector import HostSwapWorker
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_out_then_in_is_bit_exact(dtype):
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    kv = torch.randn(3, 2, 10, 4, 2, 8).to(dtype)
    original = kv.clone()
    swap = HostSwapWorker(kv, num_slots=6)
    swap.execute(KVOrders(swap_out=[SwapOrder("a", [3, 5, 1], [0, 1, 2]), SwapOrder("b", [8], [5])]))
    kv.zero_()  # the blocks are reused by others meanwhile
    swap.execute(KVOrders(swap_in=[SwapOrder("a", [7, 2, 4], [0, 1, 2]), SwapOrder("b", [0], [5])]))
    assert torch.equal(kv[:, :, [7, 2, 4, 0]], original[:, :, [3, 5, 1, 8]])
    assert kv[:, :, [1, 3, 5, 6, 8, 9]].abs().sum() == 0  # nothing else written
    done = swap.take_finished()
    assert done.finished_saving == ["a", "b"] and done.finished_loading == ["a", "b"]
    assert swap.take_finished().finished_loading == []  # each completion once


def test_transfer_orders_without_a_tier_are_refused():
    swap = HostSwapWorker(torch.zeros(1, 2, 4, 4, 1, 8), num_slots=2)
    with pytest.raises(ValueError, match="load orders"):
        swap.execute(KVOrders(load=[TransferOrder("a", [0], keys=[b"k"])]))


@pytest.fixture(scope="module")
def preempt_case(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("swap"), arch="llama", max_position_embeddings=512))
    hf = load_hf(path)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(64)] for _ in range(6)]
    return path, hf, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("num_swap_blocks", [96, 10])
def test_forced_swapping_keeps_greedy_output(preempt_case, num_swap_blocks):
    # 48 blocks of 8 hold the six 64-token prompts exactly: the first decode
    # must preempt. With host room the KV is swapped out and back in; with
    # room for one request only, the rest are recomputed.
    path, hf, prompts, expected = preempt_case
    llm = LLM(
        model=path, dtype="float32", block_size=8, num_kv_blocks=48,
        enable_prefix_caching=False, num_swap_blocks=num_swap_blocks,
    )
    results = llm.generate(prompts, GREEDY)
    for p, e, r in zip(prompts, expected, results):
        assert_greedy_match(hf, p, r.token_ids, e)
    stats = llm.engine.stats()
    assert stats.num_swapped_out > 0
    if num_swap_blocks == 10:
        assert stats.num_preemptions > stats.num_swapped_out
    assert llm.engine.core.scheduler.connector.space.num_free == num_swap_blocks
    llm.engine.check_integrity()


def test_persistent_batch_follows_the_scheduler(preempt_case):
    path, hf, prompts, expected = preempt_case
    llm = LLM(model=path, dtype="float32", block_size=8, num_kv_blocks=48, max_num_batched_tokens=100)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        batch = engine.core.runner.batch
        assert sorted(batch.req_ids) == sorted(batch.index) and batch.num_reqs == len(batch.index)
        for request in engine.core.scheduler.running:
            row = batch.index[request.request_id]
            block_ids = engine.core.scheduler.kv.block_ids(request.request_id)
            assert batch.block_table[row, : batch.num_blocks[row]].tolist() == block_ids
            assert batch.token_ids[row, : batch.num_tokens[row]].tolist() == request.all_token_ids
    assert engine.stats().num_preemptions > 0
    engine.step()  # delivers the last finished ids to the runner
    assert engine.core.runner.batch.num_reqs == 0 and not engine.core.runner.states
    for i, (p, e) in enumerate(zip(prompts, expected)):
        assert_greedy_match(hf, p, outputs[f"r{i}"], e)


def test_penalty_state_is_kept_not_rebuilt(preempt_case):
    # The runner's per-request counts equal a recount of the outputs, and
    # the prompt mask is built once per admission.
    path, _, prompts, _ = preempt_case
    llm = LLM(model=path, dtype="float32")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, frequency_penalty=0.5)
    llm.engine.add_request("p", prompts[0], params)
    for _ in range(4):
        llm.engine.step()
    state = llm.engine.core.runner.states["p"]
    recount = np.bincount(state.output_token_ids, minlength=llm.engine.core.runner.vocab_size)
    assert len(state.output_token_ids) == 4
    assert state.output_counts.tolist() == recount.astype(float).tolist()


@pytest.mark.timeout(300)
def test_generate_without_chunking_resumes_preempted_requests_longer_than_the_budget(preempt_case):
    # Budget 70, no chunking: every 64-token prompt runs whole, but a request
    # preempted after some outputs has 64 + n > 70 tokens to recompute. It
    # must resume (in chunks) rather than spin, and stay HF-exact.
    path, hf, prompts, _ = preempt_case
    max_new = 16
    llm = LLM(
        model=path, dtype="float32", block_size=8, num_kv_blocks=48, enable_prefix_caching=False,
        enable_chunked_prefill=False, max_num_batched_tokens=70,
    )
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    for p, r in zip(prompts, results):
        assert_greedy_match(hf, p, r.token_ids, hf_greedy(hf, p, max_new))
    llm.engine.check_integrity()
