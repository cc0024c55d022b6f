"""The engine <-> runner contract: plain dataclasses, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.sampling import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """Sent to the runner the first time a request is scheduled; the runner
    keeps it (and the tokens it samples) until the request finishes."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes tokens ``all_token_ids[num_computed_tokens :
    num_computed_tokens + num_scheduled_tokens]`` and writes their KV into
    ``block_ids`` at the same positions.
    """

    request_id: str
    num_computed_tokens: int
    # The tokens to compute this step: all_token_ids[num_computed_tokens:][:n]
    token_ids: list[int]
    # The request's whole block table (hit blocks first, then its own).
    block_ids: list[int]
    # True when this chunk reaches the end of the known tokens, so the runner
    # samples a next token for it. False for a non-final prefill chunk.
    sample: bool


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Requests finished (or preempted) since the last step: the runner drops
    # its per-request state (e.g. a seeded generator) for finished ones.
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: len(s.token_ids) for s in self.scheduled}

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one generated token: the sampled one and the top-n."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token in the distribution
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class RunnerOutput:
    # request_id -> sampled token id, only for requests with sample=True
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
