"""Ollama's API, driven by the real ``ollama`` Python client against a real
``kvferry serve``: chat (plain and streamed), generate, embed, list, show,
ps and version; errors in Ollama's shape."""
from __future__ import annotations

import json

import httpx
import ollama
import pytest

from tests.serve.server_process import MAX_MODEL_LEN, MODEL_NAME

pytestmark = pytest.mark.usefixtures("healthy")

GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module")
def oc(server):
    return ollama.Client(host=server.base_url, timeout=120)


def test_chat(oc):
    r = oc.chat(model=MODEL_NAME, messages=[{"role": "user", "content": "Say hello."}], options=GREEDY)
    assert r.message.role == "assistant" and r.message.content
    assert r.done and r.done_reason in ("stop", "length")
    assert r.prompt_eval_count > 0 and 0 < r.eval_count <= 6 and r.total_duration > 0


def test_streamed_chat_matches_the_plain_one(oc):
    messages = [{"role": "user", "content": "Name a color."}]
    plain = oc.chat(model=MODEL_NAME, messages=messages, options=GREEDY)
    parts = list(oc.chat(model=MODEL_NAME, messages=messages, options=GREEDY, stream=True))
    assert len(parts) >= 2 and parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == plain.message.content
    assert parts[-1].eval_count == plain.eval_count


def test_stream_is_ndjson_by_default(server):
    # Ollama's default is stream: true; each line is one JSON object.
    with httpx.stream("POST", f"{server.base_url}/api/chat", timeout=120, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "options": GREEDY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and lines[-1]["model"] == MODEL_NAME


def test_options_map_onto_sampling(oc):
    # num_predict bounds the tokens; stop cuts the text; seed makes sampling repeat.
    r = oc.generate(model=MODEL_NAME, prompt="Count: 1, 2, 3,", raw=True, options={"num_predict": 3, "temperature": 0})
    assert r.eval_count == 3 and r.done_reason == "length"
    seeded = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 7, "num_predict": 8, "repeat_penalty": 1.1}
    a = oc.generate(model=MODEL_NAME, prompt="Once upon a time", raw=True, options=seeded)
    b = oc.generate(model=MODEL_NAME, prompt="Once upon a time", raw=True, options=seeded)
    assert a.response == b.response


def test_generate_plain_and_streamed(oc):
    plain = oc.generate(model=MODEL_NAME, prompt="Say hi.", system="You are terse.", options=GREEDY)
    assert plain.response and plain.done
    parts = list(oc.generate(model=MODEL_NAME, prompt="Say hi.", system="You are terse.", options=GREEDY,
                             stream=True))
    assert "".join(p.response for p in parts) == plain.response and parts[-1].done


def test_format_json(oc):
    r = oc.chat(model=MODEL_NAME, messages=[{"role": "user", "content": "Give a JSON object."}], format="json",
                options={"temperature": 0, "num_predict": 24})
    assert r.message.content.lstrip().startswith("{")


def test_embed(oc):
    r = oc.embed(model=MODEL_NAME, input=["a red apple", "a green pear"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) > 16
    assert abs(sum(x * x for x in r.embeddings[0]) - 1.0) < 1e-3  # L2-normalized, as /v1/embeddings
    one = oc.embed(model=f"{MODEL_NAME}:latest", input="a red apple")
    assert one.embeddings[0] == pytest.approx(r.embeddings[0], abs=1e-5)


def test_list_show_ps_version(oc, server):
    assert [m.model for m in oc.list().models] == [MODEL_NAME]
    shown = oc.show(MODEL_NAME)
    assert shown.modelinfo["general.context_length"] == MAX_MODEL_LEN and shown.template
    assert [m.model for m in oc.ps().models] == [MODEL_NAME]
    # the ollama package has no version call: Open WebUI and others GET it
    from kvferry.cli_parser import package_version
    assert httpx.get(f"{server.base_url}/api/version", timeout=10).json() == {"version": package_version()}


def test_unknown_model_is_an_ollama_error(oc, server):
    with pytest.raises(ollama.ResponseError) as info:
        oc.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404 and "no-such-model" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        oc.show("no-such-model")
    assert info.value.status_code == 404
    r = httpx.post(f"{server.base_url}/api/chat", content=b"{not json", timeout=10)
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "messages[0].images"),
    ({"messages": [{"role": "user", "content": "hi"}], "format": "yaml"}, "format"),
    ({"messages": [{"role": "user", "content": "hi"}], "options": {"temperature": "hot"}}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "options": "fast"}, "options"),
])
def test_bad_bodies_are_400_and_the_server_keeps_serving(server, oc, body, field):
    r = httpx.post(f"{server.base_url}/api/chat", json={"model": MODEL_NAME, **body}, timeout=30)
    assert r.status_code == 400 and field in r.json()["error"], r.text
    assert oc.chat(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], options=GREEDY).done


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _few_shot() -> list[dict]:
    """Three earlier turns that called get_weather (Ollama's message shape):
    greedy decoding then writes a fourth call itself (as tests/serve/test_tools.py)."""
    messages = []
    for city, temp in [("Paris", "18C"), ("Berlin", "12C"), ("Madrid", "25C")]:
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": city}}}]},
            {"role": "tool", "content": temp},
            {"role": "assistant", "content": f"It is {temp} in {city}."},
        ]
    return messages + [{"role": "user", "content": "What is the weather in Rome?"}]


def test_tool_calls_plain_and_streamed(oc):
    options = {"temperature": 0, "num_predict": 40}
    plain = oc.chat(model=MODEL_NAME, messages=_few_shot(), tools=[WEATHER], options=options)
    calls = plain.message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and calls[0].function.arguments == {"city": "Rome"}
    parts = list(oc.chat(model=MODEL_NAME, messages=_few_shot(), tools=[WEATHER], options=options, stream=True))
    streamed = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [("get_weather", {"city": "Rome"})]
    assert parts[-1].done
