"""User-facing results of the engine (LLM.generate, the server). No torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.types.logprobs import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (index < n)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A snapshot of a request after an engine step.

    ``new_token_ids``/``new_text`` hold only what this step added (for
    streaming); ``outputs`` hold the whole so far.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    metrics: "RequestMetrics | None" = None
    # With SamplingParams.prompt_logprobs, once the prompt is computed: one
    # entry per prompt token (None for the first, which has no context).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With SamplingParams.pooling: the prompt's embedding (L2-normalized).
    embedding: list[float] | None = None

    # Convenience accessors for the common n == 1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
