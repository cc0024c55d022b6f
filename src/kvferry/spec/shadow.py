"""Shadow probes: a probe's draft scored against the tokens that came after
it, never verified.

A request whose drafts stopped paying probes every few steps to find out
whether they pay again (``spec.adaptive``). A verified probe costs a verify
step: on a CPU even one draft turns each projection from a matrix-vector
product into a matrix multiply, about a fifth of a plain step more, and a
request whose drafts fail pays it at every probe, which is what made such a
request's time per token exceed plain decoding's (the tail of the served
TPOT at batch 1). Where the scheduler sees the draft's tokens (suffix
decoding, n-gram prompt lookup: text proposers, not a head drafting in the
runner), the probe needs no verify step: the request decodes plainly, and
once its next tokens are known the draft is scored by how many of them it
would have had accepted (``spec.tree.held``: a tree by its branch that
held). Greedy, that is exactly what verification would have accepted;
sampled, a one-hot draft's token is accepted with the probability that the
sample equals it, so the score has verification's expectation.

Pure Python, O(draft) per score.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvferry.spec.tree import held


@dataclass(slots=True, frozen=True)
class ShadowDraft:
    method: str  # whose draft it is (a controller's record is per method)
    tokens: tuple[int, ...]
    parents: tuple[int, ...] | None  # a tree's (``spec.tree``); None: a chain
    base: int  # the request's token count when it was drafted: its draft follows token base - 1

    @classmethod
    def of(cls, method: str, drafts: list[int], num_tokens: int) -> "ShadowDraft":
        parents = getattr(drafts, "parents", None)
        return cls(method, tuple(drafts), None if parents is None else tuple(parents), num_tokens)

    @property
    def depth(self) -> int:
        """The longest branch: the tokens after ``base`` that decide it."""
        if self.parents is None:
            return len(self.tokens)
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return max(depths, default=0)

    def score(self, tokens: list[int]) -> int | None:
        """How many of its tokens the request's tokens since ``base`` would
        have accepted, or None while undecided (every token known so far
        matched, and its deepest branch goes on past them)."""
        new = tokens[self.base : self.base + self.depth]
        kept = held(self.tokens, self.parents, new)
        if kept == len(new) < self.depth:
            return None
        return kept
