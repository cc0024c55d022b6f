"""GGUF block formats and the holder of a weight kept in its blocks.

Each row of a weight [out_features, in_features] is its GGUF blocks back to
back, exactly as in the file: ``in_features / block`` blocks of ``bytes``
bytes each. ``QuantizedWeight`` holds them as one uint8 tensor
[out_features, bytes_per_row] (a view of the mapped file, or of its
huge-page copy, where it can be: gguf_weights.py), never a float copy, and
checks the sizes once so the kernels can trust them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType's value, which the kernel takes
    block: int  # values per block
    bytes: int  # bytes per block


# Byte layouts (fp16 = 2 bytes; "qs" nibbles: values 0-15 low, 16-31 high):
#   Q4_0  d, qs[16]                        w = d * (q - 8)
#   Q4_1  d, m, qs[16]                     w = d * q + m
#   Q5_0  d, qh[4], qs[16]                 w = d * (q - 16), q's bit 4 from qh
#   Q5_1  d, m, qh[4], qs[16]              w = d * q + m
#   Q8_0  d, qs[32] int8                   w = d * q
#   Q2_K  scales[16], qs[64], d, dmin      16 sub-blocks of 16: 4-bit scale and min
#   Q3_K  hmask[32], qs[64], scales[12], d 16 x 16: 6-bit scales - 32, q - 4
#   Q4_K  d, dmin, scales[12], qs[128]     8 x 32: 6-bit scale and min
#   Q5_K  d, dmin, scales[12], qh[32], qs[128]
#   Q6_K  ql[128], qh[64], scales[16] int8, d   16 x 16, q - 32
FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q4_0", 2, 32, 18), BlockFormat("Q4_1", 3, 32, 20),
    BlockFormat("Q5_0", 6, 32, 22), BlockFormat("Q5_1", 7, 32, 24), BlockFormat("Q8_0", 8, 32, 34),
    BlockFormat("Q2_K", 10, 256, 84), BlockFormat("Q3_K", 11, 256, 110), BlockFormat("Q4_K", 12, 256, 144),
    BlockFormat("Q5_K", 13, 256, 176), BlockFormat("Q6_K", 14, 256, 210),
)}
BY_GGML_TYPE: dict[int, BlockFormat] = {f.ggml_type: f for f in FORMATS.values()}


def block_format(kind: str | int) -> BlockFormat:
    """The format named ``kind`` ("Q4_K") or with ggml type id ``kind``; ValueError for others."""
    fmt = BY_GGML_TYPE.get(kind) if isinstance(kind, int) else FORMATS.get(str(kind).upper())
    if fmt is None:
        raise ValueError(f"quantization type {kind!r} has no native kernel; supported: {', '.join(FORMATS)}")
    return fmt


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A linear weight [out_features, in_features] kept in GGUF blocks."""

    name: str  # the tensor's name, for errors
    fmt: BlockFormat
    data: torch.Tensor  # uint8 [out_features, bytes_per_row], contiguous, on CPU
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @classmethod
    def from_blocks(cls, name: str, kind: str | int, data: torch.Tensor | bytes | memoryview,
                    shape: tuple[int, int]) -> "QuantizedWeight":
        """Wrap ``data`` (the tensor's raw block bytes, flat or [rows, bytes]) as a
        weight of ``shape`` = (out_features, in_features); ValueError naming
        ``name`` where the bytes do not fit the shape and type."""
        fmt = block_format(kind)
        out_features, in_features = (int(s) for s in shape)
        if out_features <= 0 or in_features <= 0:
            raise ValueError(f"tensor {name!r}: shape {tuple(shape)} must be two positive sizes")
        if in_features % fmt.block:
            raise ValueError(f"tensor {name!r}: in_features={in_features} is not a multiple of "
                             f"{fmt.name}'s block size {fmt.block}")
        if not isinstance(data, torch.Tensor):
            data = torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=torch.uint8)
        if data.dtype != torch.uint8 or data.device.type != "cpu":
            raise ValueError(f"tensor {name!r}: block data must be uint8 on CPU, got {data.dtype} on {data.device}")
        row_bytes = in_features // fmt.block * fmt.bytes
        if data.numel() != out_features * row_bytes:
            raise ValueError(f"tensor {name!r}: {fmt.name} {out_features}x{in_features} needs "
                             f"{out_features * row_bytes} bytes, got {data.numel()} (truncated or wrong type)")
        if data.dim() == 2 and data.shape[1] != row_bytes:
            raise ValueError(f"tensor {name!r}: rows of {data.shape[1]} bytes, {fmt.name} needs {row_bytes}")
        return cls(name, fmt, data.reshape(out_features, row_bytes).contiguous(), in_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def pad_rows(self, rows: int) -> "QuantizedWeight":
        """This weight with zero rows after it, up to ``rows`` (a tensor-parallel
        rank's short vocabulary slice). Zero bytes are zero values in every
        block type: every scale and min is zero."""
        if rows == self.out_features:
            return self
        data = torch.zeros((rows, self.data.shape[1]), dtype=torch.uint8)
        data[:self.out_features] = self.data
        return QuantizedWeight(self.name, self.fmt, data, self.in_features)


def stack_rows(name: str, weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one format and width stacked row-wise (a fused layer's
    shards; rows are whole blocks, so stacking is exact). Shards that already
    lie back to back in one buffer (views of a mapped file whose tensors are
    adjacent, as llama.cpp writes ffn_gate and ffn_up) become one view of it,
    with no copy; others are concatenated."""
    first = weights[0]
    if any(w.fmt != first.fmt or w.in_features != first.in_features for w in weights):
        raise ValueError(f"tensor {name!r}: shards of different formats or widths cannot be stacked")
    rows = sum(w.out_features for w in weights)
    row_bytes = first.data.shape[1]
    adjacent = all(
        b.data.untyped_storage().data_ptr() == first.data.untyped_storage().data_ptr()
        and b.data.data_ptr() == a.data.data_ptr() + a.nbytes for a, b in zip(weights, weights[1:]))
    data = (first.data.as_strided((rows, row_bytes), (row_bytes, 1)) if adjacent
            else torch.cat([w.data for w in weights]))
    return QuantizedWeight(name, first.fmt, data, first.in_features)
