"""A draft that ends a request's grammar (the stop token after a complete
match) in the middle of its drafts: the step's bitmask fill stops there
(rows after it are never used) instead of asking a terminated matcher for a
mask, which xgrammar refuses with an exception that killed the engine core
(speculation is on by default, so a structured request with drafts is the
common case)."""
from __future__ import annotations

import pytest
import torch

from kvferry.model.tokenizer import Tokenizer
from kvferry.structured import GrammarSpec, allocate_bitmask
from kvferry.structured.backend import GrammarCompiler
from kvferry.structured.step import GrammarRow, fill_bitmask
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    tokenizer = Tokenizer(make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama"))
    return tokenizer, GrammarCompiler(tokenizer)


def test_a_draft_stop_token_ends_the_fill_and_leaves_the_matcher_as_it_was(compiler):
    tokenizer, compiler = compiler
    spec = GrammarSpec.regex(r"ab")
    a, b = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("a", "b"))
    eos = tokenizer.eos_token_ids[0]
    matcher = compiler.matcher(spec)
    # "a", "b", then the stop token, then anything: the last rows cannot be masked.
    step = fill_bitmask([GrammarRow(first_logit=0, matcher=matcher, drafts=[a, b, eos, a])], compiler.vocab_size)
    assert step.rows.tolist() == [0, 1, 2, 3, 4]
    reference = compiler.matcher(spec)
    expected = allocate_bitmask(5, compiler.vocab_size)  # rows 3 and 4 stay all allowed (never used)
    for k, token in enumerate([a, b, eos]):
        reference.fill_bitmask(expected, k)
        assert reference.accept_token(token)
    assert torch.equal(step.bitmask, expected)
    assert not matcher.is_terminated  # rolled back
    again = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(again, 0)
    assert torch.equal(again[0], expected[0])
