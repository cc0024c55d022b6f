"""Prompt lookup ("ngram") drafts: find the request's latest earlier
occurrence of its own suffix and propose the tokens that followed it.

Only the request's own tokens (prompt + output) are searched, never another
request's: drafts must not leak one tenant's text into another's timing.

One vectorised pass per step, O(prompt_lookup_max * context) in numpy::

    tokens   t0 t1 ... tj ... t(L-2) | t(L-1)        suffix ends at L-1
    eq[m, j] = tokens[j - m] == tokens[L-1 - m]      m = 0 .. max-1
    match[j] = leading run of True down column j     (cumprod over m)

The candidate end ``j`` with the longest match (capped at max, at least
min) wins, the latest on ties; the draft is ``tokens[j+1 : j+1+k]``.
"""
from __future__ import annotations

import numpy as np

from kvferry.core.request import Request


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def propose(self, request: Request) -> list[int]:
        return propose_ngram(request.all_token_ids, self.k, self.max_n, self.min_n)


def propose_ngram(token_ids: list[int] | np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """Up to ``k`` tokens following the latest earlier match of the longest
    suffix of ``token_ids`` of length in [min_n, max_n]; [] when none."""
    tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    ends = np.arange(length - 1)  # candidate match ends j, each followed by >= 1 token
    run = np.ones(length - 1, dtype=bool)  # [L-1]: column j still matching
    match_len = np.zeros(length - 1, dtype=np.int64)  # [L-1]
    for m in range(min(max_n, length - 1)):
        # Compare tokens[j - m] with tokens[L-1-m]; j - m < 0 cannot match.
        shifted = np.full(length - 1, -1, dtype=np.int64)
        shifted[m:] = tokens[: length - 1 - m]
        run &= shifted == tokens[length - 1 - m]
        match_len += run
        if not run.any():
            break
    best = int(match_len.max())
    if best < min_n:
        return []
    j = int(ends[match_len == best][-1])  # the latest of the longest matches
    return tokens[j + 1 : j + 1 + k].tolist()
