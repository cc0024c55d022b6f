"""A Llama-shaped GGUF file with random weights in llama.cpp's Q4_K_M mix,
for timing (its outputs are noise): every block random bytes with sane fp16
super-scales (tests/model/quant/blocks.py), norms of ones, and the embedded
SmolLM2 file's tokenizer (vocabulary 49152).

The Q4_K_M mix as llama-quantize writes it: Q4_K everywhere but attn_v and
ffn_down in Q6_K on the layers llama.cpp gives more bits (the first and last
eighth, and every third between), and output.weight in Q6_K.

    python bench/make_random_gguf.py OUT.gguf [--layers 16 --hidden 2048 --ffn 8192 --heads 32 --kv-heads 8]

The defaults are Llama-3.2-1B's shape but for the vocabulary (0.8 GB).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.model.quant.blocks
from tests.model.quant.blocks import random_blocks  # noqa: E402


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layers)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def main() -> None:
    import gguf

    from kvferry.model.gguf_convert import embedded_gguf_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    src = gguf.GGUFReader(str(embedded_gguf_path()))
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    head_dim = args.hidden // args.heads
    w = gguf.GGUFWriter(str(args.out), "llama")
    w.add_block_count(args.layers)
    w.add_context_length(8192)
    w.add_embedding_length(args.hidden)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    for name, field in src.fields.items():
        if name.startswith("tokenizer."):
            value = field.contents()
            vtype = field.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_array(name, value)
            else:
                w.add_key_value(name, value, vtype)
    rng = np.random.default_rng(args.seed)
    Q = gguf.GGMLQuantizationType

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        blocks = random_blocks(kind, rows, cols, rng)
        w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=Q[kind])

    add("token_embd.weight", "Q4_K", vocab, args.hidden)
    kv = args.kv_heads * head_dim
    for i in range(args.layers):
        hi = "Q6_K" if more_bits(i, args.layers) else "Q4_K"
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(args.hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(args.hidden, np.float32))
        add(f"blk.{i}.attn_q.weight", "Q4_K", args.hidden, args.hidden)
        add(f"blk.{i}.attn_k.weight", "Q4_K", kv, args.hidden)
        add(f"blk.{i}.attn_v.weight", hi, kv, args.hidden)
        add(f"blk.{i}.attn_output.weight", "Q4_K", args.hidden, args.hidden)
        add(f"blk.{i}.ffn_gate.weight", "Q4_K", args.ffn, args.hidden)
        add(f"blk.{i}.ffn_up.weight", "Q4_K", args.ffn, args.hidden)
        add(f"blk.{i}.ffn_down.weight", hi, args.hidden, args.ffn)
    w.add_tensor("output_norm.weight", np.ones(args.hidden, np.float32))
    add("output.weight", "Q6_K", vocab, args.hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
