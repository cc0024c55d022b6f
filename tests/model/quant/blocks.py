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


def quantized_x(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the kernel sees it (8-bit per block of ``block`` values, scale
    max|x|/127, round half to even) and each element's step d / 2."""
    xb = x.reshape(x.shape[0], -1, block)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127
    # x times 1/d as the kernel computes it (not x / d: bf16 inputs often land on .5 exactly)
    q = torch.round(xb * torch.where(d > 0, 1 / d, 0)).clamp(-127, 127)
    return (q * d).reshape(x.shape), (d / 2).expand_as(xb).reshape(x.shape)
