"""moe_op.py's C++ MoE layer and expert loop (csrc/moe_experts.cpp) against
moe.py's Python path over the same packed experts: the same bits, in bf16
and float32, with one and two threads (one parallel region, the threads
claiming the experts), at row counts that take oneDNN's exact and padded
shapes, with each model's routing rules (softmax then top-k, renormalized
or not, weights rounded or float32, the gated shared expert), over an
expert-parallel rank's experts (some chosen, none chosen), and with
--deterministic's fixed-block matmuls; a routing error is raised, not hung
on; a reload drops the packed copies it took."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvferry.model import moe_op
from kvferry.model.config import ModelConfig
from kvferry.model.fused_ops import silu_and_mul
from kvferry.model.layers import BatchInvariantConfig, UnquantizedConfig
from kvferry.model.layers.parallel import TPShard
from kvferry.model.moe import SparseMoeBlock, fused_experts, route

pytestmark = pytest.mark.skipif(not moe_op.available(), reason="the C++ expert loop does not build here")

CONFIG = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=100, hidden_size=96, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=48, shared_expert_intermediate_size=32, norm_topk_prob=False)


def _block(dtype, linear_config=None, shard=None, **overrides) -> SparseMoeBlock:
    config = ModelConfig.from_hf_dict({**CONFIG, **overrides})
    block = SparseMoeBlock(config, dtype, "cpu", linear_config or UnquantizedConfig(), "model.layers.0.mlp", shard)
    gen = torch.Generator().manual_seed(7)
    for lin in block.modules():
        if hasattr(lin, "process_weights_after_loading"):
            lin.weight.data.copy_((torch.randn(lin.weight.shape, generator=gen) * 0.1).to(dtype))
            lin.process_weights_after_loading()
    return block


def _both(block: SparseMoeBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the C++ layer's output, the Python loop's) for x."""
    assert block._layer(x.dtype) is not None, "the block should take the C++ layer"
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


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# Each model's routing: Mixtral (renormalized, float32 weights), Qwen3-MoE
# (renormalized, rounded), every expert taken (top-8 of 8), 16 experts top-4
# without a shared expert.
ROUTINGS = {
    "mixtral": dict(architectures=["MixtralForCausalLM"], num_local_experts=8, shared_expert_intermediate_size=0,
                    intermediate_size=48),
    "qwen3_norm": dict(architectures=["Qwen3MoeForCausalLM"], norm_topk_prob=True, shared_expert_intermediate_size=0),
    "qwen2_top8_norm": dict(num_experts_per_tok=8, norm_topk_prob=True),
    "qwen3_16x4": dict(architectures=["Qwen3MoeForCausalLM"], num_experts=16, num_experts_per_tok=4,
                       shared_expert_intermediate_size=0),
}


@pytest.mark.parametrize("case", list(ROUTINGS))
def test_each_models_routing_in_the_layer(case, two_threads):
    block = _block(torch.bfloat16, **ROUTINGS[case])
    if case == "mixtral":
        assert block.weights_float32 and block.renormalize and not block.shared_intermediate_size
    gen = torch.Generator().manual_seed(5)
    for tokens in (1, 7, 70):
        x = torch.randn(tokens, CONFIG["hidden_size"], generator=gen).to(torch.bfloat16)
        fast, slow = _both(block, x)
        assert torch.equal(fast, slow), (case, tokens)
        # and the experts alone in C++, the routing in Python (a router the layer does not take)
        block._layer = lambda *_: None
        try:
            with torch.inference_mode():
                assert torch.equal(block(x), slow)
        finally:
            del block._layer


