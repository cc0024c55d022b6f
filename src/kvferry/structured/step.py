"""The core's grammar side of a step: one compiler per core, one matcher per
request, and the step's token bitmask filled on a worker thread.

    grammars = StepGrammars(tokenizer, vocab_size)     # once per core
    matcher = grammars.matcher(params.structured_outputs)   # once per request
    pending = grammars.start_fill(rows)               # before the forward pass
    ...forward...
    bitmask = pending.result()                        # before sampling

The fill overlaps the forward pass: xgrammar fills masks in C++ with the GIL
released. Rows hold speculative positions too: position k of a request with
drafts is masked by the matcher's state after drafts 0..k-1, so the fill
advances through the drafts and rolls them back before returning (the
runner advances for real once verification has accepted tokens).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvferry.sampling import StructuredOutputsParams
from kvferry.structured.bitmask import allocate_bitmask
from kvferry.structured.spec import GrammarSpec

if TYPE_CHECKING:  # xgrammar (and transformers under it): ~1.3 s to import, so on first use
    from kvferry.structured.backend import GrammarCompiler, GrammarMatcher

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GrammarRow:
    """One constrained request in this step's logits."""

    first_logit: int  # index of its first logits row (1 + len(drafts) rows)
    matcher: GrammarMatcher
    drafts: list[int]


@dataclass(slots=True)
class StepBitmask:
    rows: torch.Tensor  # [R] int64: logits rows that are constrained
    bitmask: torch.Tensor  # [R, words] int32, CPU


class StepGrammars:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None  # built on first use: ~1 s for a 49k vocabulary
        self._pool: ThreadPoolExecutor | None = None

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """Raises ValueError when the grammar does not compile (the edge checks
        first, so this means the edge and the core disagree)."""
        if self._compiler is None:
            from kvferry.structured.backend import GrammarCompiler

            self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size)
        return self._compiler.matcher(GrammarSpec.from_params(params))

    def start_fill(self, rows: list[GrammarRow]) -> "Future[StepBitmask]":
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvferry-grammar")
        return self._pool.submit(fill_bitmask, rows, self.vocab_size)


def fill_bitmask(rows: list[GrammarRow], vocab_size: int) -> StepBitmask:
    num_rows = sum(len(r.drafts) + 1 for r in rows)
    bitmask = allocate_bitmask(num_rows, vocab_size)  # [R, words], all allowed
    logit_rows: list[int] = []
    for r in rows:
        base = len(logit_rows)
        logit_rows.extend(range(r.first_logit, r.first_logit + len(r.drafts) + 1))
        advanced = 0
        for k in range(len(r.drafts) + 1):
            r.matcher.fill_bitmask(bitmask, base + k)
            # A draft the grammar refuses is masked out at its own position,
            # so verification rejects it there; later rows are never used.
            if k == len(r.drafts) or not r.matcher.accept_token(r.drafts[k]):
                break
            advanced += 1
            # A draft that ends the grammar (its stop token) ends the request
            # if kept: the rows after it are never used, and a terminated
            # matcher has no mask to give (xgrammar raises).
            if r.matcher.is_terminated:
                break
        if advanced:
            r.matcher.rollback(advanced)
    return StepBitmask(torch.tensor(logit_rows, dtype=torch.int64), bitmask)
