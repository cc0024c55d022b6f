"""Mixture-of-experts models over tensor-parallel ranks: greedy output equals HF
transformers in float32 at TP 2 (every expert sliced over the ranks) and at
EP 2 (``enable_expert_parallel``: whole experts per rank), through the
offline LLM API, on tiny random-weight Qwen3-MoE (top-2 with a dense layer
among sparse ones, top-8), Mixtral and Qwen2-MoE with its shared expert.

Also: the fused expert function summed over EP ranks equals the whole;
each rank holds and reads only its part; a MoE layer makes one all-reduce
(routed and shared experts together), counted on a real rank group; models
whose experts do not split are refused before any rank starts.
"""
from __future__ import annotations

import random
import re

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.model.config import ModelConfig
from kvferry.model.layers.parallel import TPShard
from kvferry.model.moe import SparseMoeBlock, fused_experts, route
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_moe_models import make_tiny_moe_checkpoint

MAX_NEW = 6
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory_gb=0.02,
              cpu_threads_per_rank=1, warm_up=False)
CASES = ["qwen3_moe_top2", "qwen3_moe_top8", "mixtral_top2", "qwen2_moe_top2"]
MODES = {"tp2": dict(tensor_parallel_size=2), "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True)}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(48)
    # 1 token, a short one, and one past the 64-token budget (a chunked prefill).
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 80)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (path, HF model, prompts, HF's greedy tokens), built once."""
    root = tmp_path_factory.mktemp("moe-tp")
    out = {}
    for case in CASES:
        path = make_tiny_moe_checkpoint(root, case)
        hf = load_hf(str(path))
        prompts = _prompts(hf.config.vocab_size)
        out[case] = (str(path), hf, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts])
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES)
def test_greedy_equals_hf(checkpoints, case, mode):
    path, hf, prompts, expected = checkpoints[case]
    llm = LLM(model=path, **MODES[mode], **ENGINE)
    try:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        ours = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        for prompt, got, want in zip(prompts, ours, expected):
            assert_greedy_match(hf, prompt, got, want)
        # Rank 0's share: half the experts whole (EP), or every expert at half width (TP).
        block = next(layer.mlp for layer in llm.engine.core.runner.model.layers
                     if isinstance(layer.mlp, SparseMoeBlock))
        experts = hf.config.num_local_experts if case.startswith("mixtral") else hf.config.num_experts
        width = hf.config.intermediate_size if case.startswith("mixtral") else hf.config.moe_intermediate_size
        if mode == "ep2":
            assert (block.first_expert, block.num_experts, block.intermediate_size) == (0, experts // 2, width)
        else:
            assert (block.first_expert, block.num_experts, block.intermediate_size) == (0, experts, width // 2)
        if case.startswith("qwen2_moe"):  # the shared expert is sliced in both modes
            assert block.shared_intermediate_size == hf.config.shared_expert_intermediate_size // 2
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()


def test_expert_parallel_over_gloo_sums(checkpoints):
    """--tp-all-reduce gloo: every rank still routes alike (gloo's sum is
    the same on every rank too), so the output is still HF's."""
    path, hf, prompts, expected = checkpoints["qwen3_moe_top2"]
    llm = LLM(model=path, **MODES["ep2"], tp_all_reduce="gloo", **ENGINE)
    try:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        for prompt, r, want in zip(prompts, llm.generate(prompts, params), expected):
            assert_greedy_match(hf, prompt, r.outputs[0].token_ids, want)
    finally:
        llm.engine.core.close()


class _Counting:
    """A real rank group's collectives, with rank 0's all-reduces counted."""

    def __init__(self, group) -> None:  # noqa: ANN001
        self.group, self.all_reduces = group, 0

    def all_reduce(self, tensor, op: str = "sum"):  # noqa: ANN001, ANN201
        self.all_reduces += 1
        return self.group.all_reduce(tensor, op)

    def all_gather(self, tensor, dim: int = 0):  # noqa: ANN001, ANN201
        return self.group.all_gather(tensor, dim)


@pytest.mark.parametrize("mode", list(MODES))
def test_one_all_reduce_per_moe_layer(checkpoints, mode):
    """A decode step of Qwen2-MoE (2 layers, both with experts and the shared
    expert): 1 all-reduce for the embedding, then attention's and the MoE
    block's per layer; no more, though routed and shared experts are both partial."""
    path, hf, prompts, expected = checkpoints["qwen2_moe_top2"]
    llm = LLM(model=path, **MODES[mode], **ENGINE)
    try:
        shard = llm.engine.core.runner.model.shard
        counting = shard.group = _Counting(shard.group)
        engine = llm.engine
        engine.add_request("r", prompts[1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        engine.step()  # the prefill
        counting.all_reduces = 0
        engine.step()  # one decode step
        assert counting.all_reduces == 1 + 2 * hf.config.num_hidden_layers
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        llm.engine.core.close()


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 40])
@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_partials_sum_to_the_whole(num_tokens, ranks):
    """Each rank's fused_experts over its own experts (local indices), summed
    over the ranks, equals one rank's over all; a rank with no tokens routed
    to it gives zeros."""
    g = torch.Generator().manual_seed(num_tokens + ranks)
    experts, hidden = 8, 12
    x = torch.randn(num_tokens, hidden, generator=g)
    mats = torch.randn(experts, hidden, hidden, generator=g)
    weights, ids = route(torch.randn(num_tokens, experts, generator=g), 2, renormalize=True)
    whole = fused_experts(x, weights, ids, experts, lambda e, rows: rows @ mats[e].T)
    per = experts // ranks
    parts = []
    for r in range(ranks):
        called = []

        def expert(e, rows, r=r, called=called):
            called.append(e)
            return rows @ mats[r * per + e].T

        parts.append(fused_experts(x, weights, ids, per, expert, first_expert=r * per))
        assert all(0 <= e < per for e in called)
    torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)
    only_first = torch.zeros_like(ids)  # every pair routed to expert 0: the other ranks add nothing
    assert not fused_experts(x, weights, only_first, per, lambda e, rows: rows, first_expert=per).any()


def test_weight_slices_of_experts():
    config = ModelConfig.from_hf_dict(dict(
        architectures=["Qwen2MoeForCausalLM"], vocab_size=100, hidden_size=16, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48))
    tp, ep = TPShard(1, 2), TPShard(1, 2, expert_parallel=True)
    name = "model.layers.0.mlp.{}.weight".format
    assert tp.weight_slice(name("experts.3.gate_proj"), config) == (0, 16, 32)
    assert tp.weight_slice(name("experts.3.up_proj"), config) == (0, 16, 32)
    assert tp.weight_slice(name("experts.3.down_proj"), config) == (1, 16, 32)
    assert ep.weight_slice(name("experts.3.down_proj"), config) is None  # whole experts
    for shard in (tp, ep):  # the shared expert sliced either way; routers replicated
        assert shard.weight_slice(name("shared_expert.gate_proj"), config) == (0, 24, 48)
        assert shard.weight_slice(name("shared_expert.down_proj"), config) == (1, 24, 48)
        assert shard.weight_slice(name("shared_expert_gate"), config) is None
        assert shard.weight_slice(name("gate"), config) is None
    assert tp.weight_slice("model.layers.0.block_sparse_moe.experts.0.w1.weight", config) == (0, 16, 32)
    assert tp.weight_slice("model.layers.0.block_sparse_moe.experts.0.w2.weight", config) == (1, 16, 32)
    assert (tp.expert_range(8), ep.expert_range(8)) == ((0, 8), (4, 8))


def test_expert_parallel_rank_reads_only_its_experts(checkpoints):
    """Rank 1 of EP 2 expects (and copies) experts 4..7 only; a name past
    the model's experts is still refused."""
    from kvferry.model.llama import LlamaModel
    from kvferry.model.loader import read_config
    from pathlib import Path

    path = checkpoints["qwen3_moe_top2"][0]
    model = LlamaModel(read_config(Path(path)), shard=TPShard(1, 2, expert_parallel=True))
    keys = [k for k in model._expected_keys() if ".experts." in k]
    assert {int(k.split(".experts.")[1].split(".")[0]) for k in keys} == {4, 5, 6, 7}
    assert model._target("model.layers.0.mlp.experts.1.up_proj.weight") is None  # rank 0's: skipped
    param, rows, _ = model._target("model.layers.0.mlp.experts.5.up_proj.weight")
    assert param is model.layers[0].mlp.w13 and rows[0] == 1
    with pytest.raises(ValueError, match="unexpected weight"):
        model._target("model.layers.0.mlp.experts.8.up_proj.weight")


@pytest.mark.parametrize("overrides, ep, field", [
    (dict(num_experts=6), True, "num_experts (6) is not divisible by it with expert parallelism"),
    (dict(moe_intermediate_size=30), False, "moe_intermediate_size (30)"),
    (dict(shared_expert_intermediate_size=30), True, "shared_expert_intermediate_size (30)"),
])
def test_experts_that_do_not_split_are_refused_before_any_rank_starts(tmp_path, overrides, ep, field):
    # 4 ranks: 8 experts split, 6 do not; a width of 30 does not split over 4.
    path = make_tiny_moe_checkpoint(tmp_path, "qwen2_moe_top2", num_attention_heads=4, num_key_value_heads=4,
                                    **overrides)
    with pytest.raises(ValueError, match=re.escape(f"tensor_parallel_size 4: the model's {field}")) as e:
        LLM(model=str(path), tensor_parallel_size=4, enable_expert_parallel=ep, **ENGINE)
    assert "\n" not in str(e.value)
