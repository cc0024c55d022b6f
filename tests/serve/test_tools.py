"""Tool calling: the parsers on model-shaped text (whole and streamed in
every split), tool_choice planning and schema checks, the bundled template
as transformers renders it, and a two-step agent loop through the real
``openai`` client where the real model generates the call.

The server test makes the embedded model call a tool with a few-shot
conversation (three earlier turns that called ``get_weather``); greedy
decoding then writes a fourth call itself, and the server parses that text.
"""
from __future__ import annotations

import json

import pytest

from kvferry.serve.errors import APIError
from kvferry.serve.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from kvferry.serve.tools import bundled_tool_template, message_dicts, plan_tools, template_for
from kvferry.serve.tools.parsers import HermesParser, Llama3JsonParser, make_parser
from tests.serve.server_process import MODEL_NAME

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _stream_all(parser, text: str, cuts: list[int]):
    stream = parser.stream()
    content, calls, last = "", [], 0
    for cut in [*cuts, len(text)]:
        step = stream.feed(text[last:cut])
        content += step.content
        calls += step.tool_calls
        last = cut
    step = stream.finish()
    return content + step.content, calls + step.tool_calls


def test_hermes_parse():
    parsed = HermesParser().parse(HERMES_TEXT)
    assert parsed.content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_hermes_stream_equals_whole_for_every_split():
    whole = HermesParser().parse(HERMES_TEXT)
    for cut in range(len(HERMES_TEXT) + 1):
        content, calls = _stream_all(HermesParser(), HERMES_TEXT, [cut])
        assert content == whole.content, cut
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_hermes_stream_sends_content_before_a_call_completes():
    stream = HermesParser().stream()
    assert stream.feed("Hello <tool").content == "Hello "  # "<tool" may start a tag: held
    step = stream.feed('_call>{"name": "get_time", "arguments": {}}')
    assert step.content == "" and step.tool_calls == []  # the call is not complete yet
    assert [c.name for c in stream.feed("</tool_call>").tool_calls] == ["get_time"]


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
    '<tool_call>["get_weather"]</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    'a < b and <tool_ is not a tag',
])
def test_hermes_malformed_stays_content(text):
    parsed = HermesParser().parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_hermes_unclosed_call_at_eos():
    # Generation stopped (EOS) before the closing tag: a complete JSON call still counts.
    parsed = HermesParser().parse('<tool_call>\n{"name": "get_time", "arguments": {}}\n')
    assert [c.name for c in parsed.tool_calls] == ["get_time"]


def test_llama3_json():
    p = Llama3JsonParser()
    parsed = p.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome; Italy"}}; '
                     '{"name": "get_time", "parameters": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Rome; Italy"}), ("get_time", {})]
    assert p.parse("The weather is nice.").content == "The weather is nice."
    assert p.parse('{"not": "a call"}').tool_calls == []
    content, calls = _stream_all(p, '  {"name": "get_time", "parameters": {}}', [1, 3, 9])
    assert content == "" and [c.name for c in calls] == ["get_time"]
    content, calls = _stream_all(p, "Plain answer.", [2, 5])
    assert content == "Plain answer." and calls == []


def test_qwen_is_hermes_format():
    assert [c.name for c in make_parser("qwen").parse(HERMES_TEXT).tool_calls] == ["get_weather", "get_time"]
    with pytest.raises(ValueError, match="tool_call_parser"):
        make_parser("nope")


def _tools(*tools):
    return [ToolDefinition.model_validate(t) for t in tools]


def test_plan_checks_calls_against_schema():
    plan = plan_tools(_tools(WEATHER, TIME), "auto", "hermes")
    ok = plan.parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert [c.name for c in ok.tool_calls] == ["get_weather"]
    bad = plan.parse('<tool_call>{"name": "get_weather", "arguments": {"town": "Oslo"}}</tool_call>')
    assert bad.tool_calls == [] and "get_weather" in bad.content  # kept as text
    unknown = plan.parse('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')
    assert unknown.tool_calls == []


