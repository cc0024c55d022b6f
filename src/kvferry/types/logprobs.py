"""``TokenLogprobs``: one generated (or prompt) token's logprobs, from the
sampler through the step contract and the core's outputs to the front end."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one generated token: the sampled one and the top-n."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token in the distribution
    top_token_ids: list[int]
    top_logprobs: list[float]
