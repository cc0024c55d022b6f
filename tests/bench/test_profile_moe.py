"""``kvferry profile``'s MoE step (bench/profile_moe.py) times the path a
served step runs: the block's forward, which for plain packed matmuls is
the whole layer as one C++ call (``kvferry_moe::moe_layer``), not the
Python routing around the expert loop; the point's routing replaces the
router's choice there. (The CLI's whole MoE profile: tests/plan/test_afd_live.py.)"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvferry.bench.profile_moe import measure_moe_point
from kvferry.model import moe_op
from kvferry.model.config import ModelConfig
from kvferry.model.layers import UnquantizedConfig
from kvferry.model.moe import SparseMoeBlock

pytestmark = pytest.mark.skipif(not moe_op.available(), reason="the C++ MoE layer does not build here")

CONFIG = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=100, hidden_size=96, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=48, shared_expert_intermediate_size=32, norm_topk_prob=False)


def _ops(fn) -> set[str]:
    """The dispatched op names ``fn()`` ran (the profiler records every one)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_moe_point_times_the_served_one_call_layer(dtype):
    block = SparseMoeBlock(ModelConfig.from_hf_dict(CONFIG), dtype, "cpu", UnquantizedConfig(), "model.layers.0.mlp")
    gen = torch.Generator().manual_seed(0)
    for lin in block.modules():
        if hasattr(lin, "process_weights_after_loading"):
            lin.weight.data.copy_((torch.randn(lin.weight.shape, generator=gen) * 0.1).to(dtype))
            lin.process_weights_after_loading()
    assert block._layer(dtype) is not None  # served: one C++ call
    points = {}
    ops = _ops(lambda: points.update(p=measure_moe_point(block, 3, 4, 1, CONFIG["hidden_size"], dtype, "cpu")))
    assert "kvferry_moe::moe_layer" in ops
    # the Python routing and sort the old profile timed (moe.fused_experts) are not run
    assert not ops & {"aten::argsort", "aten::bincount", "kvferry_moe::expert_loop"}, ops
    p = points["p"]
    assert (p["experts"], p["tokens"], p["tokens_per_expert"]) == (3, 6, 4.0) and p["time_s"] > 0
