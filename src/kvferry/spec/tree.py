"""Draft trees: several continuations of a request verified in one pass.

A tree of n draft tokens is its tokens plus ``parents``: ``parents[i]`` is
the draft index of token i's parent, or -1 where token i follows the
request's newest token (the *root*, which the step computes anyway). A
parent always comes before its children (``parents[i] < i``), so any prefix
of a tree is a tree: the scheduler's cuts (the controller's k, the tokens
left under ``max_tokens``) keep it valid, and a proposer that adds nodes
best-first makes each prefix the best tree of its size.

The verify pass computes the root and the n nodes as one chunk: node i sits
at position ``root + depth(i)`` and attends to the committed context and to
its ancestors only (``ancestor_mask``). Row 0 of the step's logits is the
root's, row 1 + i node i's. Verification then walks from the root: at each
node the target's token there (its argmax, or its sample) either is one of
the node's children, which is accepted and walked into, or is emitted as
the last token. For drafts without a distribution (suffix decoding's) this
is multi-branch rejection sampling with one-hot drafts (SpecInfer): trying
the children in turn, child c is accepted with probability p(c) and the
residual is p without the children tried, so the token emitted at a node is
an exact sample of p there, whichever child it lands on. Every node's token
is sampled with the noise of its depth's output position, and only one node
per depth is ever walked, so a seeded request still gets plain decoding's
tokens.

Pure Python (the torch-free scheduler's proposers build trees).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class DraftTree(list):
    """Draft tokens (a ``list[int]``, so every caller of a chain's drafts
    reads it) with their ``parents``. Slicing keeps the tree: the scheduler
    cuts drafts with ``[:k]``."""

    __slots__ = ("parents",)

    def __init__(self, tokens: Sequence[int] = (), parents: Sequence[int] = ()) -> None:
        super().__init__(tokens)
        if len(parents) != len(self):
            raise ValueError(f"a draft tree needs one parent a token: {len(self)} tokens, {len(parents)} parents")
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(f"draft tree: parent {parent} of token {i} must be in [-1, {i})")
        self.parents = list(parents)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if start != 0 or step != 1:
                raise ValueError("a draft tree is cut only to a prefix")
            return DraftTree(list.__getitem__(self, index), self.parents[:stop])
        return list.__getitem__(self, index)

    def is_chain(self) -> bool:
        return is_chain(self.parents)

    def first_branch(self) -> list[int]:
        """The path through each node's first child: a chain of the tree's tokens."""
        return [self[i] for i in first_branch(self.parents)]


def is_chain(parents: Sequence[int]) -> bool:
    return all(parent == i - 1 for i, parent in enumerate(parents))


def first_branch(parents: Sequence[int]) -> list[int]:
    """Node indices of the path that always takes the first child."""
    path, last = [], -1
    for i, parent in enumerate(parents):
        if parent == last:
            path.append(i)
            last = i
    return path


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (a child of the root: 1)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """[n + 1, n + 1] bool over (root, nodes): row r may attend to column c
    when c is r itself or one of its ancestors (the root is everyone's)."""
    n = len(parents)
    mask = np.zeros((n + 1, n + 1), dtype=bool)
    mask[:, 0] = True
    mask[0, 0] = True
    for i, parent in enumerate(parents):
        row = i + 1
        if parent >= 0:
            mask[row] = mask[parent + 1]
        mask[row, row] = True
    return mask


def paths_to(parents: Sequence[int]) -> list[list[int]]:
    """For each row (root, then each node): the node indices from the root
    down to it, itself included (the root's: empty)."""
    out: list[list[int]] = [[]]
    for i, parent in enumerate(parents):
        out.append(out[parent + 1] + [i])
    return out


def _children(drafts: Sequence[int], parents: Sequence[int]) -> dict[tuple[int, int], int]:
    children: dict[tuple[int, int], int] = {}
    for i, (token, parent) in enumerate(zip(drafts, parents)):
        children.setdefault((parent, token), i)  # a repeated sibling: the first
    return children


def walk(drafts: Sequence[int], parents: Sequence[int], row_tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    """The tokens a request emits from its n + 1 verified rows (root, then
    each node) and the accepted nodes: from the root, follow the child
    equal to the current row's token while there is one; the last row's
    token ends the walk. len(emitted) = len(accepted) + 1."""
    children = _children(drafts, parents)
    emitted, accepted, node = [], [], -1
    while True:
        token = row_tokens[node + 1]
        emitted.append(token)
        child = children.get((node, token))
        if child is None:
            return emitted, accepted
        accepted.append(child)
        node = child


def accepted_nodes(drafts: Sequence[int], parents: Sequence[int], emitted: Sequence[int]) -> list[int]:
    """The nodes ``walk`` accepted, from the tokens it emitted: a rank that
    verified the tree but did not sample learns its branch so (each emitted
    token but the last is the child the walk went into)."""
    children = _children(drafts, parents)
    nodes, node = [], -1
    for token in emitted[:-1]:
        node = children.get((node, token), -2)
        if node == -2:  # not a walk of this tree: nothing accepted past here
            break
        nodes.append(node)
    return nodes


def held(drafts: Sequence[int], parents: Sequence[int] | None, new: Sequence[int]) -> int:
    """How many tokens of a draft (a chain, or a tree with ``parents``) the
    tokens that came after it (``new``, in order) would have accepted."""
    if parents is None:
        parents = range(-1, len(drafts) - 1)
    children = _children(drafts, parents)
    node = -1
    for n, token in enumerate(new):
        node = children.get((node, token), -2)
        if node == -2:
            return n
    return len(new)
