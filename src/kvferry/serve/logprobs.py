"""Engine TokenLogprobs -> the two OpenAI logprobs formats.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
Completions (legacy): parallel lists ``tokens``, ``token_logprobs``,
``top_logprobs`` (token -> logprob dicts) and ``text_offset``.

A token's string is its own decode. For a token holding part of a UTF-8
character that is U+FFFD, as in vLLM; its ``bytes`` are still the token's
real bytes, so that a client can rebuild the text from them. The text of the
completion is always decoded as a whole and is exact.
"""
from __future__ import annotations

import math
from typing import Any

from kvferry.core.outputs import TokenLogprobs
from kvferry.serve.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, TopLogprob

# JSON has no -inf; vLLM clamps to the same value.
_MIN_LOGPROB = -9999.0


class TokenStrings:
    """Cached single-token decodes (the same few thousand tokens recur)."""

    def __init__(self, tokenizer: Any, max_size: int = 65536) -> None:
        self.tokenizer = tokenizer
        self.max_size = max_size
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < self.max_size:
                self._cache[token_id] = text
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = list(self.tokenizer.token_bytes(token_id))
            if len(self._bytes) < self.max_size:
                self._bytes[token_id] = raw
        return raw


def _clamp(logprob: float) -> float:
    if math.isnan(logprob):
        return _MIN_LOGPROB
    return max(logprob, _MIN_LOGPROB)


def chat_logprobs(entries: list[TokenLogprobs], strings: TokenStrings) -> ChatLogprobs:
    content = []
    for e in entries:
        token = strings(e.token_id)
        top = [
            TopLogprob(token=strings(tid), logprob=_clamp(lp), bytes=strings.bytes(tid))
            for tid, lp in zip(e.top_token_ids, e.top_logprobs)
        ]
        content.append(ChatTokenLogprob(token=token, logprob=_clamp(e.logprob),
                                        bytes=strings.bytes(e.token_id), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(entries: list[TokenLogprobs], strings: TokenStrings, text_offset: int) -> CompletionLogprobs:
    """``text_offset`` is where the first of these tokens starts in the
    returned text (non-zero for later chunks of a stream)."""
    out = CompletionLogprobs()
    offset = text_offset
    for e in entries:
        token = strings(e.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(_clamp(e.logprob))
        top = {strings(tid): _clamp(lp) for tid, lp in zip(e.top_token_ids, e.top_logprobs)}
        top.setdefault(token, _clamp(e.logprob))  # OpenAI lists the sampled token too
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def prompt_logprobs(entries: list[TokenLogprobs | None], num_top: int,
                    strings: TokenStrings) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` of one prompt: per token, None for the
    first, else the prompt token's entry and the top ``num_top`` (the engine
    may have computed more, for echo's logprobs), keyed by token id."""
    out: list[dict[str, PromptLogprob] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        # The prompt token first, then the top-n (as vLLM lists them).
        ranked = {str(e.token_id): PromptLogprob(logprob=_clamp(e.logprob), rank=e.rank,
                                                 decoded_token=strings(e.token_id))}
        for rank, (tid, lp) in enumerate(zip(e.top_token_ids[:num_top], e.top_logprobs[:num_top]), 1):
            ranked.setdefault(str(tid), PromptLogprob(logprob=_clamp(lp), rank=rank, decoded_token=strings(tid)))
        out.append(ranked)
    return out
