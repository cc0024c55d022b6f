"""Mixture-of-experts models (model/moe.py) against HF transformers in float32.

Each case of tests/tiny_moe_models.py (Qwen3-MoE, Mixtral, Qwen2-MoE with
its shared expert; top-2 and top-8 of 8 experts; dense layers among
sparse ones) must give HF's logits through the paged forward and HF's
greedy tokens through the offline LLM API; the fused expert function must
equal a per-token reference, and the router HF's own router modules.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvferry.engine.llm import LLM
from kvferry.model import small_gemm
from kvferry.model.loader import load_model
from kvferry.model.moe import ExpertLinear, SparseMoeBlock, fused_experts, route
from kvferry.sampling import SamplingParams
from tests.engine.hf_reference import assert_greedy_match, hf_greedy
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import load_hf_model
from tests.tiny_moe_models import MOE_CASES, make_tiny_moe_checkpoint

ATOL = 1e-4
MAX_NEW = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {case: make_tiny_moe_checkpoint(root, case) for case in MOE_CASES}


def _naive_experts(x, weights, ids, w13, w2):
    """One token and one expert at a time, HF's SiLU(gate) * up."""
    out = torch.zeros_like(x, dtype=torch.float32)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e] @ x[t]
            y = w2[e] @ (torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:])
            out[t] += weights[t, j].float() * y.float()
    return out.to(x.dtype)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 33])
def test_fused_experts_equals_per_token_reference(top_k, num_tokens):
    g = torch.Generator().manual_seed(top_k * 100 + num_tokens)
    experts, hidden, inter = 8, 24, 16
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    weights, ids = route(torch.randn(num_tokens, experts, generator=g), top_k, renormalize=top_k > 1)
    calls = []

    def expert(e, rows):
        calls.append((e, rows.shape[0]))
        gate_up = rows @ w13[e].T
        return (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[e].T

    got = fused_experts(x, weights, ids, experts, expert)
    torch.testing.assert_close(got, _naive_experts(x, weights, ids, w13, w2), atol=1e-5, rtol=1e-5)
    # each active expert once, over all its tokens, in expert order
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    assert calls == [(e, int(n)) for e, n in enumerate(counts) if n]


@pytest.mark.parametrize("family", ["qwen", "mixtral"])
@pytest.mark.parametrize("top_k, norm", [(2, True), (2, False), (8, False)])
def test_route_equals_hf_router(family, top_k, norm):
    import transformers as tf

    if family == "mixtral":
        if not norm:
            pytest.skip("Mixtral always renormalizes")
        hf = tf.models.mixtral.modeling_mixtral.MixtralTopKRouter(
            tf.MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=top_k))
    else:
        hf = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(
            tf.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=top_k, norm_topk_prob=norm))
    torch.nn.init.normal_(hf.weight, std=0.5)
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(1))
    logits, want_w, want_ids = hf(x)
    got_w, got_ids = route(logits, top_k, renormalize=norm)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w.float(), atol=0, rtol=0)


def _random_seqs(vocab: int, lengths: dict[int, int], seed: int = 0) -> dict[int, list[int]]:
    rng = random.Random(seed)
    return {rid: [rng.randrange(3, vocab) for _ in range(n)] for rid, n in lengths.items()}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_paged_forward_matches_hf(checkpoints, case):
    """Prefill chunks and decodes of three requests in one batch: every token
    routes on its own, whatever shares its step."""
    path = checkpoints[case]
    loaded = load_model(str(path), dtype="float32")
    layers = loaded.model.layers
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in layers)
    if case.startswith("qwen3_moe"):  # the dense layers HF's rule leaves dense
        assert not all(isinstance(layer.mlp, SparseMoeBlock) for layer in layers)
    hf = load_hf_model(path)
    seqs = _random_seqs(loaded.config.vocab_size, {0: 10, 1: 14, 2: 3})
    with torch.no_grad():
        want = {rid: hf(torch.tensor([s])).logits[0] for rid, s in seqs.items()}
    harness = PagedHarness(loaded.model)
    done = {rid: 0 for rid in seqs}
    for plan in ({0: 9, 1: 6, 2: 1}, {0: 1, 1: 8, 2: 1}, {2: 1}):
        for rid, logits in harness.step(seqs, plan).items():
            ref = want[rid][done[rid]:done[rid] + plan[rid]]
            torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0, msg=lambda m: f"{case} req {rid}: {m}")
            done[rid] += plan[rid]
    # packed per expert, the stacked plain copy released: the weights are in memory once
    moe = next(layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoeBlock))
    if moe.w13.experts[0].packed is not None:
        assert moe.w13.weight.numel() == 0 and moe.w2.weight.numel() == 0


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_llm_greedy_equals_hf(checkpoints, case):
    path = str(checkpoints[case])
    hf = load_hf_model(path)
    prompts = list(_random_seqs(hf.config.vocab_size, {0: 7, 1: 15, 2: 2, 3: 11}, seed=3).values())
    llm = LLM(path, dtype="float32", kv_cache_memory_gb=0.05, max_num_seqs=4, warm_up=False)
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert_greedy_match(hf, prompt, result.token_ids, hf_greedy(hf, prompt, MAX_NEW))


