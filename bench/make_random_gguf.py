"""A Llama-shaped GGUF file with random weights, for timing (its outputs are
noise): llama.cpp's Q4_K_M mix or all Q8_0, every block random bytes with
sane fp16 scales, norms of ones, and the embedded SmolLM2 file's tokenizer
(vocabulary 49152; ``--vocab`` pads it with plain tokens that no merge makes,
for Llama 3's 128256).

The Q4_K_M mix as llama-quantize writes it: Q4_K everywhere but attn_v and
ffn_down in Q6_K on the layers llama.cpp gives more bits (the first and last
eighth, and every third between), and output.weight in Q6_K. Q8_0: every
matrix in Q8_0, as ``llama-quantize ... Q8_0`` writes it.

    python bench/make_random_gguf.py OUT.gguf [--preset 1b|8b] [--mix Q4_K_M|Q8_0]
        [--layers 16 --hidden 2048 --ffn 8192 --heads 32 --kv-heads 8 --vocab 0]

``--preset 1b`` (the default) is Llama-3.2-1B's shape but for the vocabulary
(Q4_K_M 0.8 GB, Q8_0 1.4 GB); ``--preset 8b`` is Llama-3-8B's, vocabulary
included (Q4_K_M 4.6 GiB, Q8_0 8.0 GiB). The file is written one tensor at a
time (the header first, then each tensor's blocks as they are drawn), so
memory stays at the largest tensor (0.4 GB for the 8B lm_head) whatever the
file's size.
"""
from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import numpy as np

PRESETS = {  # Llama-3.2-1B and Llama-3-8B (vocab 0: the tokenizer's own 49152)
    "1b": {"layers": 16, "hidden": 2048, "ffn": 8192, "heads": 32, "kv_heads": 8, "vocab": 0},
    "8b": {"layers": 32, "hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256},
}
# (block values, block bytes, byte offsets of the fp16 scales), as ggml lays the blocks out
_BLOCKS = {"Q8_0": (32, 34, (0,)), "Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,))}
FILE_TYPE = {"Q4_K_M": 15, "Q8_0": 7}  # llama_ftype


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layers)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes_per_row] of ``kind`` blocks: random bytes (every bit
    pattern of the small integers and packed 6-bit scales is a valid block)
    with fp16 scales in [1e-3, 1e-2]. Q8_0's quants avoid -128, which
    llama.cpp's quantizer never writes."""
    values, nbytes, scale_offsets = _BLOCKS[kind]
    nblocks = rows * cols // values
    raw = np.frombuffer(rng.bytes(nblocks * nbytes), np.uint8).reshape(nblocks, nbytes).copy()
    if kind == "Q8_0":
        raw[raw == 0x80] = 0x81
    for off in scale_offsets:
        raw[:, off:off + 2] = rng.uniform(1e-3, 1e-2, nblocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def tensor_plan(mix: str, layers: int, hidden: int, ffn: int, kv: int, vocab: int) -> list[tuple[str, str, int, int]]:
    """(name, type, rows, cols) of every tensor in file order; type "F32" for the norms (cols 0)."""
    def q(hi: bool) -> str:
        return "Q8_0" if mix == "Q8_0" else ("Q6_K" if hi else "Q4_K")

    plan = [("token_embd.weight", q(False), vocab, hidden)]
    for i in range(layers):
        hi = more_bits(i, layers)
        plan += [(f"blk.{i}.attn_norm.weight", "F32", hidden, 0), (f"blk.{i}.ffn_norm.weight", "F32", hidden, 0),
                 (f"blk.{i}.attn_q.weight", q(False), hidden, hidden), (f"blk.{i}.attn_k.weight", q(False), kv, hidden),
                 (f"blk.{i}.attn_v.weight", q(hi), kv, hidden),
                 (f"blk.{i}.attn_output.weight", q(False), hidden, hidden),
                 (f"blk.{i}.ffn_gate.weight", q(False), ffn, hidden), (f"blk.{i}.ffn_up.weight", q(False), ffn, hidden),
                 (f"blk.{i}.ffn_down.weight", q(hi), hidden, ffn)]
    plan += [("output_norm.weight", "F32", hidden, 0), ("output.weight", q(True), vocab, hidden)]
    return plan


@functools.lru_cache(maxsize=1)
def _tokenizer_source():  # noqa: ANN202 - gguf.GGUFReader
    """The embedded file's reader, for its tokenizer (parsing it takes 5-20 s: once a process)."""
    import gguf

    from kvferry.model.gguf_convert import embedded_gguf_path

    return gguf.GGUFReader(str(embedded_gguf_path()))


def write(out: Path, mix: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
          vocab: int = 0, seed: int = 0) -> Path:
    """Write the file (see the module's docstring); its path."""
    import gguf

    if mix not in FILE_TYPE:
        raise ValueError(f"mix must be one of {sorted(FILE_TYPE)}, not {mix!r}")
    src = _tokenizer_source()
    tokens = [bytes(src.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in src.fields["tokenizer.ggml.tokens"].data]
    types = list(src.fields["tokenizer.ggml.token_type"].contents())
    vocab = vocab or len(tokens)
    if vocab < len(tokens):
        raise ValueError(f"--vocab {vocab} is below the tokenizer's {len(tokens)}")
    # padding: plain (type 1) tokens no merge produces, so neither tokenizer ever emits them from text
    tokens += [f"<|reserved_{i}|>" for i in range(vocab - len(tokens))]
    types += [1] * (vocab - len(types))
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(FILE_TYPE[mix])
    for name, field in src.fields.items():
        if name == "tokenizer.ggml.tokens":
            w.add_token_list(tokens)
        elif name == "tokenizer.ggml.token_type":
            w.add_token_types(types)
        elif name.startswith("tokenizer."):
            vtype = field.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_array(name, field.contents())
            else:
                w.add_key_value(name, field.contents(), vtype)
    plan = tensor_plan(mix, layers, hidden, ffn, kv_heads * head_dim, vocab)
    Q = gguf.GGMLQuantizationType
    for name, kind, rows, cols in plan:
        if kind == "F32":
            w.add_tensor_info(name, (rows,), np.dtype(np.float32), rows * 4)
        else:
            values, nbytes, _ = _BLOCKS[kind]
            shape = (rows, cols // values * nbytes)
            w.add_tensor_info(name, shape, np.dtype(np.uint8), rows * shape[1], raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, kind, rows, cols in plan:  # the order add_tensor_info was given
        w.write_tensor_data(np.ones(rows, np.float32) if kind == "F32" else random_blocks(kind, rows, cols, rng))
    w.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="1b", help="the shape; the flags below override it")
    ap.add_argument("--mix", choices=sorted(FILE_TYPE), default="Q4_K_M")
    for flag in ("layers", "hidden", "ffn", "heads", "kv-heads", "vocab"):
        ap.add_argument(f"--{flag}", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shape = dict(PRESETS[args.preset])
    shape.update({k: v for k, v in vars(args).items() if k in shape and v is not None})
    start = time.monotonic()
    write(args.out, args.mix, seed=args.seed, **shape)
    print(f"{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB ({args.preset} {args.mix}, {shape}) "
          f"in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
