"""Random weights in each GGUF block type, and the references the kernels are checked against."""
from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf.quants import dequantize, quantize

from kvferry.model.quant import QuantizedWeight, block_format

# Where each K-quant keeps its fp16 super-scales (d, dmin): random bytes there
# could be inf/NaN or 1e4, so they get sane small positive values instead.
_K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, bytes_per_row]: gguf's own quantizer where it has one (the
    32-blocks), else random bytes (every bit pattern of the small integers and
    packed scales is a valid block) with fp16 super-scales in [1e-3, 1e-2]."""
    fmt = block_format(name)
    if fmt.block == 32:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType[name])
    raw = rng.integers(0, 256, (n, k // fmt.block, fmt.bytes), dtype=np.uint8)
    for off in _K_SCALE_OFFSETS[name]:
        scales = rng.uniform(1e-3, 1e-2, (n, k // fmt.block)).astype(np.float16)
        raw[:, :, off:off + 2] = scales.view(np.uint8).reshape(n, k // fmt.block, 2)
    return raw.reshape(n, -1)


def weight(name: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """(the packed weight, gguf's float dequantization of it [n, k])."""
    q = random_blocks(name, n, k, np.random.default_rng(seed))
    ref = torch.from_numpy(dequantize(q, gguf.GGMLQuantizationType[name]).astype(np.float32))
    return QuantizedWeight.from_blocks(f"blk.0.{name.lower()}.weight", name, torch.from_numpy(q), (n, k)), ref


def q8_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x's 8-bit blocks as the kernel makes them, llama.cpp's quantization to
    the bit (ggml-cpu's quantize_row_q8_0 / quantize_row_q8_K_ref): (q [M, nb,
    block] integers, the scale d [M, nb, 1], max|x| [M, nb, 1]). Multiplier
    127/max|x|, round half to even; the 32-block scale max|x|/127 rounded to
    fp16, the 256-block one 1/multiplier."""
    xb = x.float().reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    # a true division (torch's 127 / t is 127 * (1 / t), a last bit apart)
    idm = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)
    # x times the multiplier as the kernel computes it (not x / d: bf16 inputs often land on .5 exactly)
    q = torch.round(xb * idm).clamp(-127, 127)
    d = (amax / 127).half().float() if block == 32 else torch.where(idm > 0, 1 / idm, 0)
    return q, d, amax


def quantized_x(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the kernel sees it (``q8_blocks``' q times d) and each element's
    largest rounding error: d / 2, plus 127 times the scale's own fp16 rounding."""
    q, d, amax = q8_blocks(x, block)
    err = amax / 254 + 127 * (d - amax / 127).abs()
    return (q * d).reshape(x.shape), err.expand_as(q).reshape(x.shape)


def ggml_q8_0(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x @ W^T for a Q8_0 weight in llama.cpp's CPU arithmetic (tinyBLAS_Q0_AVX,
    ggml_vec_dot_q8_0_q8_0): per 32-block, 8 lanes of exact 4-product integer
    sums, multiply-added (float32 fma) block after block by fp16 d_w x fp16 d_x,
    the lanes reduced as hsum_float_8. The fma is a float64 multiply-add
    rounded to float32 (exact but for double rounding, ~2^-29 a step)."""
    n, nb = w.out_features, w.in_features // 32
    raw = w.data.reshape(n, nb, 34)
    dw = raw[..., :2].contiguous().view(torch.float16).float().reshape(n, nb)
    qw = raw[..., 2:].contiguous().view(torch.int8).long().reshape(n, nb, 8, 4)
    q, dx, _ = q8_blocks(x, 32)
    qx = q.long().reshape(x.shape[0], nb, 8, 4)
    lanes = torch.einsum("mblk,nblk->mnbl", qx, qw).double()  # exact
    scale = (dx.reshape(-1, 1, nb) * dw.reshape(1, n, nb)).double()  # the float32 product
    acc = torch.zeros(x.shape[0], n, 8, dtype=torch.float32)
    for b in range(nb):
        acc = (scale[:, :, b, None] * lanes[:, :, b] + acc.double()).float()
    a = acc[..., :4] + acc[..., 4:]
    return (a[..., 0] + a[..., 2]) + (a[..., 1] + a[..., 3])
