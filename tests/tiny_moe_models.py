"""Tiny random-weight mixture-of-experts HF checkpoints for tests (no downloads).

    from tests.tiny_moe_models import make_tiny_moe_checkpoint
    path = make_tiny_moe_checkpoint(tmp_path, "qwen2_moe_top2")

Each case is an architecture plus the routing switches it exercises: 8
experts, top-2 or top-8 (every expert), ``norm_topk_prob`` on and off,
Qwen2-MoE's gated shared expert, and dense layers among sparse ones
(``mlp_only_layers`` / ``decoder_sparse_step``). The tokenizer is
tiny_models.py's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import BASE_CONFIG, write_tokenizer

_MOE = dict(num_experts=8, moe_intermediate_size=32)

# case -> (transformers config class name, overrides of BASE_CONFIG)
MOE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen3-MoE: per-head q/k norms; layer 1 dense (mlp_only_layers), top-2 renormalized
    "qwen3_moe_top2": ("Qwen3MoeConfig", dict(_MOE, num_hidden_layers=3, head_dim=32, num_experts_per_tok=2,
                                              norm_topk_prob=True, mlp_only_layers=[1])),
    # every expert taken, probabilities not renormalized; layers 1 and 3 sparse (decoder_sparse_step=2)
    "qwen3_moe_top8": ("Qwen3MoeConfig", dict(_MOE, num_hidden_layers=4, num_experts_per_tok=8,
                                              norm_topk_prob=False, decoder_sparse_step=2)),
    # Mixtral: softmax over the top-k logits; block_sparse_moe.experts.N.w1/w2/w3 names
    "mixtral_top2": ("MixtralConfig", dict(num_local_experts=8, intermediate_size=32, num_experts_per_tok=2,
                                           sliding_window=None, rope_theta=1000000.0)),
    # Qwen2-MoE: q/k/v bias, the shared expert and its sigmoid gate
    "qwen2_moe_top2": ("Qwen2MoeConfig", dict(_MOE, num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                              norm_topk_prob=False, tie_word_embeddings=True)),
    "qwen2_moe_top8": ("Qwen2MoeConfig", dict(_MOE, num_experts_per_tok=8, shared_expert_intermediate_size=48,
                                              norm_topk_prob=True)),
}


def make_tiny_moe_checkpoint(tmp_path: str | Path, case: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Save case ``case`` of MOE_CASES as a random float32 HF model + tokenizer
    into ``tmp_path/tiny-<case>``; return the folder."""
    import transformers as tf

    cls_name, case_overrides = MOE_CASES[case]
    path = Path(tmp_path) / f"tiny-{case}"
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    kw = {**BASE_CONFIG, "vocab_size": vocab, "tie_word_embeddings": False, **case_overrides, **overrides}
    config = getattr(tf, cls_name)(**kw)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path
