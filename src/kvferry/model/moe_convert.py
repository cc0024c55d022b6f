"""llama.cpp's mixture-of-experts tensors and keys -> HF's, for gguf_convert.py.

A GGUF MoE file (``qwen2moe``, ``qwen3moe``; Mixtral as ``llama`` with
``llama.expert_count``) holds each layer's experts stacked in one tensor
per projection, ``blk.N.ffn_{gate,up,down}_exps`` ([E, I, H] / [E, H, I]
once dequantized), the router ``ffn_gate_inp`` [E, H] and, for Qwen2-MoE,
the shared expert ``ffn_{gate,up,down}_shexp`` with its gate
``ffn_gate_inp_shexp``. They become HF's per-expert names
(``mlp.experts.N.gate_proj`` ..., Mixtral's
``block_sparse_moe.experts.N.w1`` ...), which the model stacks again
(moe.py). Routing follows llama.cpp: Qwen3-MoE and Mixtral renormalize the
top-k weights, Qwen2-MoE does not, unless the file states
``expert_weights_norm``. A layer without a router is dense
(``mlp_only_layers``).
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

_MOE_TENSOR = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps|ffn_gate_inp|ffn_(?:gate|up|down)_shexp|"
                         r"ffn_gate_inp_shexp)\.weight")
_EXPERT_PROJ = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"),
                "ffn_down_exps": ("down_proj", "w2")}
_SHARED = {"ffn_gate_shexp": "shared_expert.gate_proj", "ffn_up_shexp": "shared_expert.up_proj",
           "ffn_down_shexp": "shared_expert.down_proj", "ffn_gate_inp_shexp": "shared_expert_gate"}
# llama.cpp's routing per architecture: renormalize the top-k weights?
_NORM_DEFAULT = {"qwen3moe": True, "qwen2moe": False, "llama": True}


def is_moe_tensor(gguf_name: str) -> bool:
    return _MOE_TENSOR.fullmatch(gguf_name) is not None


def with_moe_fields(meta: dict[str, Any], tensor_names: set[str], config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (an HF config dict) with the MoE fields of a file that has experts."""
    arch = meta.get("general.architecture")
    p = f"{arch}."
    experts = int(meta.get(p + "expert_count") or 0)
    if not experts:
        return config
    layers = config["num_hidden_layers"]
    norm = bool(meta.get(p + "expert_weights_norm", _NORM_DEFAULT.get(arch, False)))
    moe = {
        "num_experts": experts,
        "num_experts_per_tok": int(meta[p + "expert_used_count"]),
        "norm_topk_prob": norm,
    }
    if arch == "llama":  # Mixtral: every layer sparse, experts as wide as feed_forward_length
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts)
        moe.pop("num_experts")
        if not norm:
            raise ValueError("GGUF llama with experts but expert_weights_norm false: not Mixtral's routing")
        moe.pop("norm_topk_prob")
    else:
        moe["moe_intermediate_size"] = int(meta[p + "expert_feed_forward_length"])
        moe["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
        if arch == "qwen2moe":
            moe["shared_expert_intermediate_size"] = int(meta.get(p + "expert_shared_feed_forward_length") or 0)
            moe["qkv_bias"] = config["attention_bias"]
    config.update(moe)
    return config


def hf_tensors(gguf_name: str, tensor: torch.Tensor, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for one of llama.cpp's MoE tensors (float, HF layout as
    gguf_convert.float_tensor returns it): one per expert for a stacked one."""
    m = _MOE_TENSOR.fullmatch(gguf_name)
    if m is None:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    layer, kind = m.group(1), m.group(2)
    mixtral = config.get("model_type") == "mixtral"
    block = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"
    if kind == "ffn_gate_inp":
        yield f"{block}.gate.weight", tensor
    elif kind in _SHARED:
        # the shared expert's gate is one row: [H] or [1, H] in a file
        yield f"{block}.{_SHARED[kind]}.weight", tensor.reshape(1, -1) if kind == "ffn_gate_inp_shexp" else tensor
    else:
        name = _EXPERT_PROJ[kind][1 if mixtral else 0]
        if tensor.dim() != 3:
            raise ValueError(f"GGUF tensor {gguf_name!r} should be 3-D [experts, rows, cols], "
                             f"got shape {tuple(tensor.shape)}")
        for e in range(tensor.shape[0]):
            yield f"{block}.experts.{e}.{name}.weight", tensor[e].clone()
