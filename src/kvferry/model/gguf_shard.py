"""A GGUF tensor's blocks, read by a tensor-parallel rank only as far as it
holds them (``--tensor-parallel-size``, ``--enable-expert-parallel``).

At TP 1 the blocks are views of the mapped file (gguf_weights.py). Over
ranks each rank holds a slice, so the loader hands ``LlamaModel.load_weights``
a ``BlockTensor``: a lazy tensor that, like a safetensors slice, reads only
what ``TPShard.weight_slice`` asks of it, into the rank's own memory
(``np.fromfile``: pread, no page of a mapping touched, so a rank's RSS is
its share of the file, not the pages it once looked at):

    tensor[start:stop]      rows: a column-parallel layer (q/k/v, gate/up:
                            heads / intermediate rows), the vocabulary's rows
                            (embedding, lm_head), an expert's gate/up rows.
                            Rows are whole blocks: always exact.
    tensor[:, start:stop]   columns: a row-parallel layer (o_proj, down_proj,
                            an expert's down) holds its input columns. A row
                            is blocks of 32 or 256 values, so the rank's
                            columns must be whole blocks: ``split_problem``
                            says where they are not (the loader then serves
                            that tensor in float, or refuses under
                            ``--quantization gguf``).
    tensor[:]               whole (a replicated tensor; a whole expert of
                            this rank under expert parallelism).

An expert that is another rank's (expert parallelism) is never asked for,
so its bytes are never read. llama's Q and K rows, which llama.cpp permuted
per head, are unpermuted on the rank's rows alone: a rank's rows are whole
heads, and the permutation never crosses a head.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvferry.model import gguf_convert
from kvferry.model.quant import QuantizedWeight, block_format

# Rows read at a time for a column slice: the whole tensor is never in memory at once.
_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class BlockTensor:
    """A GGUF weight [out_features, in_features] in blocks, not yet read."""

    path: Path
    name: str  # the GGUF tensor's name (and [expert]), for errors
    kind: str  # ggml type name, e.g. "Q4_K"
    offset: int  # the first byte in the file
    out_features: int
    in_features: int
    heads: int | None = None  # llama's Q/K: the head count its rows were permuted by

    def get_shape(self) -> list[int]:  # what LlamaModel.load_weights asks of a lazy tensor
        return [self.out_features, self.in_features]

    @property
    def row_bytes(self) -> int:
        fmt = block_format(self.kind)
        return self.in_features // fmt.block * fmt.bytes

    def __getitem__(self, key: slice | tuple[slice, slice]) -> QuantizedWeight:
        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        r0, r1, rs = rows.indices(self.out_features)
        c0, c1, cs = cols.indices(self.in_features)
        if rs != 1 or cs != 1:
            raise ValueError(f"GGUF tensor {self.name!r}: only contiguous slices are read")
        if (c0, c1) == (0, self.in_features):
            return self._rows(r0, r1)
        if (r0, r1) != (0, self.out_features):
            raise ValueError(f"GGUF tensor {self.name!r}: rows and columns are not sliced together")
        return self._columns(c0, c1)

    def _read(self, first_row: int, rows: int) -> np.ndarray:
        rb = self.row_bytes
        arr = np.fromfile(self.path, dtype=np.uint8, count=rows * rb, offset=self.offset + first_row * rb)
        if arr.size != rows * rb:
            raise ValueError(f"GGUF {self.path.name}: tensor {self.name!r} is truncated")
        return arr.reshape(rows, rb)

    def _rows(self, start: int, stop: int) -> QuantizedWeight:
        data = torch.from_numpy(self._read(start, stop - start))
        if self.heads is not None:
            # Whole heads (the split is by heads), each unpermuted within itself.
            per_head = self.out_features // self.heads
            if start % per_head or stop % per_head:
                raise ValueError(f"GGUF tensor {self.name!r}: rows [{start}, {stop}) are not whole heads of "
                                 f"{per_head} rows")
            data = gguf_convert.unpermute_qk(data, (stop - start) // per_head).contiguous()
        return QuantizedWeight.from_blocks(self.name, self.kind, data, (stop - start, self.in_features))

    def _columns(self, start: int, stop: int) -> QuantizedWeight:
        problem = split_problem(self.name, self.kind, self.in_features, start, stop)
        if problem is not None:
            raise ValueError(problem)
        fmt = block_format(self.kind)
        b0, b1 = start // fmt.block * fmt.bytes, stop // fmt.block * fmt.bytes
        out = np.empty((self.out_features, b1 - b0), dtype=np.uint8)
        step = max(1, _CHUNK_BYTES // self.row_bytes)
        for r in range(0, self.out_features, step):
            n = min(step, self.out_features - r)
            out[r:r + n] = self._read(r, n)[:, b0:b1]
        return QuantizedWeight.from_blocks(self.name, self.kind, torch.from_numpy(out),
                                           (self.out_features, stop - start))


def split_problem(name: str, kind: str, in_features: int, start: int, stop: int) -> str | None:
    """Why a rank cannot hold input columns [start, stop) of GGUF tensor
    ``name`` in its blocks (one line naming the tensor and the sizes), or
    None where they are whole blocks."""
    fmt = block_format(kind)
    if start % fmt.block == 0 and stop % fmt.block == 0:
        return None
    return (f"GGUF tensor {name!r} ({fmt.name}): a rank's {stop - start} of its {in_features} input columns "
            f"are not whole {fmt.block}-value blocks")

