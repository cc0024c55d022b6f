from __future__ import annotations

import pytest

from kvferry.model.config import ModelConfig

BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4)


def test_defaults_and_derived_fields():
    c = ModelConfig.from_hf_dict({**BASE, "eos_token_id": [2, 3], "bos_token_id": 1})
    assert c.num_key_value_heads == 4 and c.head_dim == 16
    assert c.eos_token_ids == [2, 3] and c.bos_token_id == 1
    assert c.rope_scaling.rope_type == "default" and c.rope_theta == 10000.0
    assert not c.attention_bias and not c.qk_norm


def test_architecture_switches():
    qwen2 = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    qwen3 = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen2.attention_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128
    assert ModelConfig.from_hf_dict({**BASE, "architectures": None, "model_type": "mistral"}).architecture == \
        "MistralForCausalLM"


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_llama3_rope_both_layouts(layout):
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    if layout == "v4":
        d = {**BASE, "rope_theta": 500000.0, "rope_scaling": {**params, "type": "llama3"}}
    else:
        d = {**BASE, "rope_parameters": {**params, "rope_theta": 500000.0}}
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling.rope_type == "llama3" and c.rope_scaling.factor == 8.0
    assert c.rope_scaling.original_max_position_embeddings == 8192


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_bad_gqa_ratio():
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig.from_hf_dict({**BASE, "num_key_value_heads": 3})