def test_tied_router_scores_pick_the_same_experts(two_threads):
    # A zero router: every expert scores alike, so top-k breaks ties (torch's order, in both paths).
    block = _block(torch.bfloat16)
    block.gate.restore_weights_for_loading()
    block.gate.weight.data.zero_()
    block.gate.process_weights_after_loading()
    x = torch.randn(9, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    fast, slow = _both(block, x)
    assert torch.equal(fast, slow)


def test_expert_parallel_ranks_in_the_layer(two_threads):
    # Rank 1 of 2 holds experts 4..7. Its output before the all-reduce: the
    # C++ layer's against fused_experts' plus the shared expert, as forward adds it.
    rank1 = _block(torch.bfloat16, shard=TPShard(1, 2, expert_parallel=True))
    args = rank1._layer(torch.bfloat16)
    assert args is not None and args.first_expert == 4

    def python(x):
        weights, ids = route(rank1.gate(x), 2, False)
        out = fused_experts(x, weights.to(x.dtype), ids, 4, rank1.expert, 4)
        shared = rank1.shared_down(silu_and_mul(rank1.shared_gate_up(x)))
        return out + torch.sigmoid(rank1.shared_expert_gate(x)) * shared

    gen = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        for tokens in (1, 40):
            x = torch.randn(tokens, CONFIG["hidden_size"], generator=gen).to(torch.bfloat16)
            assert torch.equal(moe_op.moe_layer(args, x), python(x))
        # No token routed to this rank's experts: the shared expert alone (and without one, zeros).
        gate = rank1.gate
        gate.restore_weights_for_loading()
        gate.weight.data[:4], gate.weight.data[4:] = 1.0, -1.0
        gate.process_weights_after_loading()
        x = torch.randn(6, CONFIG["hidden_size"], generator=gen).abs().to(torch.bfloat16)
        assert (route(gate(x), 2, False)[1] < 4).all()
        args = rank1._layer(torch.bfloat16)
        assert torch.equal(moe_op.moe_layer(args, x), python(x))
        bare = moe_op.moe_layer(args._replace(shared=[], shared_n_kind=[]), x)
        assert torch.equal(bare, torch.zeros_like(bare))


def test_a_routing_error_is_raised_not_hung_on(two_threads):
    block = _block(torch.bfloat16)
    args = block._layer(torch.bfloat16)
    x = torch.randn(3, CONFIG["hidden_size"]).to(torch.bfloat16)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="selected index k out of range|k .* out of range|topk"):
            moe_op.moe_layer(args._replace(top_k=CONFIG["num_experts"] + 1), x)
        assert torch.equal(moe_op.moe_layer(args, x), block(x))  # and it still serves


@pytest.mark.parametrize("case", ["qwen2", "mixtral"])
def test_a_given_routing_replaces_the_routers_choice_in_both_paths(case, two_threads):
    # bench/profile_moe.py times chosen active experts through forward(x, routing=...):
    # the C++ layer and the Python path take the routing alike (rounded unless
    # float32), including a token sent to one expert twice (fewer experts than top-k).
    block = _block(torch.bfloat16, **({} if case == "qwen2" else ROUTINGS["mixtral"]))
    gen = torch.Generator().manual_seed(8)
    for tokens, experts in ((1, 1), (5, 3), (40, 8)):
        x = torch.randn(tokens, CONFIG["hidden_size"], generator=gen).to(torch.bfloat16)
        ids = (torch.arange(tokens * 2) % experts).view(tokens, 2)
        weights = torch.rand(tokens, 2, generator=gen)
        with torch.inference_mode():
            fast = block(x, routing=(weights, ids))
            block._layer = lambda *_: None  # Python routing, C++ expert loop
            try:
                slow = block(x, routing=(weights, ids))
                block._loop = lambda *_: None  # and the Python loop
                python = block(x, routing=(weights, ids))
            finally:
                del block._layer, block._loop
            routed = block(x)
        assert torch.equal(fast, slow) and torch.equal(fast, python), (case, tokens)
        assert not torch.equal(fast, routed)  # the router's own choice was not used
    args = block._layer(torch.bfloat16)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="routed_ids must be int64"):
        moe_op.moe_layer(args, x, (weights, ids[:, :1]))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="the router chose expert 8 of 8"):
        moe_op.moe_layer(args, x, (weights, ids + 8))
    with torch.inference_mode():
        assert torch.equal(moe_op.moe_layer(args, x), routed)  # and it still serves


