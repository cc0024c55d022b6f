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

Served in blocks (``--quantization gguf``, gguf_weights.py), the experts
and the shared expert in a type with a native kernel stay in the file's
blocks: ``block_prefix`` names the layer each tensor belongs to (the expert
stacks ``mlp.experts.{gate_up,down}_proj`` whatever the architecture's
block name: moe.py's prefixes), and ``expert_blocks`` cuts a stacked
tensor's bytes into one ``QuantizedWeight`` per expert, each a view of the
blocks' huge-page copy or of the mapped file (an expert's rows are contiguous: blocks never cross a row, and
the expert axis is the slowest). The router and the shared expert's gate
stay float (routing decides which experts run at all).
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from kvferry.model.quant import QuantizedWeight

_MOE_TENSOR = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps|ffn_gate_inp|ffn_(?:gate|up|down)_shexp|"
                         r"ffn_gate_inp_shexp)\.weight")
_EXPERT_PROJ = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"),
                "ffn_down_exps": ("down_proj", "w2")}
_SHARED = {"ffn_gate_shexp": "shared_expert.gate_proj", "ffn_up_shexp": "shared_expert.up_proj",
           "ffn_down_shexp": "shared_expert.down_proj", "ffn_gate_inp_shexp": "shared_expert_gate"}
# llama.cpp's routing per architecture: renormalize the top-k weights?
_NORM_DEFAULT = {"qwen3moe": True, "qwen2moe": False, "llama": True}
# The layer (moe.py's prefix within model.layers.N.mlp) a tensor kept in blocks belongs to.
_BLOCK_LAYER = {"ffn_gate_exps": "experts.gate_up_proj", "ffn_up_exps": "experts.gate_up_proj",
                "ffn_down_exps": "experts.down_proj", "ffn_gate_shexp": "shared_expert.gate_up_proj",
                "ffn_up_shexp": "shared_expert.gate_up_proj", "ffn_down_shexp": "shared_expert.down_proj"}


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
    stacked = _EXPERT_PROJ.get(_kind(gguf_name)) is not None
    if stacked and tensor.dim() != 3:
        raise ValueError(f"GGUF tensor {gguf_name!r} should be 3-D [experts, rows, cols], "
                         f"got shape {tuple(tensor.shape)}")
    names = hf_names(gguf_name, config, tensor.shape[0] if stacked else 0)
    if not stacked:
        # the shared expert's gate is one row: [H] or [1, H] in a file
        yield names[0], tensor.reshape(1, -1) if _kind(gguf_name) == "ffn_gate_inp_shexp" else tensor
        return
    for e, name in enumerate(names):
        yield name, tensor[e].clone()


def _kind(gguf_name: str) -> str:
    m = _MOE_TENSOR.fullmatch(gguf_name)
    if m is None:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return m.group(2)


def hf_names(gguf_name: str, config: dict[str, Any], num_experts: int) -> list[str]:
    """The HF names of one of llama.cpp's MoE tensors: one per expert (of
    ``num_experts``) for a stacked one, else one."""
    kind, layer = _kind(gguf_name), gguf_name.split(".")[1]
    mixtral = config.get("model_type") == "mixtral"
    block = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"
    if kind == "ffn_gate_inp":
        return [f"{block}.gate.weight"]
    if kind in _SHARED:
        return [f"{block}.{_SHARED[kind]}.weight"]
    name = _EXPERT_PROJ[kind][1 if mixtral else 0]
    return [f"{block}.experts.{e}.{name}.weight" for e in range(num_experts)]


def block_prefix(gguf_name: str) -> str | None:
    """The layer an expert or shared-expert tensor may be kept in blocks
    for (``model.layers.N.mlp.experts.gate_up_proj`` ...), or None (the
    router, the shared expert's gate, and every non-MoE tensor)."""
    m = _MOE_TENSOR.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_LAYER:
        return None
    return f"model.layers.{m.group(1)}.mlp.{_BLOCK_LAYER[m.group(2)]}"


def expert_blocks(gguf_name: str, kind: str, data: torch.Tensor, gguf_shape: Any,
                  config: dict[str, Any]) -> Iterator[tuple[str, QuantizedWeight]]:
    """(HF name, QuantizedWeight) for an expert or shared-expert tensor kept
    in blocks: ``data`` is its raw bytes (uint8, in the huge-page slab or a view of the mapped file);
    a stacked [E, rows, cols] tensor gives one weight per expert, each a
    view of its own bytes (no copy, no page read)."""
    shape = [int(d) for d in reversed(gguf_shape)]  # GGUF lists the fastest axis first
    flat = data.reshape(-1)
    if len(shape) == 2:  # the shared expert's projection
        yield hf_names(gguf_name, config, 0)[0], QuantizedWeight.from_blocks(gguf_name, kind, flat, tuple(shape))
        return
    if len(shape) != 3:
        raise ValueError(f"GGUF tensor {gguf_name!r} should be 3-D [experts, rows, cols], got shape {shape}")
    experts, rows, cols = shape
    if flat.numel() % experts:
        raise ValueError(f"GGUF tensor {gguf_name!r}: {flat.numel()} bytes do not split into {experts} experts")
    per = flat.numel() // experts
    for e, name in enumerate(hf_names(gguf_name, config, experts)):
        yield name, QuantizedWeight.from_blocks(f"{gguf_name}[{e}]", kind, flat[e * per:(e + 1) * per],
                                                (rows, cols))
