"""Tool calling: prompt side (which template, which tools, what instruction)
and output side (parse the generated text, check calls against the schemas).

    plan = plan_tools(req.tools, req.tool_choice, parser_name)   # per request
    messages = plan.messages(req.messages)       # dicts for the chat template
    plan.parse(text) / plan.stream()             # ParsedOutput / StreamDelta

``required`` and a named function are rendered as an instruction and enforced
by a grammar (``plan.grammar``, see ``tools/grammar.py``): the reply is one
call, in the parser's format, whose arguments follow the function's schema.
A call that names a tool not offered, or whose arguments break
the tool's JSON Schema, is not reported as a call: its text stays content.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

import jsonschema

from kvferry.serve.errors import bad_request
from kvferry.serve.protocol import ChatMessage, NamedToolChoice, ToolDefinition
from kvferry.serve.tools.grammar import tool_call_grammar
from kvferry.serve.tools.parsers import (
    ParsedOutput, ParsedToolCall, StreamDelta, ToolCallParser, ToolCallStream, make_parser,
)

__all__ = ["ToolPlan", "plan_tools", "bundled_tool_template", "template_for", "message_dicts",
           "ParsedOutput", "ParsedToolCall", "StreamDelta"]


@lru_cache(maxsize=1)
def bundled_tool_template() -> str:
    return resources.files("kvferry.serve.tools").joinpath("templates/hermes_tools.jinja").read_text("utf-8")


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template and "tool_call" in template


def template_for(model_template: str | None, override: str | None, uses_tools: bool) -> str | None:
    """The chat template to render with: ``--chat-template`` if given; else the
    model's, unless the request uses tools and the model's cannot show them."""
    if override is not None:
        return override
    if uses_tools and not template_supports_tools(model_template):
        return bundled_tool_template()
    return model_template


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (transformers' conventions)."""
    return [_message_dict(m, i) for i, m in enumerate(messages)]


def _message_dict(message: ChatMessage, i: int) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported", f"messages.{i}.content")
            texts.append(part["text"])
        content = "\n".join(texts)
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        # Templates index arguments as a mapping (as transformers passes them).
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in message.tool_calls]
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


@dataclass(slots=True)
class ToolPlan:
    """One request's tools: what the template shows and how output is read."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # as the template gets them; [] = none
    instruction: str | None = None
    parser: ToolCallParser | None = None  # None: no tool parsing
    validators: dict[str, Any] = field(default_factory=dict)  # tool name -> jsonschema validator
    # EBNF the output must match: set for tool_choice "required" or a named function.
    grammar: str | None = None

    @property
    def active(self) -> bool:
        return self.parser is not None

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages with the tool_choice instruction added to the system turn."""
        if not self.instruction:
            return messages
        if messages and messages[0]["role"] == "system":
            first = {**messages[0], "content": f"{messages[0]['content']}\n\n{self.instruction}"}
            return [first, *messages[1:]]
        return [{"role": "system", "content": self.instruction}, *messages]

    def parse(self, text: str) -> ParsedOutput:
        if self.parser is None:
            return ParsedOutput(text)
        parsed = self.parser.parse(text)
        return self._checked(parsed.content, parsed.tool_calls)

    def stream(self) -> "CheckedStream":
        assert self.parser is not None
        return CheckedStream(self, self.parser.stream())

    def _checked(self, content: str, calls: list[ParsedToolCall]) -> ParsedOutput:
        kept = []
        for call in calls:
            if self.is_valid(call):
                kept.append(call)
            else:
                content += f'<tool_call>{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}</tool_call>'
        return ParsedOutput(content, kept)

    def is_valid(self, call: ParsedToolCall) -> bool:
        validator = self.validators.get(call.name, False)
        if validator is False:  # a tool that was not offered
            return False
        return validator is None or validator.is_valid(json.loads(call.arguments))


class CheckedStream:
    def __init__(self, plan: ToolPlan, inner: ToolCallStream) -> None:
        self.plan = plan
        self.inner = inner

    def feed(self, text: str) -> StreamDelta:
        return self._checked(self.inner.feed(text))

    def finish(self) -> StreamDelta:
        return self._checked(self.inner.finish())

    def _checked(self, delta: StreamDelta) -> StreamDelta:
        if not delta.tool_calls:
            return delta
        checked = self.plan._checked(delta.content, delta.tool_calls)
        return StreamDelta(checked.content, checked.tool_calls)


def plan_tools(tools: list[ToolDefinition] | None, tool_choice: Any, parser_name: str,
               param: str = "tools") -> ToolPlan:
    """Check tools / tool_choice (400 naming the field) and plan the request."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice is only allowed when tools are specified", "tool_choice")
        return ToolPlan()
    if tool_choice == "none":
        return ToolPlan()  # tools are neither shown nor parsed, as vLLM's default
    offered = tools
    instruction = None
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        offered = [t for t in tools if t.function.name == name]
        if not offered:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        instruction = f"You must call the function {name}."
    elif tool_choice == "required":
        instruction = "You must call at least one of the functions."
    validators = {t.function.name: _validator(t, i, param) for i, t in enumerate(offered)}
    dumped = [t.model_dump(exclude_none=True) for t in offered]
    grammar = None
    if instruction is not None:
        try:
            grammar = tool_call_grammar(dumped, parser_name)
        except ValueError as exc:
            raise bad_request(str(exc), "tool_choice" if "format" in str(exc) else param) from None
    return ToolPlan(dumped, instruction, make_parser(parser_name), validators, grammar)


def _validator(tool: ToolDefinition, i: int, param: str) -> Any:
    schema = tool.function.parameters
    if schema is None:
        return None
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad_request(f"{param}[{i}].function.parameters is not a valid JSON Schema: {exc.message}",
                          f"{param}.{i}.function.parameters") from None
    return cls(schema)
