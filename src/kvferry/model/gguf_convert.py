"""Convert a llama.cpp ``.gguf`` file into a plain HF folder, once, into a cache.

The output folder (config.json, model.safetensors in float32,
tokenizer.json, tokenizer_config.json with the chat template,
generation_config.json) is then loaded like any HF checkpoint. It lives in
``$KVFERRY_CACHE_DIR`` (default ``~/.cache/kvferry``) under a name keyed by
the GGUF's name, size and mtime, and is written into a temporary folder and
renamed into place, so concurrent starts never see a half-written folder.

Supported: ``general.architecture`` llama (also Mistral, and Mixtral: llama
with ``expert_count``), qwen2, qwen3, qwen2moe, qwen3moe (expert tensors
``ffn_{gate,up,down}_exps`` [E, ...] are split into HF's per-expert names;
moe_convert.py);
``tokenizer.ggml.model`` "gpt2" (byte-level BPE); every tensor type the
installed ``gguf`` package dequantizes (``supported_tensor_types()``; with
gguf 0.19: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, the IQ*
types, TQ1_0, TQ2_0, MXFP4, NVFP4). Quantized tensors are dequantized once,
at conversion, to float32 (one log line per file names the types); the
loader then casts to the serving dtype. This is ``--quantization none``;
by default a GGUF's linear weights are served in their blocks
(gguf_weights.py) and only config and tokenizer are written here
(``weights=False``).
A file holding any other type (Q8_1, Q8_K, I8..I64, F64) is refused before
conversion, by type name.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvferry import envs
from kvferry.model import moe_convert
# Re-exported: the embedded model is found in resolve, which the front end imports without torch.
from kvferry.model.resolve import EMBEDDED_FILE, converted_gguf_folder, embedded_gguf_path  # noqa: F401

logger = logging.getLogger(__name__)

_ARCH = {  # general.architecture -> (HF architecture, model_type)
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}

# GGUF per-layer tensor name -> HF name within model.layers.N
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizer split patterns of the HF tokenizers llama.cpp knows by name.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


def cache_dir() -> Path:
    return envs.cache_dir()


def convert_gguf(gguf_path: str | Path, out_root: Path | None = None, weights: bool = True) -> Path:
    """Return the HF folder for ``gguf_path``, converting it on first use.
    ``weights=False``: config and tokenizer only (the GGUF's blocks are
    served from the file itself, gguf_weights.py), no expanded copy."""
    src = Path(gguf_path).expanduser().resolve()
    if not src.is_file():
        raise ValueError(f"GGUF file not found: {gguf_path}")
    root = out_root or cache_dir()
    final = converted_gguf_folder(src, root, weights)
    if (final / "config.json").is_file():
        logger.info("GGUF %s: using its converted folder %s", src.name, final)
        return final
    root.mkdir(parents=True, exist_ok=True)
    what = "the embedded SmolLM2-135M GGUF" if src.name == EMBEDDED_FILE else f"the GGUF {src.name}"
    if weights:
        # The estimate: ~15 s per 100 MB of GGUF on a slow 2-core CPU (the embedded 98 MB file: 14 s).
        logger.info("converting %s to an HF folder in %s, once, ~%d s", what, final,
                    max(5, round(src.stat().st_size / 100e6 * 15)))
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=root))
    try:
        write_hf_folder(src, tmp, weights)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s%s in %.0f s; later starts load %s", what, "" if weights else "'s config and tokenizer",
                time.perf_counter() - t0, final)
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Rename into place; if another process got there first, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():
            raise


def write_hf_folder(src: Path, out: Path, weights: bool = True) -> None:
    """config, tokenizer and (``weights``) the float weights of ``src`` into ``out``."""
    from safetensors.torch import save_file

    from kvferry.model.gguf_weights import open_gguf

    reader = open_gguf(src)
    types = check_tensor_types(reader, src.name)
    quantized = {name: n for name, n in types.items() if name not in _FLOAT_TYPES}
    if quantized and weights:
        logger.info("GGUF %s: dequantizing %d tensors of types %s to float32 (converted once; served in the "
                    "dtype chosen at load)", src.name, sum(quantized.values()), ", ".join(sorted(quantized)))
    meta = _metadata(reader)
    config = hf_config(meta, {t.name for t in reader.tensors})
    if weights:
        tensors = dict(hf_tensors(reader, config, meta["general.architecture"]))
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(meta))
    write_tokenizer(meta, out)


# ---- tensor types ----

# Stored as plain floats: converted, not dequantized.
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


@functools.lru_cache(maxsize=1)
def supported_tensor_types() -> tuple[str, ...]:
    """GGML tensor type names this converter reads: those the installed
    ``gguf`` package can dequantize. Probed (one zero block per type)
    rather than listed, so that a newer gguf release's types work without
    a change here and an older one's gaps are refused by name."""
    import gguf

    names = []
    for qtype in gguf.GGMLQuantizationType:
        sizes = gguf.GGML_QUANT_SIZES.get(qtype)
        if sizes is None:
            continue
        try:
            gguf.quants.dequantize(np.zeros((1, sizes[1]), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError):
            continue
        names.append(qtype.name)
    return tuple(names)


def check_tensor_types(reader: Any, file_name: str) -> Counter[str]:
    """Count of tensors per type; ValueError naming any type not supported."""
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    supported = supported_tensor_types()
    bad = sorted(set(counts) - set(supported))
    if bad:
        examples = [t.name for t in reader.tensors if t.tensor_type.name in bad][:3]
        raise ValueError(f"GGUF {file_name}: tensor type {', '.join(bad)} is not supported (e.g. tensor "
                         f"{', '.join(examples)}); supported types: {', '.join(supported)}")
    return counts


# ---- metadata and config ----

def _metadata(reader: Any) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, np.generic):
            value = value.item()
        meta[key] = value
    return meta


