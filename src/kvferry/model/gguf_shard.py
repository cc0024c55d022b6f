"""A GGUF tensor's blocks, read by a tensor-parallel rank only as far as it
holds them (``--tensor-parallel-size``, ``--enable-expert-parallel``).

At TP 1 the blocks are held as gguf_memory.py says (gguf_weights.py). Over
ranks each rank holds a slice, so the loader hands ``LlamaModel.load_weights``
a ``BlockTensor``: a lazy tensor that, like a safetensors slice, takes only
what ``TPShard.weight_slice`` asks of it. The slices are read (pread, no
page of a mapping touched, so none is resident twice) into the rank's own
memory: by default one ``huge_pages.Arena``'s 2 MiB pages, as at TP 1;
under ``KVFERRY_GGUF_WEIGHTS=mapped`` the heap, and there an expert's rows
(whole experts under expert parallelism) are used as they lie: views of
the mapped file, as at TP 1, paged in when an expert is first routed to
and shared with every engine serving the file. Read are a fused layer's
rows (stacked into one copy), llama's permuted Q/K, a row-parallel layer's
columns, the vocabulary's rows (the last rank's padded). Either way a rank
holds its share of the file:

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

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvferry.model import gguf_convert, gguf_memory, huge_pages
from kvferry.model.quant import QuantizedWeight, block_format

# Rows of a column slice per scatter read: three buffers a row, within the kernel's IOV_MAX (1024).
_ROWS_PER_READ = 1024 // 3


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
    # The mapped file (gguf_weights.map_file) where a row slice is used as it lies (not
    # stacked with another tensor's rows, not unpermuted): then a view, as at TP 1.
    mapped: torch.Tensor | None = None
    # Where the slices read are held (gguf_memory.py's huge pages), None: the heap.
    arena: huge_pages.Arena | None = None

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

    def _empty(self, rows: int, row_bytes: int) -> torch.Tensor:
        """Room for ``rows`` rows: in the arena, a view of its chunk (so
        slices read one after another stack as one view), else the heap."""
        if self.arena is None:
            return torch.empty((rows, row_bytes), dtype=torch.uint8)
        return self.arena.empty(rows * row_bytes).view(rows, row_bytes)

    def _read(self, first_row: int, rows: int) -> torch.Tensor:
        rb = self.row_bytes
        out = self._empty(rows, rb)
        gguf_memory.read_into(self.path, out.numpy(), self.offset + first_row * rb, self.name)
        return out

    def _rows(self, start: int, stop: int) -> QuantizedWeight:
        shape = (stop - start, self.in_features)
        if self.mapped is not None and self.heads is None:
            rb = self.row_bytes
            view = self.mapped[self.offset + start * rb:self.offset + stop * rb]
            return QuantizedWeight.from_blocks(self.name, self.kind, view, shape)
        data = self._read(start, stop - start)
        if self.heads is not None:
            # Whole heads (the split is by heads), each unpermuted within itself.
            per_head = self.out_features // self.heads
            if start % per_head or stop % per_head:
                raise ValueError(f"GGUF tensor {self.name!r}: rows [{start}, {stop}) are not whole heads of "
                                 f"{per_head} rows")
            # Into the rows' own place (the arena's huge pages where there is one).
            data.copy_(gguf_convert.unpermute_qk(data, (stop - start) // per_head).contiguous())
        return QuantizedWeight.from_blocks(self.name, self.kind, data, shape)

    def _columns(self, start: int, stop: int) -> QuantizedWeight:
        problem = split_problem(self.name, self.kind, self.in_features, start, stop)
        if problem is not None:
            raise ValueError(problem)
        fmt = block_format(self.kind)
        b0, b1, rb = start // fmt.block * fmt.bytes, stop // fmt.block * fmt.bytes, self.row_bytes
        held = self._empty(self.out_features, b1 - b0)
        out = held.numpy()
        # Each row's slice is read straight into ``out`` by one scatter read per many rows, the
        # other columns into one small scratch row: no temporary of the tensor's size, which
        # the allocator would keep as resident free memory after loading.
        skip = np.empty(max(b0, rb - b1, 1), dtype=np.uint8)
        before, after = memoryview(skip)[:b0], memoryview(skip)[:rb - b1]
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for r in range(0, self.out_features, _ROWS_PER_READ):
                n = min(_ROWS_PER_READ, self.out_features - r)
                bufs = [b for i in range(r, r + n) for b in (before, memoryview(out[i]), after) if len(b)]
                if os.preadv(fd, bufs, self.offset + r * rb) != n * rb:
                    raise ValueError(f"GGUF {self.path.name}: tensor {self.name!r} is truncated")
        finally:
            os.close(fd)
        return QuantizedWeight.from_blocks(self.name, self.kind, held, (self.out_features, stop - start))


def split_problem(name: str, kind: str, in_features: int, start: int, stop: int) -> str | None:
    """Why a rank cannot hold input columns [start, stop) of GGUF tensor
    ``name`` in its blocks (one line naming the tensor and the sizes), or
    None where they are whole blocks."""
    fmt = block_format(kind)
    if start % fmt.block == 0 and stop % fmt.block == 0:
        return None
    return (f"GGUF tensor {name!r} ({fmt.name}): a rank's {stop - start} of its {in_features} input columns "
            f"are not whole {fmt.block}-value blocks")