def test_deterministic_methods_and_reload(checkpoints):
    """--deterministic's methods (set before the first step, as the engine
    does) reach the experts, and a second load into packed (released)
    experts gives the same logits."""
    from kvferry.model.layers import BatchInvariantConfig, BatchInvariantLinearMethod
    from kvferry.model.loader import iter_safetensors

    path = checkpoints["qwen2_moe_top2"]
    plain = load_model(str(path), dtype="float32").model
    seqs = _random_seqs(plain.config.vocab_size, {0: 6, 1: 4})
    plan = {0: 6, 1: 4}
    first = PagedHarness(plain).step(seqs, plan)
    plain.load_weights(iter_safetensors(path))  # into released stacks: restored first
    reloaded = PagedHarness(plain).step(seqs, plan)
    det = load_model(str(path), dtype="float32").model
    det.set_linear_config(BatchInvariantConfig())
    stacks = [lin for lin in det.linears() if isinstance(lin, ExpertLinear)]
    assert stacks and all(isinstance(lin.method, BatchInvariantLinearMethod) for lin in stacks)
    deterministic = PagedHarness(det).step(seqs, plan)
    for rid in seqs:
        torch.testing.assert_close(reloaded[rid], first[rid], atol=0, rtol=0)
        torch.testing.assert_close(deterministic[rid], first[rid], atol=ATOL, rtol=0)


def test_moe_config_errors_name_the_field():
    from kvferry.model.config import ModelConfig

    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_experts=4, moe_intermediate_size=16)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**base, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelConfig.from_hf_dict({**base, "num_experts_per_tok": 2, "moe_intermediate_size": 0})
    c = ModelConfig.from_hf_dict({**base, "num_experts_per_tok": 2, "mlp_only_layers": [0]})
    assert [c.is_moe_layer(i) for i in range(2)] == [False, True]
    mixtral = ModelConfig.from_hf_dict({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8})
    assert mixtral.num_experts == 8 and mixtral.moe_intermediate_size == 128 and mixtral.norm_topk_prob


@pytest.mark.skipif(not small_gemm.cpu_supports(torch.bfloat16),
                    reason="needs AVX512-BF16 for the batch-invariant bf16 matmul")
def test_deterministic_moe_same_bits_alone_and_in_a_batch(tmp_path):
    """--deterministic in bf16: a prompt's greedy tokens and logprobs are the
    same bits alone, in a batch (its tokens then share experts' matmuls with
    other requests' tokens) and chunked."""
    path = str(make_tiny_moe_checkpoint(tmp_path, "qwen2_moe_top2", hidden_size=256, moe_intermediate_size=512,
                                        shared_expert_intermediate_size=512, max_position_embeddings=1024))
    rng = random.Random(48)
    prompt, *others = ([rng.randrange(3, 384) for _ in range(n)] for n in (300, 37, 211, 5))
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=5, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)

    def result(out):
        return list(out.outputs[0].token_ids), [list(lp.top_logprobs) for lp in out.outputs[0].logprobs]

    llm = LLM(path, dtype="bfloat16", deterministic=True, num_kv_blocks=256, block_size=16,
              enable_prefix_caching=False, warm_up=False)
    alone = result(llm.generate([prompt], params)[0])
    batched = result(llm.generate([others[0], prompt, *others[1:]], [short, params, short, short])[1])
    chunked = LLM(path, dtype="bfloat16", deterministic=True, num_kv_blocks=256, block_size=16,
                  enable_prefix_caching=False, max_num_batched_tokens=32, warm_up=False)
    in_chunks = result(chunked.generate([others[1], prompt], [short, params])[1])
    assert batched == alone
    assert in_chunks == alone
