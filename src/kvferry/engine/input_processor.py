"""Front end intake: prompt -> token ids -> validated EngineCoreRequests.

Validation uses the facts of the core's ready message, so a bad request is
rejected (ValueError naming the field) before it crosses to the core, and
the core never sees input it would have to refuse.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from kvferry import envs
from kvferry.core.hashing import CacheScope
from kvferry.messages import EngineCoreReady, EngineCoreRequest
from kvferry.model.resolve import converted_gguf_folder, resolve_model
from kvferry.model.tokenizer import Tokenizer
from kvferry.sampling import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, core: EngineCoreReady) -> None:
        self.tokenizer = tokenizer
        self.core = core
        self.eos_token_ids = list(tokenizer.eos_token_ids)

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

        Where the request's blocks are keyed: ``cache_scope`` when given (the
        server builds one per request from the caller's API key and prompt,
        serve/public_prefixes.py), else a private ``cache_namespace`` (the
        offline engine's per-request namespace; "" shares the one default
        cache). The scope goes to the core unchanged. Passing both is a
        ValueError unless they agree: a namespace that the scope would
        overrule must not be dropped silently."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if cache_scope is None:
            cache_scope = CacheScope(cache_namespace)
        elif cache_namespace and cache_namespace != cache_scope.namespace:
            raise ValueError("cache_namespace: pass either cache_namespace or cache_scope (which names its own "
                             "namespace), not both")
        text, token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        requests = [
            EngineCoreRequest(
                request_id=child_id,
                prompt_token_ids=token_ids,
                sampling_params=_child_params(params, index),
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                cache_scope=cache_scope,
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
    no torch on this side. Read already (``prefetch_tokenizer``) where that
    folder is one the prefetch read."""
    prefetched = _prefetched.pop(core.model_path, None)
    _prefetched.clear()  # folders the core did not name
    tokenizer = prefetched.result() if prefetched is not None else None
    if tokenizer is None:
        tokenizer = Tokenizer(Path(core.model_path))
    tokenizer.eos_token_ids = list(core.eos_token_ids)
    return tokenizer


class _Prefetch:
    """One folder's tokenizer, read on a thread of its own."""

    def __init__(self, folder: Path) -> None:
        self._tokenizer: Tokenizer | None = None
        self._thread = threading.Thread(target=self._read, args=(folder,), name="tokenizer-prefetch", daemon=True)
        self._thread.start()

    def _read(self, folder: Path) -> None:
        try:
            self._tokenizer = Tokenizer(folder)
        except Exception:  # noqa: BLE001 - load_tokenizer reads the folder again, and says what is wrong
            pass

    def result(self) -> Tokenizer | None:
        self._thread.join()
        return self._tokenizer


# model_path (as a core's ready message names it) -> its tokenizer being read.
_prefetched: dict[str, _Prefetch] = {}


def prefetch_tokenizer(model: str | None) -> None:
    """Start reading the tokenizer of each folder the cores may name for
    ``model`` (its folder; a GGUF's converted folders that exist: with the
    weights expanded or the blocks kept, which only the core decides), so
    that ``load_tokenizer`` finds it read once the cores are ready: ~0.1 s
    that came after every core's load, now beside it. Converts nothing;
    a folder not there yet (a first conversion) is read after, as before."""
    try:
        resolved = resolve_model(model)
        folders = ([converted_gguf_folder(resolved.path, envs.cache_dir(), weights) for weights in (True, False)]
                   if resolved.is_gguf else [resolved.path])
    except (ValueError, OSError):  # the core reports the model's problem
        return
    for folder in folders:
        if (folder / "tokenizer.json").is_file() and str(folder) not in _prefetched:
            _prefetched[str(folder)] = _Prefetch(folder)
