"""The Responses API through the real ``openai`` client (client.responses),
against the session server: create, stream, continue, retrieve, delete,
tools; and the store's bounds and expiry."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvferry.serve.protocol import ChatMessage, ResponseObject
from kvferry.serve.responses import ResponseStore
from tests.serve.server_process import MODEL_NAME
from tests.serve.test_api import LONG_SYSTEM
from tests.serve.test_tools import WEATHER

pytestmark = pytest.mark.usefixtures("healthy")

RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


def test_create_retrieve_delete(client):
    r = client.responses.create(model=MODEL_NAME, input="What is the capital of France?", instructions="Be brief.",
                                max_output_tokens=12, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text and r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens <= 12 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 12
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_max_output_tokens_makes_incomplete(client):
    r = client.responses.create(model=MODEL_NAME, input="Count to one hundred.", max_output_tokens=3,
                                extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_previous_response_id_continues_and_reuses_kv(client):
    """The second turn's prompt starts with the first turn's, so its prefix
    KV blocks are found in the cache: cached_tokens covers the first prompt
    (in whole blocks), and the model sees the earlier exchange."""
    first = client.responses.create(model=MODEL_NAME, instructions=LONG_SYSTEM,
                                    input="Which cities do you ship between?", max_output_tokens=16, temperature=0)
    second = client.responses.create(model=MODEL_NAME, instructions=LONG_SYSTEM, previous_response_id=first.id,
                                     input="And is weekend delivery more expensive?", max_output_tokens=8,
                                     temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - 16, (cached, first.usage.input_tokens)
    # The same turn without the history is a shorter prompt: the history was really in it.
    alone = client.responses.create(model=MODEL_NAME, instructions=LONG_SYSTEM,
                                    input="And is weekend delivery more expensive?", max_output_tokens=1)
    assert alone.usage.input_tokens < second.usage.input_tokens


def test_stream_events(client):
    args = dict(model=MODEL_NAME, input="Name three colors.", max_output_tokens=12, temperature=0)
    events = list(client.responses.create(stream=True, **args))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == events[-4].text
    assert final.usage.output_tokens > 0
    assert client.responses.retrieve(final.id).output_text == text  # streamed responses are stored too
    assert text == client.responses.create(**args).output_text  # as the non-streamed one


def test_store_false_and_unknown_previous(client, server):
    r = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL_NAME, input="Hi", previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": [{"type": "banana"}]}, "input.0"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.message.role"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": 5}, "input"),
])
def test_bad_input(server, body, param):
    r = httpx.post(f"{server.api_url}/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def _few_shot_items() -> list[dict]:
    items = []
    for i, (city, temp) in enumerate([("Paris", "18C"), ("Berlin", "12C"), ("Madrid", "25C")]):
        items += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"type": "function_call", "call_id": f"call_{i}", "name": "get_weather",
             "arguments": json.dumps({"city": city})},
            {"type": "function_call_output", "call_id": f"call_{i}", "output": temp},
            {"role": "assistant", "content": f"It is {temp} in {city}."},
        ]
    return items + [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_tool_call_loop(client, stream):
    args = dict(model=MODEL_NAME, tools=[RESPONSES_WEATHER], temperature=0, max_output_tokens=40)
    if stream:
        events = list(client.responses.create(input=_few_shot_items(), stream=True, **args))
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and done[0].name == "get_weather"
        first = events[-1].response
    else:
        first = client.responses.create(input=_few_shot_items(), **args)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    # The tool result continues the stored conversation.
    second = client.responses.create(previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21C"}], **args)
    assert not [o for o in second.output if o.type == "function_call"]
    assert "21C" in second.output_text
    assert second.usage.input_tokens_details.cached_tokens > 0


def _response(rid: str) -> ResponseObject:
    return ResponseObject(id=rid, created_at=0, status="completed", model="m")


def test_store_bounds_and_expiry():
    now = [0.0]
    store = ResponseStore(max_size=2, ttl_s=10, clock=lambda: now[0])
    conversation = [ChatMessage(role="user", content="hi")]
    store.put(_response("a"), conversation, "t1")
    store.put(_response("b"), conversation, "t1")
    assert store.get("a", "t1") is not None  # a is now the most recently used
    store.put(_response("c"), conversation, "t1")
    assert store.get("b", "t1") is None and store.get("a", "t1") is not None and len(store) == 2
    now[0] = 10.0
    assert store.get("a", "t1") is None and store.get("c", "t1") is None and len(store) == 0
    store.put(_response("d"), conversation, "t1")
    # Another tenant neither sees nor deletes it; its owner does, once.
    assert store.get("d", "t2") is None and not store.delete("d", "t2")
    assert store.delete("d", "t1") and not store.delete("d", "t1")
