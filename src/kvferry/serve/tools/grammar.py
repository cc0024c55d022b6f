"""The grammar that enforces ``tool_choice`` "required" or a named function.

A call is written in the tool-call parser's own format, so the parser reads
it back, and its arguments follow the function's JSON Schema, so they always
validate. The grammar is EBNF text (xgrammar composes the JSON-schema part),
carried to the core as ``structured_outputs.grammar``::

    hermes / qwen:  "<tool_call>\n" {"name": "<fn>", "arguments": <schema>} "\n</tool_call>"
    llama3_json:    {"name": "<fn>", "parameters": <schema>}

With several functions the JSON part is an ``anyOf`` over them, one branch
per function, so a name always comes with its own arguments.
"""
from __future__ import annotations

import json
from typing import Any

from kvferry.extras import require
from kvferry.structured.errors import library_reason

# The key that holds the arguments, and the text around one call, per parser.
_FORMATS: dict[str, tuple[str, str, str]] = {
    "hermes": ("arguments", "<tool_call>\n", "\n</tool_call>"),
    "qwen": ("arguments", "<tool_call>\n", "\n</tool_call>"),
    "llama3_json": ("parameters", "", ""),
}


def tool_call_grammar(tools: list[dict[str, Any]], parser_name: str) -> str:
    """EBNF for exactly one call of one of ``tools`` (OpenAI tool dicts).

    Raises ValueError for a parser without a known format or a schema
    xgrammar cannot compile."""
    require("xgrammar", "structured", "tool_choice")
    import xgrammar as xgr  # heavy; loaded on the first enforced tool call

    if parser_name not in _FORMATS:
        raise ValueError(f"tool_choice cannot be enforced for the {parser_name!r} tool-call format")
    arguments_key, before, after = _FORMATS[parser_name]
    branches = [_call_schema(t["function"], arguments_key) for t in tools]
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    try:
        parts = [xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)]
    except RuntimeError as exc:
        # Without xgrammar's timestamp and build paths: the reason only.
        raise ValueError(f"tools: a function's parameters cannot be compiled: {library_reason(exc)}") from None
    if before:
        parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(before)}"))
    if after:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(after)}"))
    return str(xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0])


def _call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    # No parameters: any object, as the parser accepts.
    arguments = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: arguments},
            "required": ["name", arguments_key], "additionalProperties": False}
