"""Small pure pieces of the server: edge checks, naming, chunk merging."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvferry.core.outputs import TokenLogprobs
from kvferry.outputs import CompletionOutput, RequestOutput
from kvferry.serve.errors import APIError
from kvferry.serve.logprobs import completion_logprobs
from kvferry.serve.params import named_field, resolve_max_tokens
from kvferry.serve.protocol import CompletionRequest, DeltaMessage
from kvferry.serve.server import default_model_name
from kvferry.serve.serving import _validation_error, merge_deltas


def test_resolve_max_tokens():
    assert resolve_max_tokens(None, 10, 100, "prompt") == 90  # up to the context
    assert resolve_max_tokens(90, 10, 100, "prompt") == 90
    with pytest.raises(APIError) as e:
        resolve_max_tokens(91, 10, 100, "prompt")
    assert e.value.status == 400 and e.value.param == "max_tokens" and "101 tokens" in e.value.message
    with pytest.raises(APIError) as e:
        resolve_max_tokens(1, 100, 100, "messages")
    assert e.value.param == "messages"
    with pytest.raises(APIError) as e:
        resolve_max_tokens(0, 1, 100, "prompt")
    assert e.value.param == "max_tokens"


def test_named_field():
    assert named_field("top_p must be in (0, 1], got 2") == "top_p"
    assert named_field("prompt token id 5 is outside") is None


def test_default_model_name():
    assert default_model_name(None) == "SmolLM2-135M-Instruct"
    assert default_model_name("/models/Qwen3-0.6B/") == "Qwen3-0.6B"
    assert default_model_name("/m/tiny.Q4_0.gguf") == "tiny.Q4_0"


def test_validation_error_names_the_field_not_the_union_member():
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", "stop": [1]})
    err = _validation_error(e.value)
    assert err.param.startswith("stop") and "str" not in err.param.split(".")


def test_delta_message_omits_absent_fields():
    assert json.loads(DeltaMessage().model_dump_json()) == {}
    assert json.loads(DeltaMessage(role="assistant", content="").model_dump_json()) == {"role": "assistant", "content": ""}


def _out(index, text, tokens, finished=False, reason=None):
    return RequestOutput("r", None, [1], [CompletionOutput(index, "", [], reason)], finished,
                         new_token_ids=tokens, new_text=text)


def test_merge_deltas_coalesces_per_sequence():
    deltas = merge_deltas([_out(0, "a", [1]), _out(1, "x", [2]), _out(0, "b", [3], True, "length")])
    by_index = {d.index: d for d in deltas}
    assert by_index[0].text == "ab" and by_index[0].num_tokens == 2 and by_index[0].finish_reason == "length"
    assert by_index[1].text == "x" and by_index[1].finish_reason is None


def test_completion_logprobs_offsets_and_clamping():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return {1: "ab", 2: "c"}[ids[0]]

    from kvferry.serve.logprobs import TokenStrings

    entries = [TokenLogprobs(1, -0.1, 1, [1, 2], [-0.1, float("-inf")]), TokenLogprobs(2, -1.0, 2, [1], [-0.5])]
    lp = completion_logprobs(entries, TokenStrings(Tok()), text_offset=5)
    assert lp.tokens == ["ab", "c"] and lp.text_offset == [5, 7]
    assert lp.top_logprobs[0] == {"ab": -0.1, "c": -9999.0}
    assert lp.top_logprobs[1] == {"ab": -0.5, "c": -1.0}  # the sampled token is always listed


def test_http_side_does_not_import_torch():
    """The app, protocol and engine client stay torch-free, so a router
    process in front of remote engines can run them without torch."""
    import subprocess
    import sys

    code = "import sys, kvferry.serve.app, kvferry.serve.server; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
