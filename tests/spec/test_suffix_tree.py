"""The suffix trie against the rule spelled out by brute force: every
substring of at most ``max_depth`` tokens, counted once per suffix start,
through growth (several sequences at once), closing and removal in slices."""
from __future__ import annotations

import collections
import random

import pytest

from kvferry.spec.suffix_tree import SuffixTree, _Node


def reference(seqs: list[tuple[list[int], int]], depth: int) -> dict[tuple[int, ...], int]:
    """Substring -> how many suffixes (from each sequence's first kept start) begin with it."""
    counts: collections.Counter = collections.Counter()
    for tokens, first in seqs:
        for start in range(first, len(tokens)):
            for n in range(1, min(depth, len(tokens) - start) + 1):
                counts[tuple(tokens[start : start + n])] += 1
    return dict(counts)


def paths(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """Every path the trie holds, with its count (a leaf's tokens count 1)."""
    out = {}
    stack = [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for token, child in node.items():
            path = prefix + (token,)
            if type(child) is _Node:
                out[path] = child.count
                stack.append((child, path))
                continue
            run = child.seq.tokens[child.start : min(child.end, len(child.seq.tokens))]
            for j in range(len(run)):
                out[path + tuple(run[1 : j + 1])] = 1
    return out


@pytest.mark.parametrize("seed", range(6))
def test_counts_match_brute_force_through_growth_and_removal(seed):
    rng = random.Random(seed)
    for _ in range(60):
        depth, vocab = rng.choice([2, 3, 4, 6, 8]), rng.choice([2, 3, 5, 20])
        tree = SuffixTree(depth)
        seqs: dict[int, list[int]] = {}
        removed: dict[int, int] = {}
        for _ in range(rng.randrange(1, 9)):
            if rng.random() < 0.7 or not seqs:
                sid = rng.randrange(4)
                if sid in seqs and not tree.sequences[sid].live:
                    continue
                tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 15))]
                tree.extend(sid, tokens)  # sequences grow interleaved
                seqs.setdefault(sid, []).extend(tokens)
                if rng.random() < 0.3:
                    tree.close(sid)
            else:
                sid = rng.choice(list(seqs))
                tree.close(sid)
                removed[sid] = removed.get(sid, 0) + tree.remove(sid, rng.choice([None, 1, 3]))
                if sid not in tree.sequences:
                    del seqs[sid], removed[sid]
            assert paths(tree) == reference([(t, removed.get(s, 0)) for s, t in seqs.items()], depth)
            tree.check_integrity()
        for sid in list(seqs):
            tree.close(sid)
            tree.remove(sid)
        assert not tree.root and tree.num_nodes == 0 and tree.num_tokens == 0


def test_a_growing_sequence_cannot_be_removed_nor_a_closed_one_grown():
    tree = SuffixTree(4)
    tree.extend("a", [1, 2, 3])
    with pytest.raises(ValueError, match="close it first"):
        tree.remove("a")
    tree.close("a")
    with pytest.raises(ValueError, match="closed"):
        tree.extend("a", [4])


def ref_longest(seqs: list[list[int]], context: list[int], max_len: int, depth: int) -> int:
    """Longest suffix of context (<= max_len, < depth) occurring with a next token."""
    best = 0
    for n in range(1, min(max_len, len(context), depth - 1) + 1):
        pattern = context[len(context) - n :]
        if any(t[s : s + n] == pattern for t in seqs for s in range(len(t) - n)):
            best = n
    return best


@pytest.mark.parametrize("seed", range(4))
def test_longest_match_is_the_longest_suffix_with_a_continuation(seed):
    rng = random.Random(100 + seed)
    for _ in range(200):
        depth, vocab = rng.choice([3, 5, 8]), rng.choice([2, 3, 6])
        tree = SuffixTree(depth)
        seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 20))] for _ in range(rng.randrange(1, 4))]
        for i, s in enumerate(seqs):
            tree.extend(i, s)
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        max_len = rng.randrange(1, 10)
        match = tree.longest_match(context, max_len)
        assert (match.length if match else 0) == ref_longest(seqs, context, max_len, depth)


def test_draft_follows_the_most_frequent_continuation_while_likely():
    tree = SuffixTree(8)
    # After [1, 2]: 3 follows three times, 9 once; after [1, 2, 3]: 4 4 5, then once 6.
    for i, seq in enumerate(([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 9])):
        tree.extend(i, seq)
        tree.close(i)
    match = tree.longest_match([7, 1, 2], 8)
    assert match.length == 2
    tokens, score, _ = tree.draft(match, 8, 0.0)
    assert tokens == [3, 4, 5]
    assert score == pytest.approx(3 / 4 + 3 / 4 + (3 / 4) * (2 / 3))
    # A threshold stops the path where its probability drops under it.
    assert tree.draft(match, 8, 0.6)[0] == [3, 4]
    assert tree.draft(match, 8, 0.8)[0] == []
    assert tree.draft(match, 1, 0.0)[0] == [3]


def test_draft_reads_a_leaf_and_names_its_sequence():
    tree = SuffixTree(16)
    tree.extend("old", [5, 6, 7, 8, 9, 10])
    tree.close("old")
    match = tree.longest_match([1, 5, 6], 8)
    tokens, score, used = tree.draft(match, 3, 0.1)
    assert tokens == [7, 8, 9] and score == pytest.approx(3.0) and used == ["old"]
