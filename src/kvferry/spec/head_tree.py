"""Draft trees from a draft head (EAGLE-2's dynamic draft tree, Li et al. 2024).

A head drafting a path bets each position on its single most likely token;
where it hesitates between two, the second never gets verified. A tree of
the same k tokens spends them where the head's own probabilities say they
are most likely to hold: each node's *score* is the product of the head's
probabilities along its path from the root (a log sum here), the head's
estimate that the target accepts the whole path.

Built a depth at a time, every request of the step together::

    depth 1   one row per request: (its newest token, its state) -> the head's
              distribution q over the next token; its top ``width`` tokens
              become candidates, score log q
    depth d   the frontier: of the candidates depth d - 1 made, the ``width``
              best that can still matter (score above the k-th best score so
              far: a child scores below its parent, so nothing under a node
              at or below that line can enter the top k); one batched head
              forward over every request's frontier rows, each row a node
              (its token, its parent row's state); top ``width`` children each

and stops at depth k or when no frontier is left. The tree is the k
candidates of highest score, best first (ties: the earlier made, so a parent,
whose score is at least its child's, always precedes it): every prefix is
the best tree of its size, as ``spec.tree`` wants of a proposer. The cost of a
step is one head forward per depth over at most ``width`` rows a request (at
batch 1 a few rows cost about what one does: the weights are read once).

The nodes are deterministic guesses (a function of the context), so the
verifier walks them with one-hot semantics (``spec.tree``): SpecInfer's
multi-branch rejection sampling, exact for greedy, seeded and unseeded
sampling alike. A request's distribution q is not used for verification
(a path drafted for a sampling request is verified against q instead, which
accepts more often where q resembles p). A tree that did not branch goes
to the verifier as a path of deterministic drafts (the same verdicts).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvferry.model.input_batch import InputBatch
from kvferry.spec.draft_model import DraftRequest, DraftVocab, Proposal
from kvferry.spec.tree import is_chain

WIDTH = 4  # children tried per expanded node, and nodes expanded per depth (per request)


@dataclass(slots=True)
class _Tree:
    request: DraftRequest
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # the head row (of its depth) whose state a node's children read
    frontier: list[int] = field(default_factory=list)  # nodes made at the last depth


def wants_tree(request: DraftRequest) -> bool:
    """Requests drafted as trees: more than one draft, and no grammar (its
    bitmask follows one path of drafts)."""
    return request.num_drafts > 1 and request.params.structured_outputs is None


def draft_trees(batch: InputBatch, requests: list[DraftRequest], newest: torch.Tensor,
                step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                vocab: DraftVocab | None, width: int | None = None) -> dict[str, Proposal]:
    """One tree of ``num_drafts`` nodes per request, written into each
    request's batch row (over the scheduler's placeholders) in the tree's
    order. ``newest`` [A]: each request's newest token; ``step(tokens [R],
    sources [R])`` runs the head over R rows, row r reading ``tokens[r]`` and
    the state of row ``sources[r]`` of the previous call (the first call:
    of the requests, in order), and returns their logits [R, V or D]."""
    width = width or WIDTH
    trees = [_Tree(r) for r in requests]
    tokens, sources = newest, torch.arange(len(requests))
    owners = [(j, -1) for j in range(len(requests))]  # (tree, node expanded: -1 the root) per row
    for depth in range(max(r.num_drafts for r in requests)):
        logp = torch.log_softmax(step(tokens, sources).float(), dim=-1)
        top_p, top_i = logp.topk(min(width, logp.shape[-1]), dim=-1)  # [R, w]
        if vocab is not None:
            top_i = vocab.ids[top_i]
        top_p, top_i = top_p.tolist(), top_i.tolist()
        for tree in trees:
            tree.frontier = []
        for row, (j, node) in enumerate(owners):
            tree = trees[j]
            base = tree.scores[node] if node >= 0 else 0.0
            for p, t in zip(top_p[row], top_i[row]):
                tree.frontier.append(len(tree.tokens))
                tree.tokens.append(t)
                tree.parents.append(node)
                tree.scores.append(base + p)
                tree.rows.append(row)
        next_tokens, next_sources, owners = [], [], []
        for j, tree in enumerate(trees):
            k = tree.request.num_drafts
            if depth + 1 >= k or not tree.frontier:
                continue
            line = sorted(tree.scores, reverse=True)[k - 1] if len(tree.scores) >= k else float("-inf")
            best = sorted(tree.frontier, key=lambda n: -tree.scores[n])[:width]
            for n in best:
                if tree.scores[n] > line:
                    next_tokens.append(tree.tokens[n])
                    next_sources.append(tree.rows[n])
                    owners.append((j, n))
        if not owners:
            break
        tokens = torch.tensor(next_tokens, dtype=torch.int64, device=newest.device)
        sources = torch.tensor(next_sources, dtype=torch.int64)
    return {tree.request.request_id: _proposal(batch, tree) for tree in trees}


def _proposal(batch: InputBatch, tree: _Tree) -> Proposal:
    """The k best nodes, best first (ties: the earlier made), parents renumbered."""
    r = tree.request
    order = sorted(range(len(tree.tokens)), key=lambda n: (-tree.scores[n], n))[: r.num_drafts]
    index = {n: i for i, n in enumerate(order)}
    tokens = [tree.tokens[n] for n in order]
    parents = [index[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in order]
    batch.token_ids[r.row, r.end : r.end + len(tokens)] = tokens
    # A tree that did not branch is a path: verified as one, its step needs
    # no ancestor mask and no KV compaction of the accepted branch.
    return Proposal(tokens, None, None if is_chain(parents) else parents)