def test_plan_tool_choice():
    assert not plan_tools(_tools(WEATHER), "none", "hermes").active
    assert not plan_tools(None, None, "hermes").active
    required = plan_tools(_tools(WEATHER, TIME), "required", "hermes")
    assert required.active and "must call" in required.instruction and len(required.tools) == 2
    named = plan_tools(_tools(WEATHER, TIME), NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_time"}}), "hermes")
    assert [t["function"]["name"] for t in named.tools] == ["get_time"] and "get_time" in named.instruction
    assert named.parse('<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call>').tool_calls == []
    with pytest.raises(APIError) as err:
        plan_tools(_tools(WEATHER), NamedToolChoice.model_validate(
            {"type": "function", "function": {"name": "missing"}}), "hermes")
    assert err.value.param == "tool_choice"
    with pytest.raises(APIError) as err:
        plan_tools(_tools({"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}), "auto", "hermes")
    assert err.value.param == "tools.0.function.parameters"


def test_bundled_template_matches_transformers(tmp_path):
    """The bundled template renders through our Tokenizer exactly as through
    transformers (the ground truth for chat templates)."""
    transformers = pytest.importorskip("transformers")
    from kvferry.model.tokenizer import Tokenizer
    from tests.tiny_models import write_tokenizer

    write_tokenizer(tmp_path)
    req = ChatCompletionRequest.model_validate_json(json.dumps({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "25C"},
        {"role": "assistant", "content": "Paris 18C, Rome 25C."},
    ], "tools": [WEATHER]}))
    plan = plan_tools(req.tools, None, "hermes")
    messages = message_dicts(req.messages)
    ours = Tokenizer(tmp_path).apply_chat_template(messages, tools=plan.tools, chat_template=bundled_tool_template())
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    theirs = hf.apply_chat_template(messages, tools=plan.tools, chat_template=bundled_tool_template(),
                                    tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in ours
    assert "<tool_response>\n18C\n</tool_response>\n<tool_response>\n25C\n</tool_response>" in ours
    # A model template with tool support is kept; one without is replaced only when tools are used.
    assert template_for("{{ tools }}{{ tool_call }}", None, True) == "{{ tools }}{{ tool_call }}"
    assert template_for("plain", None, False) == "plain"
    assert template_for("plain", None, True) == bundled_tool_template()
    assert template_for("plain", "override", True) == "override"


# ---- through the server --------------------------------------------------------

def _few_shot() -> list[dict]:
    messages = []
    for i, (city, temp) in enumerate([("Paris", "18C"), ("Berlin", "12C"), ("Madrid", "25C")]):
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": temp},
            {"role": "assistant", "content": f"It is {temp} in {city}."},
        ]
    return messages + [{"role": "user", "content": "What is the weather in Rome?"}]


def _streamed(client, **kwargs):
    """Accumulate a streamed reply as the openai docs show: content and tool-call deltas by index."""
    content, calls, finish = "", {}, None
    shapes = []  # (id sent, name, arguments) of each tool-call delta
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                shapes.append((tc.id is not None, tc.function.name, tc.function.arguments))
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    if shapes:  # as OpenAI: the first delta opens the call, arguments follow without id or name
        assert shapes[0][0] and shapes[0][1] and shapes[0][2] == "", shapes
        assert not shapes[1][0] and shapes[1][1] is None, shapes
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_agent_loop(client, stream):
    args = dict(model=MODEL_NAME, tools=[WEATHER], temperature=0, max_tokens=40)
    messages = _few_shot()
    # Step 1: the model calls the tool.
    if stream:
        content, calls, finish = _streamed(client, messages=messages, **args)
    else:
        r = client.chat.completions.create(messages=messages, **args)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        content = msg.content or ""
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []]
    assert finish == "tool_calls", (content, calls)
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Rome"}
    assert not content.strip()
    # Step 2: send the result back; the model answers in text.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0]["id"], "type": "function",
             "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "21C"},
    ]
    r = client.chat.completions.create(messages=messages, **args)
    answer = r.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "21C" in answer.message.content


def test_tool_choice_none_leaves_text(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=_few_shot(), tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=40)
    choice = r.choices[0]
    # Tools are neither shown nor parsed: whatever the model writes stays text.
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
