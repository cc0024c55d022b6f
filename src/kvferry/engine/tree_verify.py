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
from kvferry.model.kv_cache_dtype import is_fp8
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


def step_trees(scheduled: dict[str, list[int]], proposals: dict) -> dict[str, list[int]]:
    """The step's draft trees: the scheduler's (suffix decoding's), but where
    the runner's drafter wrote over that request's slots, and the runner
    drafter's own (a head's, ``Proposal.parents``)."""
    trees = {rid: parents for rid, parents in scheduled.items() if rid not in proposals}
    trees.update({rid: p.parents for rid, p in proposals.items() if p.parents is not None})
    return trees


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
    if is_fp8(flat.dtype):  # torch has no index_select/index_copy_ for float8; a move is only bytes
        flat = flat.view(torch.uint8)
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
    """A pipeline stage before the last verifies draft trees but does not
    sample: its step's trees, kept until the last stage's tokens arrive
    (with rank 0's next step, or at once on rank 0), which name the branch
    that held. Its KV is then compacted as the last stage's was, before the
    next step reads it. (Tensor-parallel ranks settle within the step:
    ``share_branches``.)"""

    trees: dict[str, tuple[list[int], list[int], int]]  # request -> (drafts, parents, first token offset)
    slots: np.ndarray  # the step's slot of each batch token

    def branches(self, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """Each tree's accepted nodes, from the tokens its walk emitted."""
        return {rid: accepted_nodes(drafts, parents, sampled[rid])
                for rid, (drafts, parents, _) in self.trees.items() if sampled.get(rid)}

    def settle(self, kv_cache: torch.Tensor, aux: torch.Tensor | None, accepted: dict[str, list[int]]) -> None:
        for rid, nodes in accepted.items():
            compact(kv_cache, aux, self.slots, self.trees[rid][2], nodes)


def share_branches(group, trees: list[tuple[str, int]],  # noqa: ANN001 - a rank group (parallel/)
                   accepted: dict[str, list[int]] | None) -> dict[str, list[int]]:
    """The sampling rank's accepted nodes of each tree (``trees``: request,
    tree size; in the same order on every rank) on every rank of a
    tensor-parallel group: one float32 sum, where the rank that sampled
    fills [count, nodes..] per tree and the others (``accepted`` None) add zeros."""
    sizes = [n + 1 for _, n in trees]
    values = [0.0] * sum(sizes)
    if accepted is not None:
        start = 0
        for (rid, _), size in zip(trees, sizes):
            nodes = accepted.get(rid, [])
            values[start : start + 1 + len(nodes)] = [float(len(nodes)), *map(float, nodes)]
            start += size
    summed = group.all_reduce(torch.tensor(values, dtype=torch.float32)).tolist()
    out, start = {}, 0
    for (rid, _), size in zip(trees, sizes):
        out[rid] = [int(v) for v in summed[start + 1 : start + 1 + int(summed[start])]]
        start += size
    return out
