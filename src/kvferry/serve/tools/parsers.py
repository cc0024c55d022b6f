"""Tool-call parsers: generated text -> (content, tool calls), per model family.

    parser = make_parser("hermes")
    parser.parse(text)                       -> ParsedOutput   (whole text)
    stream = parser.stream(); stream.feed(delta) / stream.finish()
                                             -> StreamDelta    (as text arrives)

Formats:
- ``hermes`` / ``qwen``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number, with free text around them (Hermes 2 Pro, Qwen 2.5 / 3).
- ``llama3_json``: the whole reply is a JSON call ``{"name": ..., "parameters":
  {...}}`` (several joined by ``;``), optionally after ``<|python_tag|>``.

A call whose JSON does not parse, or that lacks a string name or an object of
arguments, is not a call: its text stays in the content, so that nothing the
model wrote is lost.
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


@dataclass(slots=True)
class ParsedOutput:
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


@dataclass(slots=True)
class StreamDelta:
    """What a chunk of generated text adds: content to send now, and calls
    completed by it (each sent whole, in one tool-call delta)."""

    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call_json(text: str, arguments_key: str) -> ParsedToolCall | None:
    """``{"name": str, <arguments_key>: object}`` -> a call, else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser(ABC):
    name: str

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput: ...

    @abstractmethod
    def stream(self) -> "ToolCallStream": ...


class ToolCallStream(ABC):
    @abstractmethod
    def feed(self, text: str) -> StreamDelta: ...

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The end of the generation: anything held back."""


# ---- hermes / qwen --------------------------------------------------------------

class HermesParser(ToolCallParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        first, last = stream.feed(text), stream.finish()
        return ParsedOutput(first.content + last.content, first.tool_calls + last.tool_calls)

    def stream(self) -> "_HermesStream":
        return _HermesStream(self.START, self.END)


class _HermesStream(ToolCallStream):
    """Content passes through at once, except a tail that might begin a
    ``<tool_call>`` tag; a call is held until its closing tag."""

    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self.buffer = ""
        self.in_call = False
        self.seen_call = False

    def feed(self, text: str) -> StreamDelta:
        self.buffer += text
        out = StreamDelta()
        while True:
            if self.in_call:
                close = self.buffer.find(self.end)
                if close < 0:
                    return out
                self._end_call(self.buffer[:close], out, closed=True)
                self.buffer = self.buffer[close + len(self.end):]
                continue
            open_at = self.buffer.find(self.start)
            if open_at < 0:
                keep = _partial_suffix(self.buffer, self.start)
                out.content += self._content(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            out.content += self._content(self.buffer[:open_at])
            self.buffer = self.buffer[open_at + len(self.start):]
            self.in_call = True

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self.in_call:  # generation ended (EOS, length) before the closing tag
            self._end_call(self.buffer, out, closed=False)
        else:
            out.content += self._content(self.buffer)
        self.buffer = ""
        return out

    def _end_call(self, body: str, out: StreamDelta, closed: bool) -> None:
        self.in_call = False
        call = parse_call_json(body.strip(), "arguments")
        if call is None:  # not a call after all: give back the text exactly
            out.content += self.start + body + (self.end if closed else "")
        else:
            out.tool_calls.append(call)
            self.seen_call = True

    def _content(self, text: str) -> str:
        # Whitespace between calls is layout, not content.
        return text.strip() if self.seen_call and not text.strip() else text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- llama 3 JSON ---------------------------------------------------------------

class Llama3JsonParser(ToolCallParser):
    """Llama 3.1+ "JSON based tool calling": the reply is the call."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].strip()
        if not body.startswith("{"):
            return ParsedOutput(text)
        calls = [parse_call_json(part, "parameters") or parse_call_json(part, "arguments")
                 for part in _split_calls(body)]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text)
        return ParsedOutput("", [c for c in calls if c is not None])

    def stream(self) -> "_WholeReplyStream":
        return _WholeReplyStream(self)


def _split_calls(body: str) -> list[str]:
    """Split ``{..}; {..}`` at top-level semicolons (not inside strings)."""
    parts, depth, in_str, escape, start = [], 0, False, False, 0
    for i, c in enumerate(body):
        if in_str:
            escape = c == "\\" and not escape
            if c == '"' and not escape:
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == ";" and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    parts.append(body[start:].strip())
    return [p for p in parts if p]


class _WholeReplyStream(ToolCallStream):
    """The reply is either all calls or all content: decided by its first
    non-blank characters, then streamed (content) or held to the end (calls)."""

    def __init__(self, parser: Llama3JsonParser) -> None:
        self.parser = parser
        self.buffer = ""
        self.mode: str | None = None  # "content" | "calls" once known

    def feed(self, text: str) -> StreamDelta:
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            tag = self.parser.PYTHON_TAG
            if not head or (tag.startswith(head) and head != tag):
                return StreamDelta()
            self.mode = "calls" if head.startswith(("{", tag)) else "content"
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return StreamDelta(out)
        return StreamDelta()

    def finish(self) -> StreamDelta:
        text, self.buffer = self.buffer, ""
        if self.mode == "content":
            return StreamDelta(text)
        parsed = self.parser.parse(text)
        return StreamDelta(parsed.content, parsed.tool_calls)


class QwenParser(HermesParser):
    name = "qwen"  # Qwen 2.5 / 3 use the Hermes tags


_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser, "qwen": QwenParser, "llama3_json": Llama3JsonParser,
}


def make_parser(name: str) -> ToolCallParser:
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {sorted(_PARSERS)}, got {name!r}") from None
