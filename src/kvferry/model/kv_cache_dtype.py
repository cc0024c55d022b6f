"""The KV cache's storage dtype (``--kv-cache-dtype``) and the tensor ops that
must handle every one of them.

"auto" stores K/V in the model's dtype: the engine is then exact to HF.
"fp8_e5m2" (alias "fp8") stores each element as an IEEE float8 with 5
exponent and 2 mantissa bits, with no scale (as vLLM's CPU fp8 cache): half
the bytes of a bf16 cache, so twice the blocks in the same memory, and half
the K/V a decode step reads. It is lossy (a relative rounding error of up
to 2^-3 per element), so outputs drift from HF's. Values round to nearest
even, exactly as ``tensor.to(torch.float8_e5m2)`` does, and magnitudes past
57344 become inf; e5m2 widens exactly to fp16, so the attention reads it
back with one shift and one conversion per element.

Blocks stored in fp8 carry the dtype in their hash keys (``ExtraKeys``), so
they never mix with another dtype's blocks in a shared store, and a router
refuses workers whose cache dtypes differ.
"""
from __future__ import annotations

import torch

from kvferry.config import KV_CACHE_DTYPES  # the names --kv-cache-dtype takes (config imports no torch)
_FP8_DTYPES = (torch.float8_e5m2,)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device, triton: bool) -> torch.dtype:
    """The cache tensor's dtype for ``--kv-cache-dtype name`` with a model in
    ``model_dtype``; ValueError where this build cannot serve it."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if device.type != "cpu" or triton:
        # The Triton kernels read and write the model's dtype only.
        raise ValueError(f"kv_cache_dtype {name!r} is served by the CPU kernels only "
                         f"(device {device.type}, attention backend {'triton' if triton else 'torch'})")
    return torch.float8_e5m2


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16", "float8_e5m2": the name that block keys and ready messages carry."""
    return str(dtype).removeprefix("torch.")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in _FP8_DTYPES


def index_copy_into(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(dim, index, src)`` for every cache dtype: torch has no
    index_copy_ for float8, so one-byte floats are copied as their bytes."""
    if is_fp8(dst.dtype):
        dst.view(torch.uint8).index_copy_(dim, index, src.to(dst.dtype).view(torch.uint8))
        return
    dst.index_copy_(dim, index, src)
