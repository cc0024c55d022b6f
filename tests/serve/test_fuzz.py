"""Fuzzing the running server with Hypothesis: request bodies shaped like the
OpenAI models (right field names, any JSON values), then damaged as bytes:
lone surrogate escapes, invalid UTF-8, numbers past every range, deep
nesting, truncation. Every answer must be a 2xx or an OpenAI-style 4xx, the
keep-alive connection must stay usable, and nothing may hang.

Bounded: a fixed number of derandomized examples, generation capped at a few
tokens per request, well under a minute."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.keepalive import KeepAlive

pytestmark = pytest.mark.usefixtures("healthy")

MAX_EXAMPLES = 150
REQUEST_TIMEOUT_S = 30  # a hang fails the test as a socket timeout

# Any JSON value, including the awkward ones.
leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=24),
    st.sampled_from(["", "\x00", "😀", "\u202e", "a" * 300, "<|im_start|>", "<tool_call>"]),
)
any_json = st.recursive(leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=16)
# Lengths that generate at most a few tokens when valid (a fuzz run must stay short).
small_length = st.sampled_from([1, 2, 3, 1, 2, 3, 0, -1, 2**63, 2**100, "3", True, 2.0])
# Never replaced by arbitrary JSON: null or absent would mean "up to the context".
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens", "max_output_tokens"}


# Plausible values for each field; one field per example may then be
# replaced by any JSON value, so that about half the requests get past
# validation and exercise generation, streaming and the tool parser too.
text = st.text(max_size=40)
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "user", "assistant"]),
         "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                             min_size=1, max_size=3))},
        optional={"name": st.text(max_size=8)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "tool_calls": st.lists(st.fixed_dictionaries({
        "id": st.text(max_size=5), "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": st.text(max_size=8), "arguments": st.text(max_size=12)})}),
        min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": text, "tool_call_id": st.text(max_size=8)}),
)
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.from_regex(r"[a-z_]{1,10}", fullmatch=True)},
    optional={"parameters": st.just({"type": "object", "properties": {"x": {"type": "integer"}}})})})
# Numbers at the edges of what the sampler's float32 knobs and the wire's
# int64 hold: subnormals, values that round to 0 or overflow in float32,
# negative zero, NaN and infinities (json.dumps writes NaN / Infinity),
# integers around 2^31, 2^63 and 2^64.
edge_float = st.sampled_from([0.0, -0.0, 5e-324, 1e-46, 1e-40, 2.0**-126, 1.2e-38, 1e-5, 3.4028234663852886e38,
                              3.5e38, 1e308, -1e-46, -3.5e38, float("nan"), float("inf"), float("-inf")])
edge_int = st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63) - 1])


def knob(plausible):
    return st.one_of(plausible, plausible, edge_float)


sampling = {
    "model": st.just("SmolLM2-135M-Instruct"), "n": st.sampled_from([1, 1, 2]),
    "temperature": knob(st.floats(0, 2)), "top_p": knob(st.floats(0.01, 1)),
    "top_k": st.one_of(st.integers(0, 50), edge_int), "min_p": knob(st.floats(0, 1)),
    "repetition_penalty": knob(st.floats(0.5, 2)), "frequency_penalty": knob(st.floats(-2, 2)),
    "min_tokens": st.one_of(st.integers(0, 2), edge_int),
    "seed": st.one_of(st.integers(-(2**63), 2**63 - 1), edge_int),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "response_format": st.just({"type": "text"}), "presence_penalty": knob(st.floats(-2, 2)),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, 49151), edge_int), max_size=2), "ignore_eos": st.booleans(),
}
completion = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 49151), min_size=1, max_size=8)),
     "max_tokens": small_length},
    optional={**sampling, "logprobs": st.integers(0, 20)},
)
chat = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=4), "max_completion_tokens": small_length},
    optional={**sampling, "logprobs": st.booleans(), "tools": st.lists(tool, min_size=1, max_size=2),
              "tool_choice": st.sampled_from(["auto", "none", "required"])},
)
tokenize = st.one_of(st.fixed_dictionaries({"prompt": text}, optional={"add_special_tokens": st.booleans()}),
                     st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)}))
detokenize = st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 49151), max_size=8)})
input_item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": text}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=6),
                           "name": st.text(max_size=8), "arguments": st.text(max_size=12)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=6),
                           "output": text}),
)
responses = st.fixed_dictionaries(
    {"input": st.one_of(st.text(min_size=1, max_size=40), st.lists(input_item, min_size=1, max_size=4)),
     "max_output_tokens": small_length},
    optional={"model": sampling["model"], "instructions": text, "stream": st.booleans(), "store": st.booleans(),
              "temperature": sampling["temperature"], "previous_response_id": st.text(max_size=10),
              "tools": st.lists(st.builds(lambda t: {"type": "function", **t["function"]}, tool), min_size=1,
                                max_size=2)},
)


@st.composite
def corrupted(draw, path: str, bodies) -> tuple[str, dict]:
    body = draw(bodies)
    fields = sorted(set(body) - LENGTH_FIELDS)
    if fields and draw(st.booleans()):
        body[draw(st.sampled_from(fields))] = draw(any_json)
    return path, body


# The operator route a publisher reaches (the server runs without keys: the
# one tenant may publish). Prefixes stay short: each valid one is prefilled.
public_prefix = st.fixed_dictionaries({"prefix": st.one_of(
    st.text(min_size=1, max_size=40), st.lists(message, min_size=1, max_size=2))})
ENDPOINTS = st.one_of(
    corrupted("/v1/completions", completion), corrupted("/v1/chat/completions", chat),
    corrupted("/v1/responses", responses), corrupted("/tokenize", tokenize), corrupted("/detokenize", detokenize),
    corrupted("/v1/kv/public_prefixes", public_prefix),
)


def _damage(body: bytes, how: str, where: int) -> bytes:
    """Byte-level damage that a JSON encoder would never produce."""
    cut = where % (len(body) + 1)
    quote = body.find(b'"', cut)
    if how == "lone_surrogate" and quote >= 0:
        return body[:quote + 1] + b"\\ud800" + body[quote + 1:]
    if how == "low_surrogate_first" and quote >= 0:
        return body[:quote + 1] + b"\\udc00\\ud800" + body[quote + 1:]
    if how == "invalid_utf8" and quote >= 0:
        return body[:quote + 1] + b"\xff\xc3(" + body[quote + 1:]
    if how == "huge_number":
        return body.replace(b": 1", b": 1" + b"0" * 400, 1).replace(b"false", b"1e99999", 1)
    if how == "deep_nesting":
        return body[:-1] + b', "deep": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    if how == "truncated":
        return body[:cut]
    if how == "not_an_object":
        return b"[" + body + b"]"
    return body


DAMAGE = st.sampled_from(["none"] * 10 + ["lone_surrogate", "low_surrogate_first", "invalid_utf8",
                          "huge_number", "deep_nesting", "truncated", "not_an_object"])


@pytest.fixture(scope="module")
def conn(server):
    c = KeepAlive(server.base_url, timeout_s=REQUEST_TIMEOUT_S)
    yield c
    c.close()


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(endpoint=ENDPOINTS, damage=DAMAGE, where=st.integers(0, 10**6))
def test_fuzz_bodies(conn, endpoint, damage, where):
    path, body = endpoint
    raw = _damage(json.dumps(body).encode("utf-8", "surrogatepass"), damage, where)
    status, headers, data = conn.post(path, raw)
    assert status < 500, (status, raw[:500], data[:500])
    if status >= 400:
        error = json.loads(data)["error"]
        assert isinstance(error["message"], str) and error["type"] == "invalid_request_error"
    elif headers.get("content-type", "").startswith("text/event-stream"):
        # Chat and completions end with [DONE]; the Responses API with a typed final event.
        end = b"event: response." if path == "/v1/responses" else b"data: [DONE]"
        assert end in data.rstrip().rsplit(b"\n\n", 1)[-1], data[-300:]
        # No event is an error (parsed: the generated text itself may be the word "error").
        for line in data.splitlines():
            if line.startswith(b"data: {"):
                event = json.loads(line[len(b"data: "):])
                assert "error" not in event and event.get("type") not in ("error", "response.failed"), line[:500]


def test_server_healthy_after_fuzzing(server):
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
