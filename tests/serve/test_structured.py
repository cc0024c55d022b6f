"""Structured outputs through the real ``openai`` client against a real
server (the embedded SmolLM2): response_format json_object / json_schema,
vLLM's structured_outputs and guided_* extensions, enforced tool_choice,
streaming, and 400s that name the field for constraints that cannot compile."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.serve.server_process import MODEL_NAME

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "likes": {"type": "array", "items": {"enum": ["tea", "coffee", "cake"]}, "maxItems": 3}},
    "required": ["name", "age", "likes"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PROMPTS = ["Describe a baker from Lyon.", "Invent a pirate captain.", "Tell me about your grandmother.",
           "Who is the oldest person you know?", "Make up a robot character.", "Describe a student who loves tea."]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                         "parameters": {"type": "object", "properties": {
                                             "tz": {"type": "string", "maxLength": 20}}, "required": ["tz"]}}}


def _chat(client, content: str, **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def test_json_schema_outputs_validate(client, healthy):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda p: _chat(client, p, max_tokens=120, response_format=PERSON_FORMAT), PROMPTS))
    for r in replies:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_sampled_and_on_completions(client, healthy):
    r = client.completions.create(model=MODEL_NAME, prompt="A person as JSON:", max_tokens=120, temperature=1.0,
                                  seed=7, extra_body={"response_format": PERSON_FORMAT})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


@pytest.mark.parametrize("prompt", ['Return a JSON object with the key "ok" set to true.',
                                    "Give the capital of France as JSON."])
def test_json_object_parses(client, healthy, prompt):
    r = _chat(client, prompt, max_tokens=150, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_choice_and_grammar_extensions(client, healthy):
    r = client.completions.create(model=MODEL_NAME, prompt="My phone number is", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
    options = ["positive", "negative", "neutral"]
    r = _chat(client, "Sentiment of 'I love this!'?", max_tokens=10, extra_body={"structured_outputs": {"choice": options}})
    assert r.choices[0].message.content in options
    r = _chat(client, "Is the sky blue?", max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = _chat(client, "Pick a colour.", max_tokens=10,
              extra_body={"structured_outputs": {"grammar": 'root ::= "red" | "green" | "blue"'}})
    assert r.choices[0].message.content in ("red", "green", "blue")
    r = _chat(client, "Give a person.", max_tokens=120, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_streaming_json_schema(client, healthy):
    stream = _chat(client, "Invent a pirate captain.", max_tokens=120, response_format=PERSON_FORMAT, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    streamed_whole = _chat(client, "Invent a pirate captain.", max_tokens=120, response_format=PERSON_FORMAT)
    assert text == streamed_whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_bad_constraints_are_400_naming_the_field(client, healthy, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, "hi", max_tokens=5, extra_body=body)
    assert info.value.body["param"] == param, info.value.body
    # The server keeps serving.
    assert _chat(client, "hi", max_tokens=2).choices[0].message.content is not None


def _checked_call(reply, name: str | None, tools) -> dict:
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.function.name in schemas and (name is None or call.function.name == name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schemas[call.function.name])
    return arguments


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named_is_enforced(client, healthy, stream):
    tools = [WEATHER, TIME]
    choice = {"type": "function", "function": {"name": "get_time"}}
    if not stream:
        reply = _chat(client, "Tell me a joke.", max_tokens=80, tools=tools, tool_choice=choice)
        _checked_call(reply, "get_time", tools)
        return
    chunks = list(_chat(client, "Tell me a joke.", max_tokens=80, tools=tools, tool_choice=choice, stream=True))
    calls = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_time"
    arguments = json.loads("".join(c.function.arguments or "" for c in calls))
    jsonschema.validate(arguments, TIME["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_required_is_enforced(client, healthy):
    tools = [WEATHER, TIME]
    for prompt in ["What's the weather in Paris?", "Hello there!", "What time is it in Tokyo?"]:
        _checked_call(_chat(client, prompt, max_tokens=80, tools=tools, tool_choice="required"), None, tools)


def test_structured_next_to_free_requests(client, healthy):
    """Free greedy requests give the same text whether or not constrained
    requests share their batches."""
    free = ["Write a haiku about rain.", "Count to five.", "Name a planet."]
    alone = [_chat(client, p, max_tokens=24).choices[0].message.content for p in free]
    with ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(_chat, client, p, max_tokens=120, response_format=PERSON_FORMAT)
                       for p in PROMPTS[:3]]
        mixed = list(pool.map(lambda p: _chat(client, p, max_tokens=24).choices[0].message.content, free))
        for f in constrained:
            jsonschema.validate(json.loads(f.result().choices[0].message.content), PERSON)
    assert mixed == alone
