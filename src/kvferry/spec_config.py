"""Speculative decoding's settings (``--speculative-config``; no torch:
config.py imports it and re-exports its names).

    SpeculativeConfig           vLLM's keys plus the adaptive controller's; parse() reads the CLI's JSON
    SPECULATIVE_OFF / _DEFAULT  the words --speculative-config takes besides a JSON object
    EMBEDDED_DRAFT_HEAD         the draft head committed for the embedded default model

What the default runs (``default_speculation``) depends on the rest of the
engine's config, so it stays in config.py.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SPEC_METHODS = ("ngram", "suffix", "auto", "draft", "head")
_SPEC_METHOD_ALIASES = {"eagle": "head", "eagle3": "head"}  # vLLM's names
# --speculative-config's words besides a JSON object: no speculation (vLLM's
# JSON ``null``, and ``{"method": "off"}``), or the default (what
# ``kvferry serve`` runs with no flag: ``default_speculation``).
SPECULATIVE_OFF = ("off", "none", "null")
SPECULATIVE_DEFAULT = "default"
# The draft head committed for the embedded default model (kvferry.spec.head).
EMBEDDED_DRAFT_HEAD = Path(__file__).parent / "spec" / "data" / "smollm2-135m-instruct-head.safetensors"


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` keys, plus the
    adaptive controller's). Drafts are verified losslessly: output is the
    same as without, only faster or slower."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    # method "draft": the draft model (HF folder or .gguf) sharing the target's tokenizer and
    # vocabulary. Method "head": the draft head file (``kvferry train-draft``); None: the embedded
    # default model's head. Method "auto": a draft head among its choices (None: suffix and n-gram only).
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Per-request k follows its measured acceptance (False: always k).
    adaptive: bool = True
    # Drafts only while num_running * (k + 1) stays within this. On CPU a verify window already
    # costs ~1.7x a 1-token decode (GEMM, not GEMV), so by batch 16 drafts stop (24 // 16 - 1 = 0).
    batch_token_threshold: int = 24
    # A request at k = 0 retries one draft every this many decode steps.
    probe_interval: int = 8
    # Drafting stops at batch sizes where measured step times say it cannot
    # pay (kvferry.spec.adaptive).
    cost_aware: bool = True
    # method "suffix" (vLLM's names; kvferry.spec.suffix): the tries' depth, drafts per matched token,
    # the least probability a drafted path keeps, and what each tenant's trie keeps of its finished requests.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_cached_tokens: int = 1 << 17
    draft_tree: bool = False  # suffix decoding (and a head) drafts a tree of k tokens, verified in one pass (spec/tree.py)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative.method must be one of {', '.join(SPEC_METHODS)} (or off); got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "batch_token_threshold", "probe_interval", "suffix_decoding_max_tree_depth",
                     "suffix_decoding_max_cached_requests", "suffix_decoding_max_cached_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"speculative.{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        for name in ("adaptive", "cost_aware", "draft_tree"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"speculative.{name} must be true or false, got {getattr(self, name)!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative.model must be a path, got {self.model!r}")
        self._check_suffix()
        if self.method == "draft" and not self.model:
            raise ValueError('speculative.model is required with method "draft" (the draft model\'s path)')

    def _check_suffix(self) -> None:
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1e6:
            raise ValueError(f"speculative.suffix_decoding_max_spec_factor must be a number in (0, 1e6], got {factor!r}")
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError(f"speculative.suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}")
        depth = self.suffix_decoding_max_tree_depth
        if self.draft_tree and self.method not in ("suffix", "auto", "head"):
            raise ValueError(f"speculative.draft_tree needs method suffix, auto or head, got {self.method!r}")
        if self.method in ("suffix", "auto") and self.num_speculative_tokens >= depth:
            raise ValueError(f"speculative.num_speculative_tokens ({self.num_speculative_tokens}) must be below "
                             f"suffix_decoding_max_tree_depth ({depth}) with method {self.method!r}")

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From a JSON string (the CLI), a dict (``LLM(speculative=...)``) or
        None (off); "off" (or JSON null, or ``{"method": "off"}``) is off.
        Unknown keys are a ValueError naming them. "default" is resolved
        against the rest of the engine's config (``default_speculation``)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str) and value.strip().lower() in SPECULATIVE_OFF:
            return None
        if isinstance(value, str) and value.strip().lower() == SPECULATIVE_DEFAULT:
            raise ValueError('speculative "default" depends on the engine\'s other options: '
                             "EngineArgs resolves it (kvferry.config.default_speculation)")
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative must be a JSON object, off or default: {exc}") from None
        if value is None:  # JSON null: vLLM's spelling of no speculation
            return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a JSON object or dict, got {type(value).__name__}")
        if value.get("method") == "off":
            if len(value) > 1:
                raise ValueError(f'speculative: method "off" takes no other keys, got {", ".join(sorted(set(value) - {"method"}))}')
            return None
        if value.get("method") in _SPEC_METHOD_ALIASES:
            # vLLM's EAGLE names: the "head" method loads an EAGLE-3 checkpoint
            # folder (vLLM's format, spec/eagle3.py) or a kvferry train-draft head file.
            alias = value["method"]
            value = {**value, "method": _SPEC_METHOD_ALIASES[alias]}
            logging.getLogger(__name__).warning(
                'speculative method "%s" is served as "head" (an EAGLE-3 checkpoint folder in vLLM\'s format, '
                'or a kvferry train-draft head file)', alias)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**value)
