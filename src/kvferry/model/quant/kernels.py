"""Loading the quantized matmul (``csrc/quant_gemm.cpp``) and calling it.

The library is built at first use with paged_kernel.py's machinery (same
cache folder, the cache name hashes source, flags and CPU flags). With
``KVFERRY_KERNEL_ISA=avx2`` on an AVX-512 machine it is also built without
AVX-VNNI, so that build runs (and tests) the vpmaddubsw path an AVX2-only CPU
takes; a CPU with AVX-VNNI gets vpdpbusd in its native build.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kvferry.model import paged_kernel
from kvferry.model.quant.formats import QuantizedWeight

_SOURCE = Path(__file__).parent.parent / "csrc" / "quant_gemm.cpp"
_library = paged_kernel.LazyLibrary(lambda: _load())
# Rows of the weight dequantized at once for a prefill-sized batch: 128 rows of
# K = 8192 are 2 MiB in bf16, L2-sized, and only one tile exists at a time.
PREFILL_TILE_ROWS = 128
# From this many rows of x a dequantized tile and oneDNN (AMX where present)
# beat the integer dot products, which re-decode each block per 4 rows.
PREFILL_MIN_ROWS = 48


def _cflags() -> list[str]:
    isa = paged_kernel.kernel_isa()
    return paged_kernel._cflags() + ([] if paged_kernel.isa_is_native(isa) else ["-mno-avxvnni"])


def _load() -> bool:
    return paged_kernel.try_load_library("kvferry_quant", _SOURCE, _cflags(),
                                         "the C++ quantized matmul", "dequantized float weights")


def available() -> bool:
    """Whether the library is loaded (building it on the first call)."""
    return not paged_kernel.kernels_disabled() and _library.available()


def kernel_path() -> str | None:
    """The integer dot product the build runs: "avx512vnni", "avxvnni", "avx2" or "none"."""
    return torch.ops.kvferry_quant.path() if available() else None


def _ops():
    if not available():
        raise RuntimeError("the C++ quantized matmul is unavailable (disabled or not built; see the log)")
    return torch.ops.kvferry_quant


def _check_x(x: torch.Tensor, weight: QuantizedWeight) -> None:
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"tensor {weight.name!r}: x must be [M, {weight.in_features}], got {list(x.shape)}")


def dequantize_rows(weight: QuantizedWeight, start: int = 0, stop: int | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows start..stop of the weight as floats [rows, in_features]."""
    data = weight.data[start:stop]
    w = _ops().dequant(data, weight.fmt.ggml_type, weight.in_features)
    return w if dtype == torch.float32 else w.to(dtype)


def gemv(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [M, K] float32/bf16 -> x @ W^T [M, N] float32 with integer dot products
    (x quantized to 8 bits per block, once per row)."""
    _check_x(x, weight)
    return _ops().gemm(x, weight.data, weight.fmt.ggml_type, weight.out_features)


def prefill(x: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x @ W^T [M, N] float32 through oneDNN, one dequantized tile of rows at a time."""
    _check_x(x, weight)
    xd = x.to(dtype)
    y = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    for start in range(0, weight.out_features, PREFILL_TILE_ROWS):
        stop = min(start + PREFILL_TILE_ROWS, weight.out_features)
        torch.matmul(xd, dequantize_rows(weight, start, stop, dtype).t(), out=y[:, start:stop]) \
            if dtype == torch.float32 else y[:, start:stop].copy_(xd @ dequantize_rows(weight, start, stop, dtype).t())
    return y


def linear(x: torch.Tensor, weight: QuantizedWeight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ W^T in ``out_dtype`` (default x's), by the path that fits M."""
    y = gemv(x, weight) if x.shape[0] < PREFILL_MIN_ROWS else prefill(x, weight)
    return y.to(out_dtype or x.dtype)
