"""``--quantization int8`` over tensor-parallel ranks: every rank quantizes
only its own slice of each weight (TP 2: every expert's rows or columns;
``--enable-expert-parallel``: its whole experts), as it reads it, and the
greedy output is int8 at TP 1's, through the offline LLM API, on tiny
random-weight MoE models (Qwen2-MoE with its shared expert, Mixtral) and a
dense Llama.

Not bit for bit: a row-parallel layer (o_proj, down_proj) quantizes its
slice of each row with its own scale, and its rank quantizes its slice of
each token's activations with its own scale too (vLLM's W8A8 over TP does
the same), so the logits move within int8's own error. The greedy tokens
then agree with TP 1's except where TP 1's own top two were that close.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvferry import LLM, SamplingParams
from kvferry.model.int8_gemm import quantize_weight
from kvferry.model.moe import SparseMoeBlock
from kvferry.model.moe_quant import Int8ExpertMethod, QuantizedExperts
from tests.tiny_models import make_tiny_checkpoint
from tests.tiny_moe_models import make_tiny_moe_checkpoint

MAX_NEW = 8
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory_gb=0.02,
              cpu_threads_per_rank=1, warm_up=False, quantization="int8")
MODES = {"tp1": {}, "tp2": dict(tensor_parallel_size=2),
         "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True)}
# int8's own error, twice over: TP 1's weights and activations quantized one way, TP 2's another
# (on these models int8 against float moves a chosen token's logprob by up to ~0.06 nats, and the
# difference compounds over the layers). A wrong slice moves it by whole nats.
LOGPROB_ATOL = 0.25
# Where TP 2's greedy token may differ from TP 1's: TP 1's own top two within that error
# (the tiny random models' distributions are flat: their top two are often a few hundredths apart).
TIE_NATS = LOGPROB_ATOL


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(46)
    # 1 token, a short one, and one past the 64-token budget (a chunked prefill).
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 80)]


def _run(path: str, mode: str) -> tuple[list, dict]:
    """Each prompt's completion, and rank 0's int8 expert stacks (first MoE layer) and a dense qweight."""
    llm = LLM(model=path, **MODES[mode], **ENGINE)
    try:
        model = llm.engine.core.runner.model
        prompts = _prompts(model.config.vocab_size)
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=2)
        outs = [r.outputs[0] for r in llm.generate(prompts, params)]
        block = next((layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)), None)
        held = {"o_proj": model.layers[0].self_attn.o_proj.qweight.clone()}
        if block is not None:
            held.update(block=(block.first_expert, block.num_experts), w13=block.w13, w2=block.w2)
        llm.engine.check_integrity()
        return outs, held
    finally:
        llm.engine.core.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """model -> mode -> (outputs, rank 0's weights), every engine started once."""
    root = tmp_path_factory.mktemp("int8-tp")
    paths = {"qwen2_moe_top2": make_tiny_moe_checkpoint(root, "qwen2_moe_top2"),
             "mixtral_top2": make_tiny_moe_checkpoint(root, "mixtral_top2"),
             "llama": make_tiny_checkpoint(root / "dense", arch="llama")}
    out = {}
    for name, path in paths.items():
        modes = MODES if name != "llama" else ("tp1", "tp2")
        out[name] = {"path": Path(path), **{mode: _run(str(path), mode) for mode in modes}}
    return out


def _assert_agrees(base: list, other: list, what: str) -> None:
    compared = 0
    for i, (a, b) in enumerate(zip(base, other)):
        for j, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            lp_a, lp_b = a.logprobs[j], b.logprobs[j]
            if ta != tb:
                gap = lp_a.top_logprobs[0] - lp_a.top_logprobs[1]
                assert gap < TIE_NATS, f"{what}, prompt {i}: token {j} is {tb}, TP 1's {ta} led by {gap:.3f} nats"
                break
            assert abs(lp_a.logprob - lp_b.logprob) < LOGPROB_ATOL, (what, i, j, lp_a.logprob, lp_b.logprob)
            compared += 1
    assert compared >= len(base) * MAX_NEW // 2, f"{what}: only {compared} tokens agree"


@pytest.mark.parametrize("model, mode", [("qwen2_moe_top2", "tp2"), ("qwen2_moe_top2", "ep2"),
                                         ("mixtral_top2", "tp2"), ("mixtral_top2", "ep2"), ("llama", "tp2")])
def test_greedy_equals_int8_at_tp1(runs, model, mode):
    _assert_agrees(runs[model]["tp1"][0], runs[model][mode][0], f"{model} {mode}")


def _checkpoint_expert(path: Path, model: str, e: int, proj: str) -> torch.Tensor:
    tensors = load_file(str(path / "model.safetensors"))
    if model == "mixtral_top2":
        name = {"gate": "w1", "up": "w3", "down": "w2"}[proj]
        return tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{name}.weight"]
    return tensors[f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight"]


@pytest.mark.parametrize("model", ["qwen2_moe_top2", "mixtral_top2"])
def test_each_rank_quantizes_only_its_slice(runs, model):
    """Rank 0's int8 experts are its slice of the float checkpoint quantized
    per output channel: TP 2, every expert's first half of gate/up rows and
    of down's columns (down's scales its half-rows' own); EP 2, experts 0..3
    whole, the same bytes as TP 1's."""
    path = runs[model]["path"]
    tp1, tp2, ep2 = (runs[model][m][1] for m in ("tp1", "tp2", "ep2"))
    for held in (tp1, tp2, ep2):
        for stack in (held["w13"], held["w2"]):
            assert isinstance(stack, QuantizedExperts) and isinstance(stack.method, Int8ExpertMethod)
            assert stack.qweight.dtype == torch.int8 and stack.weight is None
    assert (tp2["block"], ep2["block"]) == ((0, 8), (0, 4))
    assert torch.equal(ep2["w13"].qweight, tp1["w13"].qweight[:4]) and torch.equal(ep2["w2"].qweight,
                                                                                     tp1["w2"].qweight[:4])
    inter = tp1["w2"].in_features
    assert (tp2["w13"].qweight.shape[1], tp2["w2"].qweight.shape[2]) == (inter, inter // 2)
    for e in (0, 5):
        gate, up, down = (_checkpoint_expert(path, model, e, p) for p in ("gate", "up", "down"))
        rows = torch.cat([gate[:inter // 2], up[:inter // 2]])
        assert torch.equal(tp2["w13"].qweight[e], quantize_weight(rows).qweight)
        want = quantize_weight(down[:, :inter // 2])
        assert torch.equal(tp2["w2"].qweight[e], want.qweight) and torch.equal(tp2["w2"].wscale[e], want.scale)


def test_dense_int8_rank_holds_half_of_each_row_parallel_layer(runs):
    tp1, tp2 = runs["llama"]["tp1"][1], runs["llama"]["tp2"][1]
    assert tp2["o_proj"].dtype == torch.int8
    assert tp2["o_proj"].shape == (tp1["o_proj"].shape[0], tp1["o_proj"].shape[1] // 2)
