"""The KV cache's storage dtype (``--kv-cache-dtype``) and the tensor ops that
must handle every one of them.

"auto" stores K/V in the model's dtype: the engine is then exact to HF. The
fp8 formats store each element in one byte, with no scale (as vLLM's fp8
caches without checkpoint scales): half the bytes of a bf16 cache, so twice
the blocks in the same memory, and half the K/V a decode step reads. Both
are lossy, so outputs drift from HF's:

- "fp8_e4m3" (alias "fp8", as in vLLM): float8_e4m3fn, 4 exponent and 3
  mantissa bits, a relative rounding error of up to 2^-4, normals from 2^-6
  to 448. Writes saturate: magnitudes past 448 (inf included) store 448,
  where ``.to(torch.float8_e4m3fn)`` alone would store NaN. K/V of the
  models served here stay well inside that range (|K| about 20 at most in
  SmolLM2), and e4m3 costs about a third of e5m2's KL divergence
  (BENCHMARKS.md).
- "fp8_e5m2": float8_e5m2, 5 exponent and 2 mantissa bits (up to 2^-3),
  the range of fp16: magnitudes past 57344 become inf, as
  ``.to(torch.float8_e5m2)`` rounds them.

Values round to nearest even. Each format widens exactly to bf16 and to
float, so the attention kernels read them back in registers.

Blocks stored in fp8 carry the dtype in their hash keys (``ExtraKeys``), so
they never mix with another dtype's blocks in a shared store, and a router
refuses workers whose cache dtypes differ.
"""
from __future__ import annotations

import torch

from kvferry.config import KV_CACHE_DTYPES  # the names --kv-cache-dtype takes (config imports no torch)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_BY_NAME = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value: where its writes saturate


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
    return _BY_NAME[name]


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16", "float8_e5m2": the name that block keys and ready messages carry."""
    return str(dtype).removeprefix("torch.")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in _FP8_DTYPES


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it: ``x.to(dtype)``, except that
    e4m3 saturates at +-448 (NaN stays NaN), as the C++ write does."""
    if dtype == torch.float8_e4m3fn and x.dtype != dtype:
        x = x.clamp(-E4M3_MAX, E4M3_MAX)
    return x.to(dtype)


def index_copy_into(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(dim, index, src)`` for every cache dtype: torch has no
    index_copy_ for float8, so one-byte floats are copied as their bytes
    (``src`` converted as ``to_cache_dtype`` converts it)."""
    if is_fp8(dst.dtype):
        dst.view(torch.uint8).index_copy_(dim, index, to_cache_dtype(src, dst.dtype).view(torch.uint8))
        return
    dst.index_copy_(dim, index, src.to(dst.dtype))