def hf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in _ARCH:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCH)})")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF with rope_freqs (Llama 3.1 rope scaling) is not supported; use the HF folder")
    p = f"{arch}."
    heads = int(meta[p + "attention.head_count"])
    hidden = int(meta[p + "embedding_length"])
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return moe_convert.with_moe_fields(meta, tensor_names, {
        "architectures": [_ARCH[arch][0]],
        "model_type": _ARCH[arch][1],
        "vocab_size": int(meta.get(p + "vocab_size") or len(tokens)),
        "hidden_size": hidden,
        # A MoE file may state only its experts' width.
        "intermediate_size": int(meta.get(p + "feed_forward_length") or meta[p + "expert_feed_forward_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", heads)),
        "head_dim": int(meta.get(p + "attention.key_length") or hidden // heads),
        "rms_norm_eps": float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(p + "context_length", 2048)),
        # llama.cpp drops output.weight when it equals the embedding
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    })


def _generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """Stop on eos and, where stated, end-of-turn / end-of-message (Llama 3's <|eot_id|>)."""
    stops = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(i for i in stops if isinstance(i, int)))
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": stops[0] if len(stops) == 1 else stops,
    }


# ---- tensors ----

def hf_tensors(reader: Any, config: dict[str, Any], arch: str):  # noqa: ANN201 - iterator of (name, tensor)
    """(HF name, float32 tensor) for every GGUF tensor, with Q/K unpermuted."""
    for t in reader.tensors:
        if moe_convert.is_moe_tensor(t.name):  # experts stacked in one tensor, the router, the shared expert
            yield from moe_convert.hf_tensors(t.name, float_tensor(t.name, t.data, t.tensor_type, t.shape, config,
                                                                   arch), config)
            continue
        yield hf_name(t.name), float_tensor(t.name, t.data, t.tensor_type, t.shape, config, arch)


def float_tensor(gguf_name: str, data: np.ndarray, tensor_type: Any, gguf_shape: Any, config: dict[str, Any],
                 arch: str) -> torch.Tensor:
    """One GGUF tensor's ``data`` (as the reader lays it out) dequantized to
    float32 in HF layout, Q/K unpermuted."""
    import gguf

    name = gguf_name if moe_convert.is_moe_tensor(gguf_name) else hf_name(gguf_name)
    # GGUF shapes list the fastest axis first; numpy wants it last.
    shape = [int(d) for d in reversed(gguf_shape)]
    array = gguf.quants.dequantize(data, tensor_type).reshape(shape)
    # F32/F16 data comes back as a read-only view of the memory-mapped file: copy.
    tensor = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
    heads = qk_heads(name, config, arch)
    return tensor if heads is None else unpermute_qk(tensor, heads)


def qk_heads(hf_tensor_name: str, config: dict[str, Any], arch: str) -> int | None:
    """The head count to unpermute a llama Q or K tensor's rows by (llama.cpp
    interleaves them), None for every other tensor. ``arch``: the GGUF's, or the
    model_type (Mixtral's file is a llama's)."""
    llama = arch in ("llama", "mixtral")
    if llama and hf_tensor_name.endswith(("q_proj.weight", "q_proj.bias")):
        return config["num_attention_heads"]
    if llama and hf_tensor_name.endswith(("k_proj.weight", "k_proj.bias")):
        return config["num_key_value_heads"]
    return None


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation: HF's rotate-half layout
    (first half / second half of each head) -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of ``permute_qk``: back to HF row order, per head."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- tokenizer ----

def write_tokenizer(meta: dict[str, Any], out: Path) -> None:
    """tokenizer.json + tokenizer_config.json from tokenizer.ggml.* metadata."""
    tok = build_tokenizer(meta)
    tok.save(str(out / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = meta.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    _write_json(out / "tokenizer_config.json", cfg)


def build_tokenizer(meta: dict[str, Any]):  # noqa: ANN201 - tokenizers.Tokenizer
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2')")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    pre = meta.get("tokenizer.ggml.pre", "default")
    # Llama 3's HF tokenizer looks whole words up in the vocab before merging.
    ignore_merges = pre in ("llama-bpe", "llama3")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges))
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    tok.pre_tokenizer = _pre_tokenizer(pre, bool(meta.get("tokenizer.ggml.add_space_prefix", False)))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, tokens)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _TOKEN_CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED])
    return tok


def _pre_tokenizer(pre: str, add_prefix_space: bool):  # noqa: ANN202
    """The HF pre-tokenizer llama.cpp's ``tokenizer.ggml.pre`` name stands for.
    Unknown names fall back to GPT-2's byte-level regex."""
    from tokenizers import Regex, pre_tokenizers

    if pre == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    patterns = {"llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}
    if pre in patterns:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(patterns[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)


def _post_processor(meta: dict[str, Any], tokens: list[str]):  # noqa: ANN202
    """Prepend BOS on encode(add_special_tokens=True) only when the GGUF says so."""
    from tokenizers import processors

    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and isinstance(bos, int):
        name = tokens[bos]
        return processors.TemplateProcessing(single=f"{name} $A", pair=f"{name} $A {name} $B",
                                             special_tokens=[(name, bos)])
    return processors.ByteLevel(trim_offsets=False)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
