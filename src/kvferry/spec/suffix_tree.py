"""A depth-bounded suffix trie with frequency counts (SuffixDecoding's
structure), pure Python, grown one token at a time.

It holds sequences of token ids. Every suffix of every sequence is a path
from the root, cut at ``max_depth`` tokens; a node's ``count`` is how many
suffixes reach it, so ``child.count / node.count`` is the empirical
probability that the text seen so far continues with that child's token.

Memory: a materialised node per (distinct substring, depth) would cost
~``max_depth`` nodes a token of unique text. So a path that only one
suffix takes is kept as a *leaf*: a reference into that suffix's own
sequence instead of a chain of nodes::

    root ─a─▶ Node(count 3) ─b─▶ Node(2) ─c─▶ Leaf(seq 7, start 12, end 30)
                               └─x─▶ Leaf(seq 2, start 41, end 56)

A leaf's tokens are ``seq.tokens[start:min(end, len(seq.tokens))]``: its
end is open while the sequence grows, as in Ukkonen's algorithm, and
``end`` is where the suffix reaches ``max_depth``. A second suffix that
walks into a leaf splits off its first token as a node of count 2.

Growing a sequence by one token advances each of its *cursors*: the
suffixes still walking through shared nodes (a suffix that reached its own
leaf grows with the leaf and needs no work). So a token costs O(cursors),
at most ``max_depth`` dict operations on repetitive text and ~1 on fresh
text. Removing a sequence walks each of its suffixes back down, O(length x
depth), and leaves the trie exactly as if it had never been added.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


class _Node:
    """A node with ``count`` suffixes through it. Most nodes have one child
    (a path two suffixes share): that child sits in ``one`` under token
    ``best``, with no dict, which would cost ~3x the node itself; a node
    with several keeps them in ``children`` and ``best`` names one of the
    highest count (the child a draft follows)."""

    __slots__ = ("count", "children", "best", "one")

    def __init__(self, count: int) -> None:
        self.count = count
        self.children: dict[int, _Node | _Leaf] | None = None  # two children or more
        self.best: int | None = None
        self.one: _Node | _Leaf | None = None  # the only child, under ``best``

    def child(self, token: int) -> "_Node | _Leaf | None":
        if self.children is not None:
            return self.children.get(token)
        return self.one if self.best == token else None

    def put(self, token: int, child: "_Node | _Leaf") -> None:
        """Add or replace the child under ``token`` (``best`` is the caller's)."""
        if self.children is not None:
            self.children[token] = child
        elif self.best is None or self.best == token:
            self.best, self.one = token, child
        else:
            self.children, self.one = {self.best: self.one, token: child}, None

    def drop(self, token: int) -> None:
        children = self.children
        if children is None:
            self.best = self.one = None
            return
        del children[token]
        if len(children) == 1:
            (self.best, self.one), self.children = next(iter(children.items())), None
        elif self.best == token:
            self.best = max(children.items(), key=lambda item: item[1].count)[0]

    def items(self) -> "list[tuple[int, _Node | _Leaf]]":
        if self.children is not None:
            return list(self.children.items())
        return [] if self.best is None else [(self.best, self.one)]

    def __bool__(self) -> bool:  # has a child
        return self.best is not None


class _Leaf:
    """One suffix's own tail: ``seq.tokens[start:min(end, len)]``, count 1."""

    __slots__ = ("seq", "start", "end")
    count = 1

    def __init__(self, seq: "_Sequence", start: int, end: int) -> None:
        self.seq = seq
        self.start = start
        self.end = end


@dataclass(slots=True, eq=False)
class _Sequence:
    seq_id: object
    tokens: list[int] = field(default_factory=list)
    # Suffixes still walking through shared nodes: [node, suffix start].
    cursors: list[list] = field(default_factory=list)
    live: bool = True  # may still grow (``SuffixTree.close`` ends it)
    removed: int = 0  # suffixes already removed (``SuffixTree.remove``), the earliest


@dataclass(slots=True, frozen=True)
class Match:
    """Where a pattern ends in the trie: at ``node``, or inside ``leaf``
    with its next token at ``leaf.seq.tokens[pos]``."""

    length: int
    node: _Node | None = None
    leaf: _Leaf | None = None
    pos: int = 0

    def has_continuation(self) -> bool:
        if self.node is not None:
            return bool(self.node)
        leaf = self.leaf
        return self.pos < min(leaf.end, len(leaf.seq.tokens))


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(0)
        self.sequences: dict[object, _Sequence] = {}
        self.num_tokens = 0  # tokens held, over all sequences
        self.num_nodes = 0  # materialised nodes (leaves not counted)

    # -- growing ----------------------------------------------------------------
    def extend(self, seq_id: object, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (a new one if unknown)."""
        seq = self.sequences.get(seq_id)
        if seq is None:
            seq = self.sequences[seq_id] = _Sequence(seq_id)
        elif not seq.live:
            raise ValueError(f"sequence {seq_id!r} was closed")
        for token in tokens:
            self._append(seq, token)

    def _append(self, seq: _Sequence, token: int) -> None:
        toks = seq.tokens
        i = len(toks)
        toks.append(token)
        self.num_tokens += 1
        self.root.count += 1
        depth_cap = self.max_depth
        seq.cursors.append([self.root, i])  # the suffix starting at this token
        kept = []
        for cursor in seq.cursors:
            node, start = cursor
            children = node.children
            if children is None:
                child = node.one if node.best == token else None
            else:
                child = children.get(token)
            depth = i - start + 1  # the depth the suffix reaches with this token
            if child is None:
                node.put(token, _Leaf(seq, i, start + depth_cap))
                continue  # the suffix grows inside its own leaf from now on
            if type(child) is _Leaf:
                child = self._split(node, token, child)
            child.count += 1
            best = node.best
            if best != token and child.count > node.children[best].count:  # only a dict node has another best
                node.best = token
            if depth < depth_cap:
                cursor[0] = child
                kept.append(cursor)
        seq.cursors = kept

    def _split(self, parent: _Node, token: int, leaf: _Leaf) -> _Node:
        """Turn ``leaf``'s first token into a node of count 1 (its owner),
        the rest of it a leaf below; the caller counts the newcomer."""
        node = _Node(1)
        self.num_nodes += 1
        parent.put(token, node)
        rest = leaf.start + 1
        if rest >= leaf.end:
            return node  # the owner's suffix reached max_depth here
        if rest < len(leaf.seq.tokens):
            node.put(leaf.seq.tokens[rest], _Leaf(leaf.seq, rest, leaf.end))
        elif leaf.seq.live:
            # The owner is a sequence still growing, at its last token: its
            # suffix walks on from this node when its next token comes. (Not
            # the sequence being appended to: its suffixes sit at different
            # depths, so none walks into a leaf made in the same append.)
            leaf.seq.cursors.append([node, leaf.end - self.max_depth])
        return node

    def close(self, seq_id: object) -> None:
        """``seq_id`` will not grow again: its suffixes stop walking."""
        seq = self.sequences.get(seq_id)
        if seq is not None:
            seq.live = False
            seq.cursors = []

    # -- removing ---------------------------------------------------------------
    def remove(self, seq_id: object, max_suffixes: int | None = None) -> int:
        """Drop a closed sequence and every count it added, ``max_suffixes``
        of its suffixes at a time (None: all), the earliest first; returns
        how many were dropped (0: no such sequence). Until the last one goes
        the trie holds the suffixes of a later start only, which is a
        consistent trie (a suffix's own later suffixes are there too)."""
        seq = self.sequences.get(seq_id)
        if seq is None:
            return 0
        if seq.live:
            raise ValueError(f"sequence {seq_id!r} is still growing: close it first")
        toks = seq.tokens
        n = len(toks)
        stop = n if max_suffixes is None else min(n, seq.removed + max_suffixes)
        for start in range(seq.removed, stop):
            self._remove_suffix(toks, start, min(n, start + self.max_depth))
        done = stop - seq.removed
        seq.removed = stop
        self.root.count -= done
        self.num_tokens -= done
        if stop == n:
            del self.sequences[seq_id]
        return done

    def _remove_suffix(self, toks: list[int], start: int, stop: int) -> None:
        node = self.root
        for i in range(start, stop):
            token = toks[i]
            child = node.child(token)
            if type(child) is _Leaf or child.count == 1:
                # Only this suffix goes on from here: drop the whole branch.
                node.drop(token)
                if type(child) is _Node:
                    self.num_nodes -= _count_nodes(child)
                return
            child.count -= 1
            if node.children is not None and node.best == token:
                node.best = _best_child(node)
            node = child

    # -- reading ----------------------------------------------------------------
    def walk(self, pattern: list[int]) -> Match | None:
        """Where ``pattern`` ends, or None when the trie does not hold it."""
        node = self.root
        n = len(pattern)
        i = 0
        while i < n:
            child = node.child(pattern[i])
            if child is None:
                return None
            if type(child) is _Node:
                node = child
                i += 1
                continue
            start, stop = child.start, min(child.end, len(child.seq.tokens))
            m = n - i
            if start + m > stop or child.seq.tokens[start : start + m] != pattern[i:]:
                return None
            return Match(n, leaf=child, pos=start + m)
        return Match(n, node=node)

    def longest_match(self, context: list[int], max_len: int) -> Match | None:
        """The longest suffix of ``context`` (at most ``max_len`` tokens)
        that the trie holds with a token after it. Having a continuation is
        monotone in the length (a shorter suffix of an earlier occurrence
        occurred too, followed by the same token), so a binary search finds
        it in O(log max_len) walks."""
        lo, hi = 0, min(max_len, len(context), self.max_depth - 1)
        best = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            match = self.walk(context[len(context) - mid :])
            if match is not None and match.has_continuation():
                lo, best = mid, match
            else:
                hi = mid - 1
        return best

    def draft(self, match: Match, max_tokens: int, min_prob: float) -> tuple[list[int], float, list[object]]:
        """The most frequent path after ``match``: at each node the child with
        the highest count, while the path's probability (the product of
        ``child.count / node.count``) stays at least ``min_prob``. Returns
        the tokens, their expected number accepted (the sum of the path's
        probabilities) and the ids of the sequences whose leaves it read."""
        tokens: list[int] = []
        score, prob = 0.0, 1.0
        used: list[object] = []
        node, leaf, pos = match.node, match.leaf, match.pos
        if leaf is not None:
            used.append(leaf.seq.seq_id)
        while len(tokens) < max_tokens:
            if leaf is None:
                token = node.best
                if token is None:
                    break
                child = node.child(token)
                p = prob * child.count / node.count
                if p < min_prob:
                    break
                prob = p
                tokens.append(token)
                score += prob
                if type(child) is _Node:
                    node = child
                    continue
                leaf, pos = child, child.start + 1
                used.append(child.seq.seq_id)
                continue
            # Inside a leaf one suffix continues: probability 1 a token.
            stop = min(leaf.end, len(leaf.seq.tokens), pos + max_tokens - len(tokens))
            run = leaf.seq.tokens[pos:stop]
            if not run:
                break
            tokens.extend(run)
            score += prob * len(run)
            break
        return tokens, score, used

    def draft_tree(self, match: Match, max_tokens: int, max_depth: int,
                   min_prob: float) -> tuple[list[int], list[int], float, list[object]]:
        """SuffixDecoding's tree: the ``max_tokens`` continuations of ``match``
        with the highest path probabilities (best first, so that parents
        come before children and each prefix is the best tree of its size),
        each at most ``max_depth`` deep and at least ``min_prob`` likely.
        Returns the tokens, their parents (-1: after the match), the
        expected number accepted (the sum of the nodes' probabilities) and
        the ids of the sequences whose leaves it read."""
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        used: list[object] = []
        # (-probability, tie-break, parent index, depth, token, where it leads)
        heap: list[tuple] = []
        order = itertools.count()

        def push(state: tuple, parent: int, depth: int, prob: float) -> None:
            if depth >= max_depth:
                return
            node, leaf, pos = state
            if leaf is not None:
                if pos < min(leaf.end, len(leaf.seq.tokens)):  # one suffix goes on: probability 1
                    heapq.heappush(heap, (-prob, next(order), parent, depth, leaf.seq.tokens[pos],
                                          (None, leaf, pos + 1)))
                return
            for token, child in node.items():
                p = prob * child.count / node.count
                if p >= min_prob:
                    nxt = (child, None, 0) if type(child) is _Node else (None, child, child.start + 1)
                    heapq.heappush(heap, (-p, next(order), parent, depth, token, nxt))

        if match.leaf is not None:
            used.append(match.leaf.seq.seq_id)
        push((match.node, match.leaf, match.pos), -1, 0, 1.0)
        while heap and len(tokens) < max_tokens:
            neg, _, parent, depth, token, state = heapq.heappop(heap)
            index = len(tokens)
            tokens.append(token)
            parents.append(parent)
            score -= neg
            if state[1] is not None and state[1].seq.seq_id not in used:
                used.append(state[1].seq.seq_id)
            push(state, index, depth + 1, -neg)
        return tokens, parents, score, used

    def check_integrity(self) -> None:
        """Counts add up: a node's count is at least its children's sum (the
        rest are suffixes that end there), every best child has the highest
        count, and the node and token tallies match (tests call this)."""
        nodes = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            items = node.items()
            counts = {t: c.count for t, c in items}
            assert sum(counts.values()) <= node.count, (node.count, counts)
            assert (node.children is None) == (len(items) < 2) and (node.one is None) == (len(items) != 1)
            if counts:
                assert counts[node.best] == max(counts.values())
            for _, child in items:
                if type(child) is _Node:
                    nodes += 1
                    stack.append(child)
        assert nodes == self.num_nodes, (nodes, self.num_nodes)
        assert self.num_tokens == sum(len(s.tokens) - s.removed for s in self.sequences.values())


def _best_child(node: _Node) -> int | None:
    items = node.items()
    return max(items, key=lambda item: item[1].count)[0] if items else None


def _count_nodes(node: _Node) -> int:
    n, stack = 0, [node]
    while stack:
        cur = stack.pop()
        n += 1
        stack.extend(c for _, c in cur.items() if type(c) is _Node)
    return n
