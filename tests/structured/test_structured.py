"""Structured generation: the pure bitmask function against a plain loop,
and each grammar kind driving a random "model": at every step the highest
random logit among the allowed tokens is taken. Whatever the logits, the
text must match the grammar; that is what the sampler will rely on."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvferry.model.tokenizer import Tokenizer
from kvferry.structured import GrammarSpec, allocate_bitmask, apply_token_bitmask, bitmask_width
from kvferry.structured.backend import GrammarCompiler
from tests.tiny_models import write_tokenizer

MAX_STEPS = 200


def _naive_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for b in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            word = v // 32
            if word >= bitmask.shape[1] or not (int(bitmask[b, word]) >> (v % 32)) & 1:
                out[b, v] = float("-inf")
    return out


@pytest.mark.parametrize("vocab,words", [(64, 2), (70, 3), (100, 3)])  # 100 > 3 * 32: the tail is disallowed
def test_apply_token_bitmask_matches_loop(vocab, words):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    before = logits.clone()
    out = apply_token_bitmask(logits, bitmask)
    assert torch.equal(out, _naive_apply(logits, bitmask))
    assert torch.equal(logits, before)  # pure


def test_apply_token_bitmask_checks_shapes():
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask(torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64))
    full = allocate_bitmask(2, 64)
    assert full.shape == (2, bitmask_width(64)) and torch.equal(apply_token_bitmask(torch.ones(2, 64), full),
                                                                torch.ones(2, 64))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return Tokenizer(folder)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    # A logits width past the tokenizer's, as padded embeddings have.
    return GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size + 16)


def _generate(compiler: GrammarCompiler, tokenizer: Tokenizer, spec: GrammarSpec, seed: int) -> str:
    matcher = compiler.matcher(spec)
    g = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    # Lean toward closing strings, objects and the reply, so that random
    # walks finish within MAX_STEPS.
    bias = torch.zeros(compiler.vocab_size)
    for i in range(tokenizer.vocab_size):
        if any(c in tokenizer.token_bytes(i) for c in b'"}]'):
            bias[i] = 2.0
    bias[tokenizer.eos_token_ids] = 3.0
    ids = []
    for _ in range(MAX_STEPS):
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, compiler.vocab_size, generator=g) + bias  # [1, vocab]
        logits = apply_token_bitmask(logits, bitmask)
        token = int(logits.argmax())
        assert torch.isfinite(logits[0, token]), "no token allowed"
        assert matcher.accept_token(token)
        if matcher.is_terminated:
            return tokenizer.decode(ids)
        ids.append(token)
    pytest.fail(f"no end within {MAX_STEPS} tokens: {tokenizer.decode(ids)!r}")


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer"}, "units": {"enum": ["c", "f"]}},
          "required": ["city", "days", "units"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(compiler, tokenizer, seed):
    text = _generate(compiler, tokenizer, GrammarSpec.json_schema(SCHEMA), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", range(3))
def test_json_object_output_parses(compiler, tokenizer, seed):
    text = _generate(compiler, tokenizer, GrammarSpec.from_response_format({"type": "json_object"}), seed)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", range(3))
def test_regex_and_choice(compiler, tokenizer, seed):
    pattern = r"[a-c]{2,4}-[0-9]{1,3}"
    assert re.fullmatch(pattern, _generate(compiler, tokenizer, GrammarSpec.regex(pattern), seed))
    options = ["Paris", "Rome", 'say "hi"']
    assert _generate(compiler, tokenizer, GrammarSpec.choice(options), seed) in options


def test_eos_only_when_complete(compiler, tokenizer):
    matcher = compiler.matcher(GrammarSpec.choice(["yes"]))
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    eos = tokenizer.eos_token_ids[0]
    assert not (int(bitmask[0, eos // 32]) >> (eos % 32)) & 1
    padded = compiler.vocab_size - 1  # ids past the tokenizer are never allowed
    assert not (int(bitmask[0, padded // 32]) >> (padded % 32)) & 1
    assert not matcher.accept_token(tokenizer.encode("no", add_special_tokens=False)[0])


@pytest.mark.parametrize("make,field", [
    (lambda: GrammarSpec.regex("(unclosed"), "regex"),
    (lambda: GrammarSpec.choice([]), "choice"),
    (lambda: GrammarSpec.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema"),
    (lambda: GrammarSpec.from_response_format({"type": "yaml"}), "response_format.type"),
])
def test_bad_specs_name_the_field(make, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        make()


def test_text_format_is_unconstrained_and_compile_is_cached(compiler):
    assert GrammarSpec.from_response_format({"type": "text"}) is None
    spec = GrammarSpec.json_schema(SCHEMA)
    assert compiler.compile(spec) is compiler.compile(GrammarSpec.json_schema(json.loads(json.dumps(SCHEMA))))
