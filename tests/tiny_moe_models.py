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
    "qwen2_moe_top2": ("Qwen2MoeConfig", dict(_MOE, num_experts_per_tok=2, shared_expert_intermediate_size=64,
                                              norm_topk_prob=False, tie_word_embeddings=True)),
    "qwen2_moe_top8": ("Qwen2MoeConfig", dict(_MOE, num_experts_per_tok=8, shared_expert_intermediate_size=64,
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


def write_tiny_moe_gguf(hf_folder: str | Path, out_file: str | Path, qtype: str | None = None) -> Path:
    """Write a tiny MoE checkpoint as llama.cpp lays one out: the experts of a
    layer stacked in ``blk.N.ffn_{gate,up,down}_exps``, the router
    ``ffn_gate_inp``, Qwen2-MoE's ``ffn_*_shexp`` and ``ffn_gate_inp_shexp``
    ([H]), Mixtral as ``llama`` with Q/K rows permuted. ``qtype`` (e.g.
    "Q8_0"): the linear weights, experts included, in that type."""
    import json

    import gguf
    from safetensors.torch import load_file

    from kvferry.model.gguf_convert import permute_qk
    from tests.tiny_models import _gguf_hparams, _gguf_name, _gguf_tokenizer

    folder = Path(hf_folder)
    cfg = json.loads((folder / "config.json").read_text())
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[cfg["model_type"]]
    w = gguf.GGUFWriter(str(out_file), arch)
    _gguf_hparams(w, cfg)
    _gguf_tokenizer(w, folder, "default")
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch != "llama":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    tensors = load_file(str(folder / "model.safetensors"))

    def add(name: str, t: torch.Tensor, quantize: bool) -> None:
        if qtype is None or not quantize:
            w.add_tensor(name, t.float().numpy())
            return
        kind = gguf.GGMLQuantizationType[qtype]
        blocks = gguf.quants.quantize(t.float().numpy(), kind)
        w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)

    stacks: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        parts = name.split(".")
        block = parts[3] if len(parts) > 4 else ""
        if block in ("mlp", "block_sparse_moe") and parts[4] == "experts":
            proj = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
                    "w2": "down"}[parts[6]]
            stacks.setdefault((parts[2], proj), {})[int(parts[5])] = t
        elif block in ("mlp", "block_sparse_moe") and parts[4] == "gate":
            add(f"blk.{parts[2]}.ffn_gate_inp.weight", t, False)
        elif block == "mlp" and parts[4] == "shared_expert_gate":
            w.add_tensor(f"blk.{parts[2]}.ffn_gate_inp_shexp.weight", t.reshape(-1).float().numpy())
        elif block == "mlp" and parts[4] == "shared_expert":
            add(f"blk.{parts[2]}.ffn_{parts[5].removesuffix('_proj')}_shexp.weight", t, True)
        else:
            if arch == "llama" and ".q_proj." in name:
                t = permute_qk(t, cfg["num_attention_heads"])
            elif arch == "llama" and ".k_proj." in name:
                t = permute_qk(t, cfg["num_key_value_heads"])
            add(_gguf_name(name), t, name.endswith("_proj.weight"))
    for (layer, proj), by_expert in sorted(stacks.items()):
        add(f"blk.{layer}.ffn_{proj}_exps.weight", torch.stack([by_expert[e] for e in range(experts)]), True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out_file)
