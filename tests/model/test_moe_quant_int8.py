"""--quantization int8 over mixtures of experts (model/moe_quant.py): every
expert's gate_up and down int8 per output channel, quantized as each
expert's tensor is loaded, against the float model, as tests/model/test_int8.py
checks dense models; and a compressed-tensors W8A8 MoE checkpoint loads as it is."""
from __future__ import annotations

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.model.layers.int8 import Int8LinearMethod
from kvferry.model.loader import load_model
from kvferry.model.moe_quant import Int8ExpertMethod, QuantizedExperts
from tests.model.paged_harness import PagedHarness
from tests.model.test_int8 import write_w8a8
from tests.tiny_moe_models import make_tiny_moe_checkpoint

CASES = ["qwen3_moe_top2", "mixtral_top2", "qwen2_moe_top8"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe-int8")


def _logprobs(model: torch.nn.Module, rows: int = 24) -> torch.Tensor:
    seq = [(7 * i + 3) % 300 + 3 for i in range(rows)]
    return torch.log_softmax(PagedHarness(model).step({0: seq}, {0: rows})[0], -1)


@pytest.mark.parametrize("case", CASES)
def test_int8_experts_against_float(root, case):
    path = make_tiny_moe_checkpoint(root, case)
    lm = load_model(str(path), dtype="float32", quantization="int8").model
    stacks = [m for m in lm.modules() if isinstance(m, QuantizedExperts)]
    assert len(stacks) == 2 * sum(1 for layer in lm.layers if hasattr(layer.mlp, "w13"))
    for s in stacks:  # int8, one scale per output channel of each expert: no float copy
        assert isinstance(s.method, Int8ExpertMethod) and s.weight is None
        assert s.qweight.dtype == torch.int8 and s.qweight.shape == (s.num_experts, s.out_features, s.in_features)
        assert s.wscale.shape == (s.num_experts, s.out_features)
    # the router and the shared expert are int8 too, the lm_head stays float
    assert any(isinstance(lin.method, Int8LinearMethod) for lin in lm.linears() if lin.prefix.endswith(".mlp.gate"))
    assert not isinstance(lm.logits_proj.method, Int8LinearMethod)
    a, b = _logprobs(lm), _logprobs(load_model(str(path), dtype="float32").model)
    d = (a - b).abs()
    # As the dense int8 test (24 teacher-forced rows of a random model with near-flat
    # logits): top-1 agreement >= 75%, |d logprob| mean < 0.06.
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
    assert d.mean() < 0.06, d.mean()


def test_int8_moe_greedy_agrees_with_float(root):
    """Greedy continuations agree for as long as the float model's choice is
    clear: a random model's near-flat logits put near-ties (top-2 within 0.2
    nats) everywhere, where any rounding may pick the other token."""
    path = make_tiny_moe_checkpoint(root, "qwen3_moe_top2")
    prompts = [f"{a} {b}" for a in ("hello", "the quick", "a b c", "one two") for b in ("world", "fox", "d")]
    outs = {}
    for q in ("int8", None):
        llm = LLM(str(path), quantization=q, dtype="float32", kv_cache_memory_gb=0.05, max_num_seqs=4,
                  warm_up=False, max_model_len=128)
        outs[q] = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                                                logprobs=2))]
        del llm
    compared = 0
    for q8, f in zip(outs["int8"], outs[None]):
        for step, lp in enumerate(f.logprobs):
            if lp.top_logprobs[0] - lp.top_logprobs[1] < 0.2:
                break  # a near-tie: the paths may part here
            assert q8.token_ids[step] == f.token_ids[step], (f.token_ids, q8.token_ids)
            compared += 1
    assert compared >= 6, compared  # some clear choices were compared


def test_compressed_tensors_w8a8_moe_loads_as_it_is(root, tmp_path):
    path = make_tiny_moe_checkpoint(root, "qwen2_moe_top2")
    ct = write_w8a8(path, tmp_path / "w8a8-moe")  # every linear's weight int8 with its scale, experts too
    lm = load_model(str(ct), dtype="float32").model
    assert all(isinstance(s.method, Int8ExpertMethod) for s in lm.modules() if isinstance(s, QuantizedExperts))
    # The same int8 values and scales as quantizing the float checkpoint at load: the same logits.
    assert torch.equal(_logprobs(lm), _logprobs(load_model(str(path), dtype="float32", quantization="int8").model))
