"""The runner's persistent batch: one numpy row per request it holds, updated
in place from the scheduler's deltas, never rebuilt per step.

Row r (the request ``req_ids[r]``)::

    token_ids[r]    | prompt | outputs ......... | drafts of this step | unused |
                    0        num_prompt          num_tokens[r]
    block_table[r]  | block ids ...................| unused |
                    0                              num_blocks[r]
    sampling_knobs[r]  temperature, top_k, top_p, min_p, penalties, greedy
                       (``row_knobs``), set once when the request is added

Rows are kept dense: removing a request moves the last row into its place,
so rows ``[0, num_reqs)`` are exactly the requests held. Columns grow by
doubling when a request outgrows them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvferry.core.outputs import NewRequestData
from kvferry.model.attention import AttentionMetadata
from kvferry.model.sampler import row_knobs

NUM_KNOBS = 8


class InputBatch:
    def __init__(
        self, vocab_size: int, max_num_reqs: int = 8, max_num_tokens: int = 256, max_num_blocks: int = 16
    ) -> None:
        self.vocab_size = vocab_size
        self.req_ids: list[str] = []
        self.index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_num_tokens), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + outputs known
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.sampling_knobs = np.zeros((max_num_reqs, NUM_KNOBS), dtype=np.float32)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, data: NewRequestData) -> int:
        tokens = data.prompt_token_ids + data.output_token_ids
        row = self.num_reqs
        self._ensure(row + 1, len(tokens), len(data.block_ids))
        self.req_ids.append(data.request_id)
        self.index[data.request_id] = row
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = data.num_computed_tokens
        self.block_table[row, : len(data.block_ids)] = data.block_ids
        self.num_blocks[row] = len(data.block_ids)
        self.sampling_knobs[row] = row_knobs(data.sampling_params, self.vocab_size)
        return row

    def remove(self, request_id: str) -> None:
        row = self.index.pop(request_id, None)
        if row is None:
            return
        last = self.num_reqs - 1
        if row != last:
            # Move the last row into the hole, so rows stay dense.
            moved = self.req_ids[last]
            for array in self._row_arrays():
                array[row] = array[last]
            self.req_ids[row] = moved
            self.index[moved] = row
        self.req_ids.pop()

    def _row_arrays(self) -> tuple[np.ndarray, ...]:
        return (
            self.token_ids, self.num_tokens, self.num_computed_tokens,
            self.block_table, self.num_blocks, self.sampling_knobs,
        )

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        self._ensure(self.num_reqs, 0, start + len(block_ids))
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        if not token_ids:
            return
        start = int(self.num_tokens[row])
        self._ensure(self.num_reqs, start + len(token_ids), 0)
        self.token_ids[row, start : start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)

    def write_drafts(self, row: int, draft_ids: list[int]) -> None:
        """Drafts go after the known tokens without counting as known: the
        accepted ones are appended (over them) once verified."""
        start = int(self.num_tokens[row])
        self._ensure(self.num_reqs, start + len(draft_ids), 0)
        self.token_ids[row, start : start + len(draft_ids)] = draft_ids

    def _ensure(self, num_rows: int, num_tokens: int, num_blocks: int) -> None:
        self.token_ids = _grown(self.token_ids, num_rows, num_tokens)
        self.block_table = _grown(self.block_table, num_rows, num_blocks)
        self.sampling_knobs = _grown(self.sampling_knobs, num_rows, NUM_KNOBS)
        for name in ("num_tokens", "num_computed_tokens", "num_blocks"):
            array = getattr(self, name)
            if num_rows > len(array):
                grown = np.zeros(max(num_rows, 2 * len(array)), dtype=array.dtype)
                grown[: len(array)] = array
                setattr(self, name, grown)


def _grown(array: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``array`` itself if it has room for [rows, cols], else a copy at least
    twice as large in the dimension that ran out."""
    old_rows, old_cols = array.shape
    if rows <= old_rows and cols <= old_cols:
        return array
    new_rows = max(rows, 2 * old_rows) if rows > old_rows else old_rows
    new_cols = max(cols, 2 * old_cols) if cols > old_cols else old_cols
    grown = np.zeros((new_rows, new_cols), dtype=array.dtype)
    grown[:old_rows, :old_cols] = array
    return grown


@dataclass(slots=True)
class FlatStep:
    """One forward pass's flattened inputs over some rows of the batch:
    request i computes positions ``starts[i] .. starts[i] + lens[i] - 1``
    (multi-token requests first, as AttentionMetadata wants)."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slots: np.ndarray  # [num_tokens] int64: where each token's K/V goes
    query_start_loc: np.ndarray  # [num_reqs + 1] int64
    seq_lens: np.ndarray  # [num_reqs] int64
    block_tables: np.ndarray  # [num_reqs, max_blocks] int64
    num_prefills: int
    # Draft trees (kvferry.spec.tree): request index -> [q_len, q_len] bool,
    # which of its new tokens each may attend to (None: all causal).
    tree_masks: dict[int, np.ndarray] | None = None

    def metadata(self, block_size: int, device: torch.device, kv_dtype: torch.dtype | None = None,
                 triton: bool = False) -> AttentionMetadata:
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc.tolist(),
            seq_lens=self.seq_lens.tolist(),
            slot_mapping=to_device(self.slots, device),
            block_tables=to_device(self.block_tables, device),
            block_size=block_size,
            num_prefills=self.num_prefills,
            kv_dtype=kv_dtype,
            triton=triton,
            tree_masks=None if not self.tree_masks else
            {i: to_device(m, device) for i, m in self.tree_masks.items()},
        )
        meta.prepare()
        return meta


def flatten(batch: InputBatch, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray, block_size: int) -> FlatStep:
    """Gather a step's inputs for ``rows`` (already ordered multi-token
    first) with numpy, reading token ids from the batch's rows."""
    query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start_loc[1:])
    seq_lens = starts + lens
    # positions: for request i, starts[i] .. starts[i] + lens[i] - 1
    positions = np.repeat(starts - query_start_loc[:-1], lens) + np.arange(query_start_loc[-1])
    req_of_token = np.repeat(np.arange(len(rows)), lens)  # [num_tokens]
    input_ids = batch.token_ids[rows[req_of_token], positions]
    max_blocks = int(-(-seq_lens.max() // block_size))
    block_tables = batch.block_table[rows, :max_blocks]  # [num_reqs, max_blocks], one gather
    # slot = block_tables[req, pos // bs] * bs + pos % bs   for every new token
    slots = block_tables[req_of_token, positions // block_size] * block_size + positions % block_size
    return FlatStep(input_ids, positions, slots, query_start_loc, seq_lens, block_tables, int((lens > 1).sum()))


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device``. To CUDA it goes through pinned memory (torch's
    caching host allocator, which keeps a buffer until the copy that reads it
    has run), so the copy is asynchronous; on CPU the array is shared."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
