"""SamplingParams: what the user asks of one request's decoding. No torch here."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

_GREEDY_EPS = 1e-5
MAX_N = 128
# What a torch.Generator accepts.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Longest soft pin of a paused conversation's KV (one day).
MAX_KV_RETENTION_S = 86400.0
# Integer fields cross to the core as int64 (msgspec) and into int64 tensors.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The sampler's knobs are float32 tensors. A float64 value outside float32's
# normal range would round to 0 (a top_p of 1e-46 becomes 0 and masks every
# token) or to inf there, so such values are refused at the edge: a knob is
# either exactly 0 or has a magnitude in [FLOAT32_MIN_NORMAL, FLOAT32_MAX].
FLOAT32_MIN_NORMAL = 2.0**-126
FLOAT32_MAX = 3.4028234663852886e38


# How an embedding pools the final hidden states over the prompt.
POOLINGS = ("last", "mean")

_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's ``structured_outputs``): exactly one
    of a JSON schema, any JSON object, a regex, a choice of strings or an EBNF
    grammar. Plain data, so it crosses the process boundary inside
    SamplingParams; ``json`` is kept as canonical JSON text so that equal
    schemas make equal cache keys in the core's grammar cache.

    Checks here are structural; whether the grammar compiles is checked at the
    edge by ``kvferry.structured.spec.check_compiles`` (it needs xgrammar)."""

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style, root rule ``root``)

    def __post_init__(self) -> None:
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_KINDS)}, "
                             f"got {given or 'none'}")
        if self.json is not None:
            self.json = _canonical_schema(self.json)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))


def _canonical_schema(schema: str | dict[str, Any]) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError("structured_outputs.json must be a JSON object (a JSON Schema)")
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


@dataclass(slots=True)
class SamplingParams:
    """Field names follow vLLM's so that users find what they expect.

    Every check lives in ``__post_init__`` and raises ``ValueError`` naming the
    field, so bad input is rejected before it reaches the engine.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    skip_special_tokens: bool = True
    # Constrain the output to a grammar (None: free text).
    structured_outputs: StructuredOutputsParams | None = None
    # Keep this conversation's KV (prompt + output) in the node's KV store
    # for this many seconds after the request ends, so that the next turn
    # resumes from it: a soft pin with an expiry, bounded by the tenant's
    # quota. 0: no pin (blocks are still written down and evicted by LRU).
    kv_retention_s: float = 0.0
    # Logprobs of the prompt's own tokens: at each position after the first,
    # the prompt token's logprob, rank and the top-n (vLLM's
    # ``prompt_logprobs``; lm-eval's loglikelihood reads them through echo).
    # Such a request computes its whole prompt: it takes no prefix-cache hit.
    prompt_logprobs: int | None = None
    # Compute the prompt only: nothing is sampled, and the request finishes
    # ("length", no tokens) once its prompt is computed (echo with
    # max_tokens=0, embeddings). ``max_tokens`` is then not used.
    prompt_only: bool = False
    # Return the final hidden state (after the final norm) pooled over the
    # prompt, "last" token or "mean", L2-normalized, instead of sampling:
    # an embedding. Implies ``prompt_only``.
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.pooling is not None:
            self.prompt_only = True
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, lo=1)
        if self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_num("temperature", self.temperature, lo=0.0)
        _check_num("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, lo=0)
        _check_num("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_num("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_num(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an integer, got {self.seed!r}")
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0)
            if self.logprobs > 20:
                raise ValueError(f"logprobs must be <= 20, got {self.logprobs}")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0)
            if self.prompt_logprobs > 20:
                raise ValueError(f"prompt_logprobs must be <= 20, got {self.prompt_logprobs}")
        if not isinstance(self.prompt_only, bool):
            raise ValueError(f"prompt_only must be a boolean, got {self.prompt_only!r}")
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        _check_num("kv_retention_s", self.kv_retention_s, lo=0.0, float32=False)
        if self.kv_retention_s > MAX_KV_RETENTION_S:
            raise ValueError(f"kv_retention_s must be <= {MAX_KV_RETENTION_S}, got {self.kv_retention_s}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_prompt_positions(self) -> bool:
        """Whether the runner must compute every prompt position itself (so
        the request may not start from a prefix-cache hit or loaded KV)."""
        return self.prompt_logprobs is not None or self.pooling == "mean"

    @property
    def has_prompt_work(self) -> bool:
        """Whether the runner does anything at prompt positions besides KV."""
        return self.prompt_logprobs is not None or self.prompt_only

    def clone(self) -> "SamplingParams":
        """A copy the engine may own, so it never mutates the caller's object."""
        structured = self.structured_outputs
        return replace(self, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                       structured_outputs=replace(structured) if structured is not None else None)


def _check_int(name: str, value: object, lo: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must be a 64-bit integer (at most {INT64_MAX}), got {value}")


def _check_num(name: str, value: object, lo: float | None = None, float32: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must be finite, got {value}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if float32 and value and not FLOAT32_MIN_NORMAL <= abs(value) <= FLOAT32_MAX:
        raise ValueError(f"{name} must be 0 or have a magnitude in [{FLOAT32_MIN_NORMAL:.6g}, "
                         f"{FLOAT32_MAX:.6g}] (what the sampler's float32 can hold), got {value}")
