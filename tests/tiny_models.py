"""Tiny random-weight HF checkpoints for tests (no downloads).

    from tests.tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path, arch="qwen3", num_hidden_layers=3)

The folder holds config.json, model.safetensors (or shards), and a byte-level
BPE tokenizer.json trained in-process, with ChatML special tokens
``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2 (as SmolLM2)
and a ChatML chat template in tokenizer_config.json. The model's vocab_size is
the tokenizer's size unless overridden.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

ARCHES = ("llama", "qwen2", "qwen3", "mistral", "llama3_rope")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text: English plus multi-byte scripts so that some merged tokens
# hold partial UTF-8 characters (the detokenizer tests need that).
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "Hello world! How are you today? I am fine, thank you. Numbers: 0 1 2 3 42 1234.",
    "def main():\n    print('hello')\n    return 0\n",
    "日本語のテキストです。東京は日本の首都です。中文文本，北京是中国的首都。",
    "Emoji test: 😀😃😄 🚀🌍 ❤️ 👍🏽 café naïve résumé Ünïcödé Привет мир",
    "the cat sat on the mat; the dog sat on the log; they are friends and they play",
] * 20

BASE_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    # Larger than HF's 0.02 so logits differ visibly between tokens and a
    # wrong attention/RoPE detail shows up beyond the comparison tolerance.
    initializer_range=0.1,
)


@functools.lru_cache(maxsize=4)
def tokenizer_json(vocab_size: int = 384) -> str:
    """A byte-level BPE tokenizer.json (string), trained once per process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return tok.to_str()


def write_tokenizer(path: Path, vocab_size: int = 384, chat_template: str | None = CHATML_TEMPLATE) -> int:
    """Write tokenizer.json + tokenizer_config.json into ``path``; returns the vocab size."""
    from tokenizers import Tokenizer

    text = tokenizer_json(vocab_size)
    (path / "tokenizer.json").write_text(text)
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 256,
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return Tokenizer.from_str(text).get_vocab_size()


def hf_config(arch: str, vocab_size: int, **overrides: Any):  # noqa: ANN201 - a transformers config
    """The transformers config object for one of ARCHES."""
    import transformers as tf

    kw = {**BASE_CONFIG, "vocab_size": vocab_size}
    if arch == "llama":
        kw["tie_word_embeddings"] = False
        cls = tf.LlamaConfig
    elif arch == "llama3_rope":
        kw["tie_word_embeddings"] = True
        # original_max_position_embeddings small so that scaling bends the
        # frequencies within the test's positions
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        kw["rope_theta"] = 500000.0
        cls = tf.LlamaConfig
    elif arch == "mistral":
        kw["tie_word_embeddings"] = False
        kw["sliding_window"] = None
        cls = tf.MistralConfig
    elif arch == "qwen2":
        kw["tie_word_embeddings"] = True
        kw["rope_theta"] = 1000000.0
        cls = tf.Qwen2Config
    elif arch == "qwen3":
        kw["tie_word_embeddings"] = False
        kw["head_dim"] = 32  # != hidden / heads = 16
        cls = tf.Qwen3Config
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHES}")
    kw.update(overrides)
    return cls(**kw)


def make_tiny_checkpoint(
    tmp_path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    name: str | None = None,
    **overrides: Any,
) -> Path:
    """Save a random float32 HF model + tokenizer into ``tmp_path/name``; return the folder.

    ``overrides`` go into the transformers config (e.g. num_hidden_layers=3,
    tie_word_embeddings=True). ``max_shard_size`` (e.g. "20KB") saves shards
    with a model.safetensors.index.json.
    """
    import transformers as tf

    path = Path(tmp_path) / (name or f"tiny-{arch}")
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path, overrides.pop("tokenizer_vocab_size", 384))
    overrides.setdefault("vocab_size", vocab)
    config = hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return path


def load_hf_model(path: str | Path):  # noqa: ANN201 - a transformers model
    """The reference transformers model for a tiny checkpoint (float32, eval)."""
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def write_tiny_gguf(hf_folder: str | Path, out_file: str | Path, pre: str = "default", qtype: str | None = None,
                    quantize_vocab: bool = False) -> Path:
    """Write ``hf_folder`` (a tiny checkpoint) as a llama.cpp-style GGUF:
    F32 tensors (``qtype``, e.g. "Q8_0": the linear weights in that type, and
    with ``quantize_vocab`` the token embedding and lm_head too),
    GGUF names, Q/K rows permuted for the llama architecture as
    convert_hf_to_gguf.py does, and byte-level BPE tokenizer metadata."""
    import gguf
    from safetensors.torch import load_file

    from kvferry.model.gguf_convert import permute_qk

    folder = Path(hf_folder)
    cfg = json.loads((folder / "config.json").read_text())
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[cfg["model_type"]]
    w = gguf.GGUFWriter(str(out_file), arch)
    _gguf_hparams(w, cfg)
    _gguf_tokenizer(w, folder, pre)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    for name, t in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if arch == "llama" and ".q_proj." in name:
            t = permute_qk(t, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            t = permute_qk(t, cfg["num_key_value_heads"])
        vocab = quantize_vocab and name in ("model.embed_tokens.weight", "lm_head.weight")
        if qtype is not None and (name.endswith("_proj.weight") or vocab):
            kind = gguf.GGMLQuantizationType[qtype]
            blocks = gguf.quants.quantize(t.float().numpy(), kind)
            w.add_tensor(_gguf_name(name), blocks, raw_shape=blocks.shape, raw_dtype=kind)
            continue
        w.add_tensor(_gguf_name(name), t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out_file)


def _gguf_hparams(w: Any, cfg: dict[str, Any]) -> None:
    rope = cfg.get("rope_parameters") or {}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])


def _gguf_tokenizer(w: Any, folder: Path, pre: str) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])


def _gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".")  # model.layers.N.<module>.<proj>.<weight|bias> or model.layers.N.<norm>.weight
    layer, module = parts[2], ".".join(parts[3:-1])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    return f"blk.{layer}.{names[module]}.{parts[-1]}"


def make_random_head(checkpoint: str, out_dir: Path) -> str:
    """A seeded random-weight draft head for ``checkpoint`` (MLP width 64):
    enough to exercise drafting, rarely accepted."""
    from kvferry.model.loader import load_model
    from kvferry.spec.head import EagleHead

    hidden = load_model(checkpoint, dtype="float32").config.hidden_size
    torch.manual_seed(0)
    path = Path(out_dir) / "head.safetensors"
    EagleHead(hidden, 64).save(path, target="random")
    return str(path)
