"""Structured outputs through the engine (LLM API, tiny random checkpoint):
whatever a random model prefers, constrained outputs match their grammar,
and constrained rows leave the other rows of the batch untouched."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.model.tokenizer import Tokenizer
from kvferry.sampling import StructuredOutputsParams
from kvferry.structured import GrammarSpec, allocate_bitmask
from kvferry.structured.backend import GrammarCompiler
from kvferry.structured.spec import check_compiles
from kvferry.structured.step import GrammarRow, fill_bitmask
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_models import make_tiny_checkpoint

# Bounded everywhere, so a random model cannot wander forever inside a string.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "ok": {"type": "boolean"},
    "unit": {"enum": ["c", "f"]}}, "required": ["name", "ok", "unit"], "additionalProperties": False}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama")


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=str(path), dtype="float32", num_kv_blocks=256, block_size=8)


def prompt(n, start=5):
    return [start + (i * 7) % 200 for i in range(n)]


def structured(max_tokens=80, temperature=0.0, **kind) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                          structured_outputs=StructuredOutputsParams(**kind))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm, temperature):
    outs = llm.generate([prompt(6 + i, start=3 + i) for i in range(6)],
                        structured(json=SCHEMA, temperature=temperature))
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_regex_choice_grammar(llm):
    pattern = r"[a-c]{2,4}-[0-9]{1,3}"
    options = ["Paris", "Rome", 'say "hi"']
    outs = llm.generate([prompt(9)] * 4, [
        structured(json_object=True, max_tokens=200),
        structured(regex=pattern),
        structured(choice=options),
        structured(grammar='root ::= "yes" | "no" | "maybe " [0-9]'),
    ])
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert isinstance(json.loads(outs[0].text), dict)
    assert re.fullmatch(pattern, outs[1].text)
    assert outs[2].text in options
    assert re.fullmatch(r"yes|no|maybe [0-9]", outs[3].text)


def test_unconstrained_rows_unchanged_when_batched(llm, path):
    """HF-exact greedy outputs for the free rows of a batch that also holds
    constrained rows (float32)."""
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [prompt(12, 1), prompt(7, 2), prompt(15, 4)]
    hf = load_hf(str(path))
    alone = [hf_greedy(hf, p, 12) for p in prompts]
    mixed = llm.generate([prompts[0], prompt(10), prompts[1], prompt(11), prompts[2]],
                         [free, structured(json=SCHEMA), free, structured(regex=r"[0-9]{5}"), free])
    for p, ours, theirs in zip(prompts, [mixed[0].token_ids, mixed[2].token_ids, mixed[4].token_ids], alone):
        assert_greedy_match(hf, p, ours, theirs)
    jsonschema.validate(json.loads(mixed[1].text), SCHEMA)
    assert re.fullmatch(r"[0-9]{5}", mixed[3].text)


def test_drafts_masked_after_previous_drafts(path):
    """Position k of a request with drafts is masked as if drafts 0..k-1 were
    accepted, and the fill leaves the matcher where it was."""
    tokenizer = Tokenizer(path)
    compiler = GrammarCompiler(tokenizer)
    spec = GrammarSpec.regex(r"ab[0-9]{3}")
    drafts = [tokenizer.encode("a", add_special_tokens=False)[0], tokenizer.encode("b", add_special_tokens=False)[0]]
    matcher = compiler.matcher(spec)
    step = fill_bitmask([GrammarRow(first_logit=2, matcher=matcher, drafts=drafts)], compiler.vocab_size)
    assert step.rows.tolist() == [2, 3, 4]
    reference = compiler.matcher(spec)
    expected = allocate_bitmask(3, compiler.vocab_size)
    for k in range(3):
        reference.fill_bitmask(expected, k)
        if k < 2:
            assert reference.accept_token(drafts[k])
    assert torch.equal(step.bitmask, expected)
    # The fill rolled back: "a" is still the only way to start.
    again = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(again, 0)
    assert torch.equal(again[0], expected[0])


@pytest.mark.parametrize("kind,value,match", [
    ("json", {"type": "nope"}, "not a valid JSON Schema"),
    ("regex", "a(", "cannot be compiled"),
    ("grammar", "root ::= missing", "cannot be compiled"),
])
def test_bad_grammars_are_value_errors(kind, value, match):
    spec = GrammarSpec.from_params(StructuredOutputsParams(**{kind: value}))
    with pytest.raises(ValueError, match=match):
        check_compiles(spec, "structured_outputs")


def test_params_name_the_field():
    with pytest.raises(ValueError, match="structured_outputs must set exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json="[1, 2")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])


def test_structured_outputs_cross_the_process_boundary():
    from kvferry import messages

    params = SamplingParams(structured_outputs=StructuredOutputsParams(json='{"b": 1, "a": {"type": "object"}}'))
    request = messages.EngineCoreRequest(request_id="r", prompt_token_ids=[1], sampling_params=params,
                                         eos_token_ids=[2], arrival_time=0.0)
    back = messages.decode(messages.encode(request), messages.CoreInput)
    assert back.sampling_params.structured_outputs == params.structured_outputs
    # Canonical JSON: equal schemas are equal cache keys whatever their key order.
    assert params.structured_outputs.json == StructuredOutputsParams(json={"a": {"type": "object"}, "b": 1}).json


def test_ignore_eos_past_the_grammars_end_keeps_the_engine_serving(llm):
    """With ``ignore_eos`` a request goes on after its grammar accepted the
    stop token: a terminated matcher has no mask to give (xgrammar raised,
    and the engine core died). As vLLM does, what follows the complete
    structured text is unconstrained, up to max_tokens."""
    pattern = r"\d{3}-\d{4}"
    params = structured(regex=pattern, max_tokens=12)
    params.ignore_eos = True
    out = llm.generate([prompt(7)], params)[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 12
    assert re.match(pattern, out.text), out.text
    after = llm.generate([prompt(9)], structured(regex=pattern))[0]
    assert after.finish_reason == "stop" and re.fullmatch(pattern, after.text)
