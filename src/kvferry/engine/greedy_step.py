"""A step's tokens where every row is plain greedy, without the sampler's batch.

At batch 1 a decode step of a small quantized model is ~10 ms, and the
general sampler spent ~0.4 ms of it on one greedy row: the knob table as
tensors, a SamplingRow and its generator per row, the min_tokens scan, the
penalty and grammar checks. Where none of those can act (no grammar,
greedy, no penalties, no logprobs, min_tokens reached) the sampler gives
the rows' argmax, clamped into the vocabulary: ``plain_greedy_tokens``
computes exactly that, the same argmax kernel on the same float32 logits.

A verify step's rows too (``with_drafts``): where no draft carries a
distribution q, ``Sampler.verify`` over all-greedy rows is that argmax at
every row (p is one-hot there; a draft holds exactly when it equals it),
and the runner accepts and walks from those tokens as from the sampler's.
A speculative step at batch 1 spent ~0.6 ms in the sampler for its 1 + k
rows against ~0.2 for a plain step's one.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kvferry.model.fused_ops import argmax_rows

if TYPE_CHECKING:
    from kvferry.engine.runner import RequestState


def plain_greedy_tokens(logits: torch.Tensor, sampling: list[tuple[str, list[int]]],
                        states: Mapping[str, RequestState], vocab_size: int,
                        with_drafts: bool = False) -> list[int] | None:
    """One token per row of ``logits`` [rows, V] (a request of ``sampling``
    has 1 + len(drafts) rows), as Sampler gives them, or None where some row
    needs the sampler (a grammar, temperature, penalties, logprobs, or
    min_tokens still banning its stop ids; drafts, unless ``with_drafts``:
    the caller's word that none of them has a distribution q)."""
    rows = 0
    for rid, drafts in sampling:
        state = states[rid]
        params = state.params
        if ((drafts and not with_drafts) or not params.greedy or state.penalizes or params.logprobs is not None
                or state.matcher is not None or len(state.output_token_ids) < params.min_tokens):
            return None
        rows += 1 + len(drafts)
    if logits.shape != (rows, vocab_size):
        return None  # the sampler raises on it
    # The sampler's clamp into the vocabulary is the identity here: the logits are vocab_size wide.
    return argmax_rows(logits.float()).tolist()
