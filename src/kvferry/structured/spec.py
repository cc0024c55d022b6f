"""What a request constrains its output to, checked at the edge (no heavy imports).

Kinds follow vLLM's guided-decoding options and OpenAI's ``response_format``:
``json_object`` (any JSON object), ``json_schema``, ``regex``, ``choice``
(one of a list of strings)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json_object", "json_schema", "regex", "choice"]


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    kind: Kind
    # json_schema: the schema as canonical JSON text (hashable, a cache key);
    # regex: the pattern; choice: a JSON list of the strings; json_object: "".
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema", "regex", "choice"):
            raise ValueError(f"kind must be json_object, json_schema, regex or choice, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> "GrammarSpec":
        if not isinstance(schema, dict):
            raise ValueError("json_schema must be a JSON object")
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("regex must be a non-empty string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"regex is not a valid regular expression: {exc}") from None
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> "GrammarSpec":
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(options))

    @classmethod
    def from_response_format(cls, response_format: dict[str, Any]) -> "GrammarSpec | None":
        """OpenAI's ``response_format``; None for ``{"type": "text"}`` (no constraint)."""
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind == "json_schema":
            wrapper = response_format.get("json_schema")
            if not isinstance(wrapper, dict) or not isinstance(wrapper.get("schema"), dict):
                raise ValueError("response_format.json_schema.schema must be a JSON object")
            return cls.json_schema(wrapper["schema"])
        raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")

    def choices(self) -> list[str]:
        assert self.kind == "choice"
        return json.loads(self.source)
