"""Tool calling: prompt side (which template, which tools, what instruction)
and output side (parse the generated text, check calls against the schemas).

    plan = plan_tools(req.tools, req.tool_choice, parser_name)   # per request
    messages = plan.messages(req.messages)       # dicts for the chat template
    await plan.parse_async(text) / plan.stream() # ParsedOutput / StreamDelta (await feed, finish)

``required`` and a named function are rendered as an instruction and enforced
by a grammar (``plan.grammar``, see ``tools/grammar.py``): the reply is one
call, in the parser's format, whose arguments follow the function's schema.
A call that names a tool not offered, or whose arguments break
the tool's JSON Schema, is not reported as a call: its text stays content.

Schemas come from the client, so they are checked when the request arrives
(``kvferry.structured.schema_guard``: references only inside the schema,
patterns RE2 can run) and arguments are checked on a worker thread within
SCHEMA_CHECK_BUDGET_S; a check that cannot finish fails the request (400
naming the tool's parameters) and never holds up the event loop.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

import jsonschema

from kvferry.serve.errors import APIError, bad_request
from kvferry.serve.protocol import ChatMessage, NamedToolChoice, ToolDefinition
from kvferry.serve.tools.grammar import tool_call_grammar
from kvferry.serve.tools.parsers import (
    ParsedOutput, ParsedToolCall, StreamDelta, ToolCallParser, ToolCallStream, make_parser,
)
from kvferry.structured import schema_guard

# Time one reply's tool calls may spend being checked against their schemas.
# With RE2 patterns a check is linear in the schema and the arguments;
# what still grows faster (nested allOf / $ref fan-out, uniqueItems on long
# arrays) is cut off here instead of running unbounded.
SCHEMA_CHECK_BUDGET_S = 2.0

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
    # tool name -> the request field of its parameters, named by a failed check.
    schema_params: dict[str, str] = field(default_factory=dict)

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
        """Parse and check in the calling thread (not for the event loop:
        see ``parse_async``)."""
        if self.parser is None:
            return ParsedOutput(text)
        parsed = self.parser.parse(text)
        deadline = time.monotonic() + SCHEMA_CHECK_BUDGET_S
        valid = [self._is_valid(call, deadline) for call in parsed.tool_calls]
        return self._checked(parsed.content, parsed.tool_calls, valid)

    async def parse_async(self, text: str) -> ParsedOutput:
        if self.parser is None:
            return ParsedOutput(text)
        parsed = self.parser.parse(text)
        return self._checked(parsed.content, parsed.tool_calls, await self.check(parsed.tool_calls))

    def stream(self) -> "CheckedStream":
        assert self.parser is not None
        return CheckedStream(self, self.parser.stream())

    async def check(self, calls: list[ParsedToolCall]) -> list[bool]:
        """Whether each call names an offered tool and its arguments follow
        the tool's schema. The schema work runs on a worker thread: the
        event loop only waits, at most SCHEMA_CHECK_BUDGET_S for all calls."""
        deadline = time.monotonic() + SCHEMA_CHECK_BUDGET_S
        valid = []
        for call in calls:
            if self.validators.get(call.name) is None:  # not offered (False) or no schema (None)
                valid.append(self._is_valid(call, deadline))
                continue
            try:
                # The grace second lets the thread's own deadline fire first,
                # with its more precise reason.
                valid.append(await asyncio.wait_for(asyncio.to_thread(self._is_valid, call, deadline),
                                                    max(deadline - time.monotonic(), 0) + 1.0))
            except TimeoutError:
                raise self._check_failed(call, "checking against it took longer than the time allowed") from None
        return valid

    def _checked(self, content: str, calls: list[ParsedToolCall], valid: list[bool]) -> ParsedOutput:
        kept = []
        for call, ok in zip(calls, valid):
            if ok:
                kept.append(call)
            else:
                content += f'<tool_call>{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}</tool_call>'
        return ParsedOutput(content, kept)

    def _is_valid(self, call: ParsedToolCall, deadline: float) -> bool:
        validator = self.validators.get(call.name, False)
        if validator is False:  # a tool that was not offered
            return False
        if validator is None:
            return True
        try:
            return schema_guard.is_valid_within(validator, json.loads(call.arguments), deadline)
        except schema_guard.SchemaCheckError as exc:
            raise self._check_failed(call, str(exc)) from None

    def _check_failed(self, call: ParsedToolCall, reason: str) -> APIError:
        param = self.schema_params.get(call.name)
        where = _dotted_to_indexed(param) if param else "tools"
        return APIError(400, f"{where}: the arguments of a call to {call.name!r} could not be checked against "
                             f"this schema: {reason}", param=param, code="schema_check_failed")


def _dotted_to_indexed(param: str) -> str:
    # "tools.0.function.parameters" -> "tools[0].function.parameters", as messages name fields.
    return ".".join(f"[{p}]" if p.isdigit() else p for p in param.split(".")).replace(".[", "[")


class CheckedStream:
    def __init__(self, plan: ToolPlan, inner: ToolCallStream) -> None:
        self.plan = plan
        self.inner = inner

    async def feed(self, text: str) -> StreamDelta:
        return await self._checked(self.inner.feed(text))

    async def finish(self) -> StreamDelta:
        return await self._checked(self.inner.finish())

    async def _checked(self, delta: StreamDelta) -> StreamDelta:
        if not delta.tool_calls:
            return delta
        checked = self.plan._checked(delta.content, delta.tool_calls, await self.plan.check(delta.tool_calls))
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
    schema_params = {t.function.name: f"{param}.{i}.function.parameters" for i, t in enumerate(offered)}
    dumped = [t.model_dump(exclude_none=True) for t in offered]
    grammar = None
    if instruction is not None:
        try:
            grammar = tool_call_grammar(dumped, parser_name)
        except ValueError as exc:
            raise bad_request(str(exc), "tool_choice" if "format" in str(exc) else param) from None
    return ToolPlan(dumped, instruction, make_parser(parser_name), validators, grammar, schema_params)


def _validator(tool: ToolDefinition, i: int, param: str) -> Any:
    schema = tool.function.parameters
    if schema is None:
        return None
    try:
        # Before anything reads the schema (xgrammar, jsonschema): no remote
        # $ref is ever followed, and every pattern runs in linear time.
        schema_guard.check_schema(schema, validation=True)
    except schema_guard.UnsafeSchemaError as exc:
        raise bad_request(f"{param}[{i}].function.parameters: {exc}", f"{param}.{i}.function.parameters") from None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad_request(f"{param}[{i}].function.parameters is not a valid JSON Schema: {exc.message}",
                          f"{param}.{i}.function.parameters") from None
    return schema_guard.validator(schema)
