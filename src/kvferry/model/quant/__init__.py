"""Linear weights kept in their GGUF blocks, multiplied by our own kernels.

A GGUF file stores each weight row as blocks: 32 values (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0) or 256-value superblocks of 16- or 32-value sub-blocks (the
K-quants Q2_K..Q6_K), each with fp16 scales and small integers (layouts in
formats.py). ``QuantizedWeight`` holds those bytes as they are, a uint8
tensor [out_features, bytes_per_row]: the memory of the file, no float copy.

Decode (M up to ~32 rows, ``gemv``): CPU decoding is bound by reading the
weights, so each block is read once and decoded in registers into unsigned
integers. The activations are quantized to int8 once per row per call (per
32 values with a scale, or per 256 with per-16 sums for the K-quants, as
llama.cpp's Q8_0 / Q8_K): then each 32-value group is a single u8 x s8 dot
(AVX512-VNNI / AVX-VNNI vpdpbusd, else AVX2 vpmaddubsw), the scales are
applied per block in float, and the constant offsets and mins are folded in
from the activations' block sums. Quantizing x costs O(M*K) once, against
O(M*N*K) multiplies that then run on 8-bit integers at four times the
float lanes; its error is that of 8-bit rounding of x per block (below
0.4% of the block's largest value per element), well under the weights' own.

The token embedding (``embedding``) gathers the looked-up rows' blocks and
dequantizes only those; a tied lm_head multiplies by the same blocks.

Prefill (``prefill``): tiles of weight rows (``PREFILL_TILE_BYTES`` of bf16,
``SMALL_TILE_BYTES`` for a few rows) are dequantized into one buffer per
thread, kept between calls, and multiplied by oneDNN (AMX where present): no
float copy of the weight persists. ``linear`` picks the path by M
(``PREFILL_MIN_ROWS``, measured; ``path_for`` says which).
"""
from kvferry.model.quant.formats import FORMATS, BlockFormat, QuantizedWeight, block_format, stack_rows
from kvferry.model.quant.kernels import (available, dequantize_rows, embedding, gemv, kernel_path, linear,
                                         linear_parts, path_for, prefill)

__all__ = ["FORMATS", "BlockFormat", "QuantizedWeight", "block_format", "available", "dequantize_rows", "embedding",
           "gemv", "kernel_path", "linear", "linear_parts", "path_for", "prefill", "stack_rows"]
