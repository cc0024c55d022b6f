"""Sampling values at every numeric boundary, through the real server.

A float64 that rounds to 0 or inf in the sampler's float32 knobs (a top_p of
1e-46 masked every token, and the sampler then drew an id outside the
vocabulary: the engine core died on the embedding lookup), integers past
int64 (an OverflowError on the way to the core), NaN and infinities as a
lenient JSON parser reads them, negative zero. Every value of every field
gets a 2xx or an OpenAI-style 400 naming the field, never a 5xx, and the
engine core stays alive throughout (``healthy`` checks /health after each).
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve.server_process import MODEL_NAME

pytestmark = pytest.mark.usefixtures("healthy")

# Floats near each edge of float32 and float64, as JSON number text (so that
# 1e400, NaN and Infinity reach the server exactly as an attacker writes them).
FLOATS = [
    "0", "-0.0", "5e-324", "1e-46", "1e-40", "1.1754943508222875e-38", "1.2e-38", "1e-30", "1e-5",
    "0.5", "1", "1.0000001", "2", "3.4028234663852886e38", "3.5e38", "1e308", "1.7976931348623157e308",
    "-1e-46", "-1e-30", "-2", "-3.5e38", "1e400", "-1e400", "NaN", "Infinity", "-Infinity",
]
INTS = [
    "0", "-0", "1", "-1", "50", "2147483647", "2147483648", "9223372036854775807", "9223372036854775808",
    "18446744073709551615", "18446744073709551616", "1180591620717411303424", "-9223372036854775809",
]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]
INT_FIELDS = ["top_k", "min_tokens", "seed", "n", "logprobs"]
PROMPT = "The capital of France is"


def _body(endpoint: str, field: str, value: str) -> bytes:
    base = {"model": MODEL_NAME, "max_tokens": 2}
    if endpoint == "chat":
        base["messages"] = [{"role": "user", "content": PROMPT}]
        if field == "logprobs":  # chat takes a bool and top_logprobs
            base["logprobs"] = True
            field = "top_logprobs"
    else:
        base["prompt"] = PROMPT
    text = json.dumps(base)
    if field == "stop_token_ids":
        value = f"[{value}]"
    return (text[:-1] + f', "{field}": {value}' + "}").encode()


def _check(server, endpoint: str, field: str, value: str) -> None:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = httpx.post(f"{server.base_url}{path}", content=_body(endpoint, field, value),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code < 500, f"{field}={value}: {r.status_code} {r.text}\n{server.log()[-3000:]}"
    if r.status_code == 200:
        choices = r.json()["choices"]
        assert choices and all(c["finish_reason"] in ("stop", "length") for c in choices), (field, value, r.text)
    else:
        error = r.json()["error"]
        assert r.status_code == 400 and error["message"], (field, value, r.text)


def _check_all(server, endpoint: str, field: str, values: list[str]) -> None:
    """Every value at once, as concurrent clients send them: the server
    batches them (one at a time was most of this module's time), and a value
    that killed the core would fail the others as well as its own."""
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda value: _check(server, endpoint, field, value), values))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_float_knobs_at_every_boundary(server, endpoint, field):
    _check_all(server, endpoint, field, FLOATS)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("field", [*INT_FIELDS, "stop_token_ids"])
def test_integer_fields_at_every_boundary(server, endpoint, field):
    _check_all(server, endpoint, field, INTS)


@pytest.mark.parametrize("field,value", [("top_p", 1e-46), ("repetition_penalty", 1e-46), ("top_p", 1e-40),
                                         ("temperature", 1e400), ("top_k", 2**70), ("min_tokens", 2**70),
                                         ("stop_token_ids", [2**70])])
def test_the_probes_get_a_400_naming_the_field(server, field, value):
    """The reported requests: each is refused with the field named, and the
    server serves the next request."""
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 1, field: value}
    r = httpx.post(f"{server.base_url}/v1/completions", content=json.dumps(body).replace("Infinity", "1e400"),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
    ok = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("knobs", [{"top_p": 1.2e-38}, {"repetition_penalty": 1.2e-38},
                                   {"repetition_penalty": 3.4e38}, {"temperature": 1e-5, "top_p": 1.2e-38},
                                   {"min_p": 1.0, "top_k": 1}, {"temperature": 3.4e38}])
def test_extreme_valid_knobs_sample_inside_the_vocabulary(server, knobs):
    """Values a float32 holds but that push the distribution to its edges
    (every positive logit to inf, a one-token nucleus) still sample ids the
    tokenizer knows, with and without a seed, and in one batch with others."""
    for seed in (None, 7):
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 1, "logprobs": 1, **knobs}
        if seed is not None:
            body["seed"] = seed
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        assert len(choice["logprobs"]["tokens"]) >= 1
