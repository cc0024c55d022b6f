"""Bad input gets an OpenAI-style 4xx (never a 500, never a crash), and the
server keeps serving: every bad request is followed by a good one."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.serve.server_process import MAX_MODEL_LEN, MODEL_NAME

pytestmark = pytest.mark.usefixtures("healthy")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 2, **fields}


def completion(**fields):
    return {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, **fields}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# (id, path, JSON body, expected status, expected error.param or None)
BAD_JSON_BODIES = [
    ("missing-messages", CHAT, without(chat(), "messages"), 400, "messages"),
    ("messages-not-list", CHAT, chat(messages="hello"), 400, "messages"),
    ("messages-empty", CHAT, chat(messages=[]), 400, "messages"),
    ("message-without-role", CHAT, chat(messages=[{"content": "x"}]), 400, "messages.0.role"),
    ("image-content", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages.0.content"),
    ("missing-prompt", COMPLETIONS, without(completion(), "prompt"), 400, "prompt"),
    ("two-prompts-one-empty", COMPLETIONS, completion(prompt=["a", ""]), 400, "prompt"),
    ("prompts-times-n", COMPLETIONS, completion(prompt=["a"] * 17, n=128), 400, "prompt"),
    ("empty-prompt", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("empty-token-prompt", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("token-outside-vocab", COMPLETIONS, completion(prompt=[1, 2, 10**9]), 400, "prompt"),
    ("negative-token", COMPLETIONS, completion(prompt=[5, -1]), 400, "prompt"),
    ("max-tokens-0", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", CHAT, chat(max_tokens=-3), 400, "max_tokens"),
    ("max-completion-tokens-0", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("max-tokens-not-int", COMPLETIONS, completion(max_tokens="many"), 400, "max_tokens"),
    ("max-tokens-over-context", COMPLETIONS, completion(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("prompt-over-context", COMPLETIONS, completion(prompt="hello " * (MAX_MODEL_LEN + 50)), 400, "prompt"),
    ("messages-over-context", CHAT, chat(messages=[{"role": "user", "content": "hello " * (MAX_MODEL_LEN + 50)}]),
     400, "messages"),
    ("temperature-negative", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature-nan", COMPLETIONS, completion(temperature=float("nan")), 400, "temperature"),
    ("top-p-zero", COMPLETIONS, completion(top_p=0), 400, "top_p"),
    ("top-p-two", COMPLETIONS, completion(top_p=2), 400, "top_p"),
    ("top-k-negative", COMPLETIONS, completion(top_k=-5), 400, "top_k"),
    ("min-p-two", COMPLETIONS, completion(min_p=2), 400, "min_p"),
    ("n-zero", COMPLETIONS, completion(n=0), 400, "n"),
    ("n-huge", COMPLETIONS, completion(n=10**6), 400, "n"),
    ("presence-penalty", CHAT, chat(presence_penalty=5), 400, "presence_penalty"),
    ("frequency-penalty", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition-penalty-zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("seed-too-big", COMPLETIONS, completion(seed=2**70), 400, "seed"),
    ("stop-empty-string", COMPLETIONS, completion(stop=[""]), 400, "stop"),
    ("stop-not-string", COMPLETIONS, completion(stop=[1, 2]), 400, "stop.0"),
    ("stop-token-negative", COMPLETIONS, completion(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("completion-logprobs-50", COMPLETIONS, completion(logprobs=50), 400, "logprobs"),
    ("chat-top-logprobs-30", CHAT, chat(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("logit-bias", COMPLETIONS, completion(logit_bias={"50": 10}), 400, "logit_bias"),
    ("tools-empty", CHAT, chat(tools=[]), 400, "tools"),
    ("tool-name-invalid", CHAT, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), 400,
     "tools.0.function.name"),
    ("stream-with-bad-param", CHAT, chat(stream=True, temperature=-2), 400, "temperature"),
    ("stream-options-wrong-type", CHAT, chat(stream=True, stream_options="yes"), 400, "stream_options"),
    ("unknown-model", CHAT, chat(model="gpt-4"), 404, "model"),
    ("unknown-model-completions", COMPLETIONS, completion(model="nope"), 404, "model"),
]


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, body
    return err


def _assert_still_serving(base_url: str) -> None:
    r = httpx.post(base_url + COMPLETIONS, json=completion(), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] is not None


@pytest.mark.parametrize("name,path,body,status,param", BAD_JSON_BODIES, ids=[b[0] for b in BAD_JSON_BODIES])
def test_bad_request(server, name, path, body, status, param):
    r = httpx.post(server.base_url + path, content=json.dumps(body), timeout=60,
                   headers={"Content-Type": "application/json"})
    _assert_error(r, status, param)
    _assert_still_serving(server.base_url)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\"text\"", b"\xff\xfe", b"[" * 100000],
                         ids=["malformed", "empty", "array", "string", "not-utf8", "deeply-nested"])
def test_malformed_body(server, raw):
    r = httpx.post(server.base_url + CHAT, content=raw, timeout=60, headers={"Content-Type": "application/json"})
    _assert_error(r, 400)
    _assert_still_serving(server.base_url)


def test_body_too_large_by_content_length(server):
    body = json.dumps(completion(prompt="x" * (3 * 2**20))).encode()
    r = httpx.post(server.base_url + COMPLETIONS, content=body, timeout=60,
                   headers={"Content-Type": "application/json"})
    _assert_error(r, 413)
    _assert_still_serving(server.base_url)


def test_body_too_large_chunked(server):
    # No Content-Length: the size is only known by reading.
    def chunks():
        yield b'{"model": "x", "prompt": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}'

    r = httpx.post(server.base_url + COMPLETIONS, content=chunks(), timeout=60,
                   headers={"Content-Type": "application/json"})
    _assert_error(r, 413)
    _assert_still_serving(server.base_url)


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/nope", 404), ("POST", "/v2/completions", 404), ("GET", CHAT, 405), ("DELETE", "/v1/models", 405),
])
def test_unknown_routes(server, method, path, status):
    r = httpx.request(method, server.base_url + path, timeout=30)
    _assert_error(r, status)
    _assert_still_serving(server.base_url)


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=0)
    assert exc.value.body["param"] == "max_tokens" or exc.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi " * 2000, max_tokens=2)
    # ... and the server keeps serving.
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices


def test_unknown_fields_are_ignored(server):
    r = httpx.post(server.base_url + COMPLETIONS, json=completion(some_future_field={"a": 1}), timeout=60)
    assert r.status_code == 200, r.text
