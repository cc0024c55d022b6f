"""How many characters of text one token can stand for, at most.

A prompt longer than ``max_model_len * max_chars_per_token`` characters
cannot fit the context whatever it holds, so the server refuses it without
encoding it (encoding megabytes takes seconds of CPU). The bound must be
honest: no text of more characters may ever encode to fewer tokens. It is
derived from the tokenizer's own description, and only where every input
character is provably covered by some token:

- the model is BPE and every byte has a token: a ByteLevel pre-tokenizer
  (GPT-2 style) or ``byte_fallback`` (sentencepiece style), so no character
  is dropped or folded into an unknown token;
- no pre-tokenizer step removes text (a Split with behaviour "removed",
  BERT's whitespace splitting) and no normalizer can drop an unbounded run
  (Strip, a regex Replace, a replacement by "");
- a normalizer that composes characters (NFC, NFKC) can shrink text by at
  most the longest canonical decomposition (a few code points into one),
  and a literal Replace by the ratio of its pattern to its content: the
  bound is multiplied by that.

A token stands for at most its bytes' count of characters (a byte-level
token), its piece's length (sentencepiece, "▁" for a space), or its
content's length (an added token such as ``<|im_start|>``). Anything this
module cannot vouch for gets None: no bound, and the text is encoded (off
the event loop) as before.
"""
from __future__ import annotations

import unicodedata
from collections.abc import Callable
from functools import lru_cache
from typing import Any

_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Metaspace", "Split", "Sequence", "UnicodeScripts", "Punctuation"}
_SAFE_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "Sequence", "Replace", "NFC", "NFKC"}
_COMPOSING = {"NFC", "NFKC"}


def max_chars_per_token(spec: dict[str, Any], vocab_size: int, token_bytes: Callable[[int], bytes],
                        added_contents: list[str], longest_token: Callable[[], int] | None = None) -> int | None:
    """``spec``: the tokenizer's JSON description (``tokenizers.Tokenizer.to_str``;
    ``model`` needs only its ``type`` and ``byte_fallback``).
    ``token_bytes(id)``: the raw bytes token ``id`` stands for.
    ``longest_token()``: ``max(len(token_bytes(i)) for i in range(vocab_size))``
    found another way (Tokenizer's, without a call per id); None: that scan."""
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer")
    if model.get("type") != "BPE":
        return None
    if not (_has(pre, "ByteLevel") or model.get("byte_fallback")):
        return None
    if not _pre_tokenizer_keeps_text(pre):
        return None
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None:
        return None
    if longest_token is not None:
        longest = longest_token()
    else:
        longest = max((len(token_bytes(i)) for i in range(vocab_size)), default=1)
    longest = max(longest, *(len(c) for c in added_contents), 1)
    return longest * factor


def _has(node: dict[str, Any] | None, kind: str) -> bool:
    if not node:
        return False
    return node.get("type") == kind or any(_has(n, kind) for n in node.get("pretokenizers") or [])


def _pre_tokenizer_keeps_text(node: dict[str, Any] | None) -> bool:
    """No step drops characters (splitting and isolating keep them all)."""
    if not node:
        return True
    kind = node.get("type")
    if kind not in _SAFE_PRE_TOKENIZERS:
        return False
    if kind in ("Split", "Punctuation") and str(node.get("behavior", "")).lower() == "removed":
        return False
    return all(_pre_tokenizer_keeps_text(n) for n in node.get("pretokenizers") or [])


def _normalizer_factor(node: dict[str, Any] | None) -> int | None:
    """How many characters of input one normalized character may stand for
    (None: unbounded, or unknown)."""
    if not node:
        return 1
    kind = node.get("type")
    if kind not in _SAFE_NORMALIZERS:
        return None
    if kind == "Sequence":
        factor = 1
        for inner in node.get("normalizers") or []:
            f = _normalizer_factor(inner)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _COMPOSING:
        return _longest_canonical_decomposition()
    if kind == "Replace":
        pattern, content = node.get("pattern") or {}, node.get("content")
        literal = pattern.get("String")
        if not isinstance(literal, str) or not literal or not isinstance(content, str) or not content:
            return None  # a regex, or a replacement by nothing: no bound on what it removes
        return max(1, -(-len(literal) // len(content)))
    return 1  # decomposing, lower-casing and prepending never shorten text


@lru_cache(maxsize=1)
def _longest_canonical_decomposition() -> int:
    """Composition (NFC) turns at most this many code points into one."""
    return max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000)
               if not 0xD800 <= c <= 0xDFFF)
