"""The runner's side of draft trees (``kvferry.spec.tree``): a tree's
inputs (positions by depth, the attention mask) and, once verified, the
accepted branch's KV and hidden rows moved to where a chain's would be.

A tree request computes its root (its newest token) and its n drafts as
one chunk of 1 + n tokens. Token j of the chunk keeps the slot a chain's
j-th token would have (positions root + j of its block table), so the
scheduler's bookkeeping is a chain's: it reserved n slots and rolls back
the n - a rejected ones. Only RoPE sees the tree: node i is rotated for
position root + depth(i). After verification the a accepted nodes, at
chunk offsets 1 + n_0 < 1 + n_1 < ..., are copied to offsets 1 .. a, the
positions they now hold; the copy runs in increasing order and n_j >= j,
so no source is overwritten before it is read.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvferry.model.input_batch import FlatStep
from kvferry.spec.tree import accepted_nodes, ancestor_mask, depths, paths_to


def prepare_trees(flat: FlatStep, order: list[str], trees: dict[str, list[int]]) -> dict[str, int]:
    """Set the tree requests' positions (by depth) and masks in ``flat``;
    returns each tree request's first token offset in the batch."""
    starts: dict[str, int] = {}
    masks: dict[int, np.ndarray] = {}
    positions = flat.positions.copy()  # the batch's own array may be shared
    qsl = flat.query_start_loc
    for i, rid in enumerate(order):
        parents = trees.get(rid)
        if parents is None:
            continue
        start = int(qsl[i])
        if int(qsl[i + 1]) - start != len(parents) + 1:
            raise ValueError(f"request {rid}: a tree of {len(parents)} drafts in a chunk of "
                             f"{int(qsl[i + 1]) - start} tokens")
        positions[start + 1 : start + 1 + len(parents)] = positions[start] + np.asarray(depths(parents))
        masks[i] = ancestor_mask(parents)
        starts[rid] = start
    flat.positions = positions
    flat.tree_masks = masks
    return starts


def row_prefixes(drafts: list[int], parents: list[int] | None) -> list[list[int]]:
    """For each verified row (the root, then each draft): the drafts that
    come before it in the output if it is reached (a chain: drafts[:j])."""
    if parents is None:
        return [drafts[:j] for j in range(len(drafts) + 1)]
    return [[drafts[i] for i in path] for path in paths_to(parents)]


def compact(kv_cache: torch.Tensor, aux: torch.Tensor | None, slots: np.ndarray, start: int,
            accepted: list[int]) -> None:
    """Move the accepted nodes' KV (every layer) and aux rows to the chunk
    offsets 1 .. a. ``kv_cache`` [L, 2, blocks, block_size, kvh, hd];
    ``slots``: the step's slot of each batch token."""
    moves = [(start + 1 + node, start + 1 + j) for j, node in enumerate(accepted) if node != j]
    if not moves:
        return
    src = [s for s, _ in moves]
    dst = [d for _, d in moves]
    layers, two, blocks, block_size = kv_cache.shape[:4]
    flat = kv_cache.view(layers, two, blocks * block_size, *kv_cache.shape[4:])
    device = kv_cache.device
    src_slots = torch.as_tensor(slots[src], device=device)
    dst_slots = torch.as_tensor(slots[dst], device=device)
    # index_select first: the gathered copy is read before any slot is written.
    flat.index_copy_(2, dst_slots, flat.index_select(2, src_slots))
    if aux is not None:
        rows = torch.as_tensor(src, device=aux.device)
        aux.index_copy_(0, torch.as_tensor(dst, device=aux.device), aux.index_select(0, rows))


@dataclass(slots=True)
class UnsampledTrees:
    """A rank that verifies draft trees but does not sample (a tensor-parallel
    worker, a pipeline stage before the last): its step's trees, kept until
    the sampling rank's tokens arrive, which say the branch that held. Its KV
    is then compacted as the sampling rank's was, before the next step reads it."""

    trees: dict[str, tuple[list[int], list[int], int]]  # request -> (drafts, parents, first token offset)
    slots: np.ndarray  # the step's slot of each batch token

    def settle(self, kv_cache: torch.Tensor, aux: torch.Tensor | None,
               sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """Compact each tree's accepted branch; returns its accepted nodes per request."""
        accepted = {}
        for rid, (drafts, parents, start) in self.trees.items():
            if sampled.get(rid):
                accepted[rid] = nodes = accepted_nodes(drafts, parents, sampled[rid])
                compact(kv_cache, aux, self.slots, start, nodes)
        return accepted
