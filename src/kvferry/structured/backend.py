"""The xgrammar backend: one compiler per model, one matcher per request.

The vocabulary is handed to xgrammar as raw bytes per token id
(``Tokenizer.token_bytes``), so no transformers tokenizer is needed; special
tokens are given as empty strings, which xgrammar never lets a grammar emit,
and the stop ids end a complete match.

JSON is compiled without free whitespace, so valid output never holds a raw
control byte; xgrammar's string rule would allow them (JSON does not), so
tokens holding one are masked out of JSON grammars on top of the grammar.
"""
from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

import torch
import xgrammar as xgr

from kvferry.structured.bitmask import bitmask_width
from kvferry.structured.errors import library_reason
from kvferry.structured.spec import GrammarSpec

_COMPILE_CACHE_SIZE = 256


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer; thread-safe, cached by spec."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, max_threads: int = 1) -> None:
        # vocab_size: the model's logits width (may exceed the tokenizer's).
        self.vocab_size = vocab_size or tokenizer.vocab_size
        if self.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size ({self.vocab_size}) must be >= the tokenizer's ({tokenizer.vocab_size})")
        special = tokenizer.special_token_ids
        encoded = [b"" if i in special else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                 stop_token_ids=list(tokenizer.eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._no_control_bytes = _mask_of(
            [i for i, raw in enumerate(encoded) if all(b >= 0x20 for b in raw)], self.vocab_size)  # [words]
        self._lock = threading.Lock()
        self._compile = lru_cache(maxsize=_COMPILE_CACHE_SIZE)(self._compile_uncached)

    def compile(self, spec: GrammarSpec) -> "xgr.CompiledGrammar":
        """Raises ValueError (naming the spec's kind) for a spec xgrammar rejects."""
        with self._lock:
            return self._compile(spec)

    def matcher(self, spec: GrammarSpec) -> "GrammarMatcher":
        extra = self._no_control_bytes if spec.kind in ("json_object", "json_schema") else None
        return GrammarMatcher(self.compile(spec), self.vocab_size, extra)

    def _compile_uncached(self, spec: GrammarSpec) -> "xgr.CompiledGrammar":
        try:
            if spec.kind == "json_object":  # an object, not any JSON value
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "json_schema":
                return self._compiler.compile_json_schema(spec.source, any_whitespace=False)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.source)
            if spec.kind == "grammar":
                return self._compiler.compile_grammar(spec.source)
            # choice: an alternation of JSON-escaped literals, in EBNF.
            alternatives = " | ".join(_ebnf_literal(c) for c in spec.choices())
            return self._compiler.compile_grammar(f"root ::= {alternatives}")
        except (RuntimeError, ValueError, xgr.InvalidJSONError) as exc:
            raise ValueError(f"{spec.kind}: cannot compile: {library_reason(exc)}") from None


def _mask_of(ids: list[int], vocab_size: int) -> torch.Tensor:
    allowed = torch.zeros(bitmask_width(vocab_size) * 32, dtype=torch.int64)
    allowed[ids] = 1
    words = (allowed.view(-1, 32) << torch.arange(32)).sum(dim=1)  # [words], bits 0..31
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe (one request)."""

    def __init__(self, compiled: "xgr.CompiledGrammar", vocab_size: int,
                 extra_mask: torch.Tensor | None = None) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._extra_mask = extra_mask  # [words] int32, ANDed into every row

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` ([batch, words] int32, CPU)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._extra_mask is not None:
            bitmask[row] &= self._extra_mask

    def accept_token(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens (rejected speculative tokens)."""
        self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return self._matcher.is_terminated()
