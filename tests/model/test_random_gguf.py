"""bench/make_random_gguf.py writes what the benches serve: a Llama-shaped
GGUF, streamed one tensor at a time, in llama.cpp's Q4_K_M mix or all Q8_0,
with the tokenizer padded to the asked vocabulary. kvferry's checked reader
accepts it (block sizes, no truncation), each tensor has the type and shape
llama-quantize would give it, and the blocks decode to finite, small values
(sane scales, no -128 in Q8_0, which llama.cpp's quantizer never writes).
A tiny shape: the 8B file is the same code with bigger numbers."""
from __future__ import annotations

import numpy as np
from gguf.quants import dequantize

from bench.make_random_gguf import more_bits, write
from kvferry.model.gguf_weights import open_gguf

SHAPE = {"layers": 3, "hidden": 256, "ffn": 512, "heads": 4, "kv_heads": 2}
VOCAB = 49152 + 256  # the tokenizer's 49152, padded


def test_random_gguf_mixes(tmp_path):
    for mix in ("Q4_K_M", "Q8_0"):
        path = write(tmp_path / f"{mix}.gguf", mix, vocab=VOCAB, **SHAPE)
        r = open_gguf(path)
        types = {t.name: t.tensor_type.name for t in r.tensors}
        shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
        assert len(r.fields["tokenizer.ggml.tokens"].data) == VOCAB
        assert shapes["token_embd.weight"] == (256, VOCAB) and shapes["blk.0.ffn_down.weight"] == (512, 256)
        assert shapes["blk.1.attn_k.weight"] == (256, 2 * 64)
        assert len(types) == 2 + 9 * SHAPE["layers"] + 1
        for i in range(SHAPE["layers"]):
            hi = "Q6_K" if mix == "Q4_K_M" and more_bits(i, SHAPE["layers"]) else None
            base = "Q4_K" if mix == "Q4_K_M" else "Q8_0"
            assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == (hi or base)
            assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == base
            assert types[f"blk.{i}.attn_norm.weight"] == "F32"
        assert types["output.weight"] == ("Q6_K" if mix == "Q4_K_M" else "Q8_0")
        for t in r.tensors:
            if t.name.startswith("blk.") and t.tensor_type.name != "F32":  # the vocabulary's are the same code, bigger
                w = dequantize(np.asarray(t.data), t.tensor_type)
                assert np.isfinite(w).all() and np.abs(w).max() < 64, t.name  # Q6_K: 1e-2 x 127 x 32 at most
        if mix == "Q8_0":
            q = np.asarray(next(t for t in r.tensors if t.name == "blk.0.attn_q.weight").data).reshape(-1, 34)[:, 2:]
            assert (q != 0x80).all()
