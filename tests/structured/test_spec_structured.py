"""Structured outputs under speculative decoding: drafts are checked against
the grammar mask at their own position, so greedy constrained outputs are
the same with and without n-gram speculation, and still match the grammar."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvferry import LLM, SamplingParams
from kvferry.sampling import StructuredOutputsParams
from tests.tiny_models import make_tiny_checkpoint

# Repetitive on purpose: prompt lookup finds the pattern in the output so far.
PATTERN = r"(ab|cd|ef){6,12}"
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 3, "maxItems": 6,
                                                     "items": {"enum": ["red", "green", "blue"]}}},
          "required": ["items"], "additionalProperties": False}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": False}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama"))


def _params(**kind) -> SamplingParams:
    return SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=StructuredOutputsParams(**kind))


def _prompts() -> list[list[int]]:
    # Prompts that repeat themselves, so drafts are proposed from the first step.
    return [[5 + (i * 3 + j) % 11 for j in range(24)] for i in range(3)]


def test_constrained_greedy_is_the_same_with_drafts(path):
    params = [_params(regex=PATTERN)] * 3 + [_params(json=SCHEMA)] * 3
    prompts = _prompts() * 2
    plain = LLM(model=path, dtype="float32", num_kv_blocks=256, block_size=8)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    del plain
    spec = LLM(model=path, dtype="float32", num_kv_blocks=256, block_size=8, speculative=dict(NGRAM))
    outs = spec.generate(prompts, params)
    stats = spec.engine.stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # drafts really ran and some passed
    assert [o.token_ids for o in outs] == expected
    for out in outs[:3]:
        assert re.fullmatch(PATTERN, out.text), out.text
    for out in outs[3:]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