def test_a_reload_drops_the_packed_copies():
    block = _block(torch.bfloat16)
    assert moe_op.loop_args(block.w13, block.w2) is not None
    for lin in (block.w13, block.w2):
        lin.restore_weights_for_loading()
    assert block.w13.expert_args is None and moe_op.loop_args(block.w13, block.w2) is None
    assert block.w13.loop_args_cache is None  # nor does the cached argument list hold them


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _assert_one_huge_page_slab(stack) -> None:
    args = stack.expert_args
    if args[0].kind != 1:
        pytest.skip("oneDNN's opaque copies on this CPU (small_gemm's are the ones moved)")
    base = args[0].weight.data_ptr()
    size = args[0].weight.numel() * args[0].weight.element_size()
    assert base % (2 << 20) == 0
    assert [a.weight.data_ptr() - base for a in args] == [e * size for e in range(len(args))]
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():  # a kernel with THP takes the advice
        assert "hg" in _vm_flags(base)  # advised MADV_HUGEPAGE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expert_copies_lie_in_one_huge_page_mapping(dtype):
    # A decode step streams most experts' copies: in one mapping on 2 MiB
    # pages (huge_pages.py), slot e expert e's, not 4 KiB pages apiece.
    block = _block(dtype)
    x = torch.randn(5, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(5)).to(dtype)
    for stack in (block.w13, block.w2):
        _assert_one_huge_page_slab(stack)
    # a reload packs into a new slab, and the layer reads it
    for stack in (block.w13, block.w2):
        stack.restore_weights_for_loading()
        stack.weight.data.zero_()
        stack.process_weights_after_loading()
        _assert_one_huge_page_slab(stack)
    with torch.inference_mode():
        assert not block.w13.forward_expert(3, x).any()  # the new (zero) weights, not the old slab's
    fast, slow = _both(block, x)
    assert torch.equal(fast, slow)


def test_expert_prefetch_by_cpu_kind_and_dtype():
    zen4 = frozenset({"sse4a", "avx512f", "avx512_bf16", "avx512_vnni"})
    assert moe_op.expert_prefetch(1, torch.bfloat16, zen4) == 3  # one pass at 9-10 rows
    assert moe_op.expert_prefetch(1, torch.float32, zen4) == 0  # the float32 kernel keeps its own
    assert moe_op.expert_prefetch(2, torch.bfloat16, zen4) == 0  # oneDNN's copies
    assert moe_op.expert_prefetch(1, torch.bfloat16, zen4 | {"avx_vnni"}) == 0  # Zen 5: as tuned
    assert moe_op.expert_prefetch(1, torch.bfloat16, frozenset({"avx512_bf16", "avx512f"})) == 0  # not AMD


@pytest.mark.parametrize("threads", [1, 2])
def test_the_expert_prefetch_changes_no_bits(threads):
    # 1-48 tokens x top-2 over 8 experts: experts with 1 to ~15 rows, on both
    # sides of the rows where the by-rows choices switch (none / prefetcht1 in
    # the stream / small_gemm's one-pass kernel at 9-10 / of the next block),
    # claimed most rows first. Choice 2 runs 9-10 rows in two row blocks, 3
    # in one pass: the same bits.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        block = _block(torch.bfloat16)
        args = block._layer(torch.bfloat16)
        if args.experts.kind != 1:
            pytest.skip("oneDNN's copies on this CPU: the choice applies to small_gemm's")
        plain, *by_rows = (args._replace(experts=args.experts._replace(prefetch=p)) for p in (0, 1, 2, 3))
        gen = torch.Generator().manual_seed(11)
        for tokens in (1, 7, 30, 48):
            x = torch.randn(tokens, CONFIG["hidden_size"], generator=gen).to(torch.bfloat16)
            with torch.inference_mode():
                want = moe_op.moe_layer(plain, x)
                for choice in by_rows:
                    assert torch.equal(moe_op.moe_layer(choice, x), want), (tokens, choice.experts.prefetch)
        counts = [8, 0, 1, 7, 6, 9, 10, 8]
        xs = torch.randn(sum(counts), CONFIG["hidden_size"], generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            want = moe_op.expert_loop(plain.experts, xs, counts)
            for choice in by_rows:
                assert torch.equal(moe_op.expert_loop(choice.experts, xs, counts), want), choice.experts.prefetch
    finally:
        torch.set_num_threads(before)
