"""A random-weight Qwen3-MoE GGUF of any shape, written as llama.cpp lays one
out, tensor by tensor (nothing whole in memory: bench/moe_quant.py writes a
17 GB 30B-A3B-shaped file with it).

Every matrix is random blocks of ``qtype`` (Q4_0, Q8_0 or Q4_K) with block
scales that make weights of about 0.02 (a trained model's size); the norms
are ones and the routers float32 (random, so the routing is about uniform).
The tokenizer is tests/tiny_models.py's; ``vocab`` rows may exceed it.

    from tests.moe_gguf_writer import MoeShape, write_random_moe_gguf
    write_random_moe_gguf(path, MoeShape(layers=2, experts=16, top_k=4, hidden=1024, moe_inter=1024))
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from tests.tiny_models import _gguf_hparams, _gguf_tokenizer, write_tokenizer

# Where a block keeps its fp16 scales (offset, lo, hi): Q4_0's and Q8_0's d; Q4_K's d and dmin.
_SCALES = {"Q4_0": ((0, 3e-3, 6e-3),), "Q8_0": ((0, 2e-4, 4e-4),), "Q4_K": ((0, 1e-5, 1e-4), (2, 1e-5, 1e-4))}
_POOL_BLOCKS = 1 << 21  # random blocks drawn once, then cut from at a random offset per tensor


@dataclass(frozen=True, slots=True)
class MoeShape:
    layers: int
    experts: int
    top_k: int
    hidden: int
    moe_inter: int
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 384  # the tiny tokenizer's size; more rows are unused ids

    def expert_bytes(self, qtype: str) -> int:
        """Bytes of all the experts' blocks."""
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
        return self.layers * self.experts * 3 * self.moe_inter * self.hidden // block * size

    def active_expert_bytes(self, qtype: str, experts: int | None = None) -> int:
        """Bytes of ``experts`` (default top_k) experts of every layer: one token's read."""
        return self.expert_bytes(qtype) // self.experts * (experts or self.top_k)


class _Blocks:
    """Random blocks of one type, cut from one pool."""

    def __init__(self, qtype: str, seed: int) -> None:
        self.kind = gguf.GGMLQuantizationType[qtype]
        self.block, self.size = gguf.GGML_QUANT_SIZES[self.kind]
        self.rng = np.random.default_rng(seed)
        pool = self.rng.integers(0, 256, (_POOL_BLOCKS, self.size), dtype=np.uint8)
        for off, lo, hi in _SCALES[qtype]:
            # Signed: the blocks' integers have a nonzero mean (Q4_0's q - 8 averages -0.5), and
            # scales of one sign would give every matrix a common-mode row sum, every token the
            # same hidden direction, and so the same experts (8-9 of 128 at batch 16, measured).
            scale = self.rng.uniform(lo, hi, _POOL_BLOCKS) * self.rng.choice([-1.0, 1.0], _POOL_BLOCKS)
            pool[:, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
        self.pool = pool

    def matrix(self, *shape: int) -> np.ndarray:
        """uint8 [*shape[:-1], bytes per row] for a float shape ``shape``."""
        n = int(np.prod(shape)) // self.block
        start = int(self.rng.integers(0, _POOL_BLOCKS))
        idx = (np.arange(n, dtype=np.int64) + start) % _POOL_BLOCKS
        return self.pool[idx].reshape(*shape[:-1], shape[-1] // self.block * self.size)


def _tensors(s: MoeShape, blocks: _Blocks, rng: np.random.Generator):  # noqa: ANN202 - (name, array, raw?)
    """(name, array, quantized?) in file order; each array is made as it is reached."""
    ones = lambda n: (lambda: np.ones(n, dtype=np.float32))  # noqa: E731
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    yield "token_embd.weight", lambda: blocks.matrix(s.vocab, s.hidden), True
    for i in range(s.layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", ones(s.hidden), False
        yield p + "attn_q.weight", lambda: blocks.matrix(q, s.hidden), True
        yield p + "attn_k.weight", lambda: blocks.matrix(kv, s.hidden), True
        yield p + "attn_v.weight", lambda: blocks.matrix(kv, s.hidden), True
        yield p + "attn_output.weight", lambda: blocks.matrix(s.hidden, q), True
        yield p + "attn_q_norm.weight", ones(s.head_dim), False
        yield p + "attn_k_norm.weight", ones(s.head_dim), False
        yield p + "ffn_norm.weight", ones(s.hidden), False
        yield p + "ffn_gate_inp.weight", lambda: (rng.standard_normal((s.experts, s.hidden), dtype=np.float32)
                                                   * 0.02), False
        yield p + "ffn_gate_exps.weight", lambda: blocks.matrix(s.experts, s.moe_inter, s.hidden), True
        yield p + "ffn_up_exps.weight", lambda: blocks.matrix(s.experts, s.moe_inter, s.hidden), True
        yield p + "ffn_down_exps.weight", lambda: blocks.matrix(s.experts, s.hidden, s.moe_inter), True
    yield "output_norm.weight", ones(s.hidden), False
    yield "output.weight", lambda: blocks.matrix(s.vocab, s.hidden), True


def _shape_of(name: str, s: MoeShape) -> tuple[int, ...]:
    """The float shape (slowest axis first) of tensor ``name``."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    leaf = name.split(".")[-2]
    return {"token_embd": (s.vocab, s.hidden), "output": (s.vocab, s.hidden), "attn_norm": (s.hidden,),
            "ffn_norm": (s.hidden,), "output_norm": (s.hidden,), "attn_q": (q, s.hidden), "attn_k": (kv, s.hidden),
            "attn_v": (kv, s.hidden), "attn_output": (s.hidden, q), "attn_q_norm": (s.head_dim,),
            "attn_k_norm": (s.head_dim,), "ffn_gate_inp": (s.experts, s.hidden),
            "ffn_gate_exps": (s.experts, s.moe_inter, s.hidden), "ffn_up_exps": (s.experts, s.moe_inter, s.hidden),
            "ffn_down_exps": (s.experts, s.hidden, s.moe_inter)}[leaf]


def write_random_moe_gguf(out: str | Path, s: MoeShape, qtype: str = "Q4_0", seed: int = 0) -> Path:
    """Write the file (qwen3moe) to ``out``; returns its path."""
    blocks = _Blocks(qtype, seed)
    rng = np.random.default_rng(seed + 1)
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    with tempfile.TemporaryDirectory() as tok:
        write_tokenizer(Path(tok))
        _gguf_hparams(w, dict(num_hidden_layers=s.layers, max_position_embeddings=4096, hidden_size=s.hidden,
                              intermediate_size=s.moe_inter, num_attention_heads=s.heads,
                              num_key_value_heads=s.kv_heads, head_dim=s.head_dim, rms_norm_eps=1e-6,
                              vocab_size=s.vocab, rope_theta=1000000.0))
        _gguf_tokenizer(w, Path(tok), "default")
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_expert_feed_forward_length(s.moe_inter)
    w.add_expert_weights_norm(True)
    for name, _, quantized in _tensors(s, blocks, rng):
        shape = _shape_of(name, s)
        if quantized:
            nbytes = int(np.prod(shape)) // blocks.block * blocks.size
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // blocks.block * blocks.size), np.dtype(np.uint8),
                              nbytes, raw_dtype=blocks.kind)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, make, _ in _tensors(s, blocks, rng):
        w.write_tensor_data(make())
    w.close()
    return Path(out)
