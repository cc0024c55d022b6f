"""A minimal paged "runner" for model tests: schedules chunks of known token
sequences through LlamaModel.forward and returns per-token logits, so they
can be compared with a full HF forward over the same sequences."""
from __future__ import annotations

import random

import torch

from kvferry.model.attention import AttentionMetadata
from kvferry.model.llama import LlamaModel
from kvferry.spec.tree import ancestor_mask, depths


def scattered_tables(seq_lens, block_size, spare, gen):
    """Block tables over a shuffled pool of just enough blocks plus ``spare``."""
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + spare
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int64)
    used = 0
    for r, b in enumerate(blocks):
        tables[r, :b] = ids[used:used + b]
        used += b
    return tables, num_blocks


class PagedHarness:
    def __init__(self, model: LlamaModel, num_blocks: int = 64, block_size: int = 4, seed: int = 0,
                 cache_dtype: torch.dtype | None = None) -> None:
        c = model.config
        self.model = model
        self.block_size = block_size
        # NaN everywhere: reading any slot that was never written poisons the output.
        self.kv_cache = torch.full(
            (c.num_hidden_layers, 2, num_blocks, block_size, c.num_key_value_heads, c.head_dim),
            float("nan"), dtype=cache_dtype or model.dtype,
        )
        self.free = list(range(1, num_blocks))  # block 0 never handed out: padding must not need it
        random.Random(seed).shuffle(self.free)  # non-contiguous block tables
        self.block_tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def _slot(self, rid: int, pos: int) -> int:
        table = self.block_tables.setdefault(rid, [])
        while len(table) <= pos // self.block_size:
            table.append(self.free.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, seqs: dict[int, list[int]], plan: dict[int, int],
             trees: dict[int, list[int]] | None = None) -> dict[int, torch.Tensor]:
        """Run one step. plan: request id -> number of new tokens (its next chunk).
        trees: request id -> the parents of its chunk's tokens after the first
        (a draft tree, kvferry.spec.tree; plan = len(parents) + 1), verified as
        the runner does (engine/tree_verify.py): chain slots, RoPE at root +
        depth, the ancestor mask.
        Returns request id -> logits [n_new, vocab] (float32)."""
        trees = trees or {}
        order = sorted(plan, key=lambda r: plan[r] == 1)  # prefills (>1 token) first
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for rid in order:
            start = self.computed.get(rid, 0)
            end = start + plan[rid]
            ids += seqs[rid][start:end]
            if rid in trees:
                assert len(trees[rid]) + 1 == plan[rid], f"request {rid}: the tree is not its chunk"
                pos += [start] + [start + d for d in depths(trees[rid])]
            else:
                pos += list(range(start, end))
            slots += [self._slot(rid, p) for p in range(start, end)]
            qsl.append(qsl[-1] + plan[rid])
            seq_lens.append(end)
            self.computed[rid] = end
        width = max(len(self.block_tables[r]) for r in order)
        bt = torch.zeros(len(order), width, dtype=torch.int64)
        for i, rid in enumerate(order):
            bt[i, :len(self.block_tables[rid])] = torch.tensor(self.block_tables[rid])
        meta = AttentionMetadata(
            query_start_loc=qsl, seq_lens=seq_lens, slot_mapping=torch.tensor(slots),
            block_tables=bt, block_size=self.block_size, num_prefills=sum(plan[r] > 1 for r in order),
            tree_masks={i: torch.from_numpy(ancestor_mask(trees[rid])) for i, rid in enumerate(order)
                        if rid in trees} or None,
        )
        hidden = self.model.forward(torch.tensor(ids), torch.tensor(pos), self.kv_cache, meta)
        logits = self.model.compute_logits(hidden)
        return {rid: logits[qsl[i]:qsl[i + 1]] for i, rid in enumerate(order)}
