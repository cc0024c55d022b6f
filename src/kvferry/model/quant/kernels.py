"""Loading the quantized matmul (``csrc/quant_gemm.cpp``) and calling it.

The library is built at first use with paged_kernel.py's machinery (same
cache folder, the cache name hashes source, flags and CPU flags). With
``KVFERRY_KERNEL_ISA=avx2`` on an AVX-512 machine it is also built without
AVX-VNNI, so that build runs (and tests) the vpmaddubsw path an AVX2-only CPU
takes; a CPU with AVX-VNNI gets vpdpbusd in its native build.
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from kvferry.model import paged_kernel
from kvferry.model.quant.formats import QuantizedWeight

_SOURCE = Path(__file__).parent.parent / "csrc" / "quant_gemm.cpp"
_library = paged_kernel.LazyLibrary(lambda: _load())
# Each thread's tile buffer, kept between calls: a fresh 4 MiB buffer per
# call costs ~1000 page faults, as long as dequantizing a tile.
_tiles = threading.local()
# The dequantized tile of a prefill-sized batch: 4 MiB of bf16 (1024 rows of
# K = 2048), one at a time. Smaller tiles pay oneDNN's fixed cost per call
# (~50 us, as much as a 128-row tile's multiply at 32 rows).
PREFILL_TILE_BYTES = 4 << 20
# From this many rows of x, a dequantized bf16 tile and oneDNN (AMX where
# present) beat the integer dot products, whose cost grows with every row
# while the tiles' is mostly the dequantization, paid once. Measured on a
# Xeon with AMX (avx512vnni build), one thread, CPU time, 8192 x 2048 weights (ms):
#   rows        1     4     8     16    32
#   Q4_K dots  1.1   2.0   3.4   6.7   13.9    tiles 6.3 .. 7.5
#   Q8_0 dots  1.1   2.7   4.9   9.2   18.3    tiles 7.3 .. 8.0
# The K-quants' dots share one decoded superblock and its scales among 8 rows.
PREFILL_MIN_ROWS = {32: 12, 256: 16}  # by the format's block size


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
    """Rows start..stop of the weight as floats [rows, in_features] (float32 or bf16)."""
    data = weight.data[start:stop]
    out = torch.empty(data.shape[0], weight.in_features, dtype=dtype)
    _ops().dequant_into(data, weight.fmt.ggml_type, out)
    return out


def embedding(ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` [T] of a quantized table, dequantized: [T, in_features] in
    ``dtype`` (float32 or bf16). Only the looked-up rows' blocks are read
    (gathered, T x bytes_per_row, then decoded), never the whole table."""
    rows = weight.data.index_select(0, ids.reshape(-1))  # [T, bytes_per_row] uint8
    out = torch.empty(rows.shape[0], weight.in_features, dtype=dtype)
    _ops().dequant_into(rows, weight.fmt.ggml_type, out)
    return out


def gemv(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [M, K] float32/bf16 -> x @ W^T [M, N] float32 with integer dot products
    (x quantized to 8 bits per block, once per row)."""
    _check_x(x, weight)
    return _ops().gemm(x, weight.data, weight.fmt.ggml_type, weight.out_features)


def prefill(x: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x @ W^T [M, N] float32 through oneDNN, dequantizing one tile of weight rows
    at a time into one reused buffer (``dtype``: bf16, or float32 for checks)."""
    _check_x(x, weight)
    ops, xd = _ops(), x.to(dtype)
    rows = max(16, PREFILL_TILE_BYTES // (weight.in_features * dtype.itemsize))
    tile = _tile_buffer(min(rows, weight.out_features) * weight.in_features, dtype)
    y = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    for start in range(0, weight.out_features, rows):
        stop = min(start + rows, weight.out_features)
        w = tile[:(stop - start) * weight.in_features].view(stop - start, weight.in_features)
        ops.dequant_into(weight.data[start:stop], weight.fmt.ggml_type, w)
        y[:, start:stop] = xd @ w.t()
    return y


def _tile_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = getattr(_tiles, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = _tiles.buf = torch.empty(numel, dtype=dtype)
    return buf


def linear(x: torch.Tensor, weight: QuantizedWeight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ W^T in ``out_dtype`` (default x's), by the path that fits M."""
    # Without AVX2 the library has only its scalar dequantizer: every M takes the tiles.
    small = x.shape[0] < PREFILL_MIN_ROWS[weight.fmt.block] and kernel_path() != "none"
    y = gemv(x, weight) if small else prefill(x, weight)
    return y.to(out_dtype or x.dtype)
