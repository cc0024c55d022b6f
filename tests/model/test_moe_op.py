"""moe_op.py's C++ expert loop (csrc/moe_experts.cpp) against moe.py's
Python loop over the same packed experts: the same bits, in bf16 and
float32, with one and two threads (one parallel region, the threads
splitting the experts), at row counts that take oneDNN's exact and padded
shapes, over an expert-parallel rank's experts, and with --deterministic's
fixed-block matmuls; a reload drops the packed copies it took."""
from __future__ import annotations

import pytest
import torch

from kvferry.model import moe_op
from kvferry.model.config import ModelConfig
from kvferry.model.layers import BatchInvariantConfig, UnquantizedConfig
from kvferry.model.layers.parallel import TPShard
from kvferry.model.moe import SparseMoeBlock, fused_experts, route

pytestmark = pytest.mark.skipif(not moe_op.available(), reason="the C++ expert loop does not build here")

CONFIG = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=100, hidden_size=96, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=48, shared_expert_intermediate_size=32, norm_topk_prob=False)


def _block(dtype, linear_config=None, shard=None) -> SparseMoeBlock:
    config = ModelConfig.from_hf_dict(CONFIG)
    block = SparseMoeBlock(config, dtype, "cpu", linear_config or UnquantizedConfig(), "model.layers.0.mlp", shard)
    gen = torch.Generator().manual_seed(7)
    for lin in block.modules():
        if hasattr(lin, "process_weights_after_loading"):
            lin.weight.data.copy_((torch.randn(lin.weight.shape, generator=gen) * 0.1).to(dtype))
            lin.process_weights_after_loading()
    return block


def _both(block: SparseMoeBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the C++ loop's output, the Python loop's) for x."""
    assert block._loop() is not None, "the block should take the C++ loop"
    with torch.inference_mode():  # its output is an inference tensor, written by the worker threads
        fast = block(x)
        block._loop = lambda *_: None
        try:
            slow = block(x)
        finally:
            del block._loop
    return fast, slow


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_expert_loop_equals_the_python_loop(dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        block = _block(dtype)
        gen = torch.Generator().manual_seed(threads)
        # 300 tokens x top-2 over 8 experts: ~75 rows an expert, above EXACT_ROWS (padded).
        for tokens in (1, 5, 33, 300):
            x = torch.randn(tokens, CONFIG["hidden_size"], generator=gen).to(dtype)
            fast, slow = _both(block, x)
            assert torch.equal(fast, slow), (tokens, (fast.float() - slow.float()).abs().max())
    finally:
        torch.set_num_threads(before)


def test_expert_parallel_rank_and_deterministic_blocks():
    x = torch.randn(40, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    rank1 = _block(torch.bfloat16, shard=TPShard(1, 2, expert_parallel=True))
    assert rank1.num_experts == 4 and rank1.first_expert == 4
    # fused_experts as the block calls it, before its all-reduce (no group here)
    weights, ids = route(rank1.gate(x), 2, False)
    with torch.inference_mode():
        fast = fused_experts(x, weights, ids, 4, rank1.expert, 4, rank1._loop())
        slow = fused_experts(x, weights, ids, 4, rank1.expert, 4)
    assert torch.equal(fast, slow)
    det = _block(torch.bfloat16, BatchInvariantConfig())
    fast, slow = _both(det, x)
    assert torch.equal(fast, slow)


def test_a_reload_drops_the_packed_copies():
    block = _block(torch.bfloat16)
    assert moe_op.loop_args(block.w13, block.w2) is not None
    for lin in (block.w13, block.w2):
        lin.restore_weights_for_loading()
    assert block.w13.expert_args is None and moe_op.loop_args(block.w13, block.w2) is None
