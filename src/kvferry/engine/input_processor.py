"""Front end intake: prompt -> token ids -> validated EngineCoreRequests.

Validation uses the facts of the core's ready message, so a bad request is
rejected (ValueError naming the field) before it crosses to the core, and
the core never sees input it would have to refuse.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvferry.core.hashing import CacheScope

from kvferry.messages import EngineCoreReady, EngineCoreRequest
from kvferry.model.tokenizer import Tokenizer
from kvferry.sampling import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, core: EngineCoreReady) -> None:
        self.tokenizer = tokenizer
        self.core = core
        self.eos_token_ids = list(tokenizer.eos_token_ids)
        # The server's cache policy: prompt token ids -> where its blocks are
        # keyed (tenant namespace, public prefix). None: the namespace the
        # caller passes, all private.
        self.cache_policy: Callable[[list[int]], CacheScope] | None = None

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_namespace: str = "",
        arrival_time: float | None = None,
        cache_scope: CacheScope | None = None,
    ) -> tuple[str | None, list[EngineCoreRequest]]:
        """The prompt text (None for token ids) and one core request per
        sequence: n > 1 fans out into ids ``request_id#i`` with seeds seed + i.
        ``cache_scope``: the server's own scope for a request it makes itself
        (a public prefix's prefill); else the cache policy decides."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        text, token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        scope = cache_scope
        if scope is None:
            scope = self.cache_policy(token_ids) if self.cache_policy is not None else CacheScope(cache_namespace)
        requests = [
            EngineCoreRequest(
                request_id=child_id,
                prompt_token_ids=token_ids,
                sampling_params=_child_params(params, index),
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                cache_namespace=scope.namespace,
                public_cache_namespace=scope.public_namespace,
                num_public_blocks=scope.num_public_blocks,
                writes_public_blocks=scope.writes_public,
                cache_quota_blocks=scope.quota_blocks,
                tenant=scope.tenant,
                tenant_weight=scope.tenant_weight,
            )
            for index, child_id in enumerate(child_request_ids(request_id, params.n))
        ]
        return text, requests

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError("prompt must be a string or a list of token ids")

    def _validate_prompt(self, token_ids: list[int]) -> None:
        core = self.core
        if not token_ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in token_ids if not 0 <= t < core.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {core.vocab_size})")
        if not core.enable_chunked_prefill and len(token_ids) > core.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                f"({core.max_num_batched_tokens}) with chunked prefill disabled"
            )
        # max_model_len never exceeds the pool, so this also means "fits in the KV cache".
        if len(token_ids) >= core.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the context length is {core.max_model_len} "
                "and at least one token must be generated"
            )


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of n sequences gets its own seed (seed + index) so that they differ
    yet stay reproducible. Always a copy: the caller's object is never shared."""
    child = params.clone()
    if params.n > 1:
        child.n = 1
        if child.seed is not None:
            child.seed += index
    return child


def load_tokenizer(core: EngineCoreReady) -> Tokenizer:
    """The front end's tokenizer: the one the core loaded, read from the
    folder its ready message names, with the same EOS ids. No weights and
    no torch on this side."""
    tokenizer = Tokenizer(Path(core.model_path))
    tokenizer.eos_token_ids = list(core.eos_token_ids)
    return tokenizer
