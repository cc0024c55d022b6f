"""The character bound on prompts (model/text_bound.py): given only where
every character provably becomes part of some token."""
from __future__ import annotations

import pytest

from kvferry.model.text_bound import max_chars_per_token

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _spec(model=None, pre=BYTE_LEVEL, normalizer=None) -> dict:
    return {"model": model or {"type": "BPE", "byte_fallback": False}, "pre_tokenizer": pre, "normalizer": normalizer}


def _bound(spec: dict, added: list[str] | None = None) -> int | None:
    pieces = [b"a", b"abcd", b"\n   "]
    return max_chars_per_token(spec, len(pieces), lambda i: pieces[i], added or [])


def test_byte_level_bpe_is_bounded_by_its_longest_token_or_added_token():
    assert _bound(_spec()) == 4
    assert _bound(_spec(), ["<|im_start|>"]) == len("<|im_start|>")
    sequence = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}
    assert _bound(_spec(pre=sequence)) == 4


def test_sentencepiece_with_byte_fallback_is_bounded():
    spec = _spec(model={"type": "BPE", "byte_fallback": True}, pre={"type": "Metaspace", "replacement": "\u2581"},
                 normalizer={"type": "Sequence", "normalizers": [
                     {"type": "Prepend", "prepend": "\u2581"},
                     {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]})
    assert _bound(spec) == 4


def test_composing_normalizers_widen_the_bound():
    factor = _bound(_spec(normalizer={"type": "NFC"})) // 4
    assert factor >= 3  # Hangul syllables compose from three jamo, some Greek letters from four code points


@pytest.mark.parametrize("spec", [
    _spec(model={"type": "WordPiece"}),  # unknown words become one [UNK]
    _spec(pre={"type": "BertPreTokenizer"}),  # drops whitespace
    _spec(pre=None),  # a BPE without byte-level pieces or byte fallback may drop unknown characters
    _spec(pre={"type": "Sequence", "pretokenizers": [BYTE_LEVEL, {"type": "Split", "behavior": "Removed"}]}),
    _spec(normalizer={"type": "Strip", "strip_left": True, "strip_right": True}),
    _spec(normalizer={"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}),
    _spec(normalizer={"type": "Replace", "pattern": {"String": "x"}, "content": ""}),
])
def test_no_bound_where_text_can_vanish(spec):
    assert _bound(spec) is None
