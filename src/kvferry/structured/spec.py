"""What a request constrains its output to, checked at the edge (no torch, no xgrammar).

Kinds follow vLLM's guided-decoding options and OpenAI's ``response_format``:
``json_object`` (any JSON object), ``json_schema``, ``regex``, ``choice``
(one of a list of strings), ``grammar`` (EBNF, root rule ``root``)."""
from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvferry import envs
from kvferry.extras import missing, require
from kvferry.structured.errors import library_reason

if TYPE_CHECKING:
    from kvferry.sampling import StructuredOutputsParams

logger = logging.getLogger(__name__)
_NO_XGRAMMAR = "the xgrammar package is not installed: pip install 'kvferry[structured]'"

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    kind: Kind
    # json_schema: the schema as canonical JSON text (hashable, a cache key);
    # regex: the pattern; choice: a JSON list of the strings; grammar: the
    # EBNF text; json_object: "".
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {', '.join(_KINDS)}, got {self.kind!r}")

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
    def from_params(cls, params: "StructuredOutputsParams") -> "GrammarSpec":
        """The spec of SamplingParams.structured_outputs (already checked there)."""
        kind = params.kind
        if kind == "json":
            return cls("json_schema", json.dumps(json.loads(params.json), sort_keys=True))
        if kind == "json_object":
            return cls("json_object")
        if kind == "regex":
            return cls("regex", params.regex)
        if kind == "choice":
            return cls("choice", json.dumps(params.choice))
        return cls("grammar", params.grammar)

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


def import_backend_in_background() -> threading.Thread:
    """Import xgrammar (with torch and transformers under it: ~4 s on a slow
    CPU) on a daemon thread. A server's front end starts it next to its
    engine core's start-up and joins it before it serves, so that the import
    overlaps the core's loading instead of delaying the first structured
    request. ``KVFERRY_GRAMMAR_IMPORT=first-use`` leaves it to that request
    (the thread only checks that xgrammar is installed): the test suite
    starts hundreds of servers, most of which serve no structured request."""

    def load() -> None:
        if missing("xgrammar"):  # a request that needs it gets a 400 naming the extra (check_compiles)
            logger.warning("structured outputs (response_format, structured_outputs, an enforced tool_choice) "
                           "are off: %s", _NO_XGRAMMAR)
            return
        if envs.grammar_import_at_start():  # else check_compiles imports it on first use
            import xgrammar  # noqa: F401

    thread = threading.Thread(target=load, name="kvferry-import-xgrammar", daemon=True)
    thread.start()
    return thread


def check_compiles(spec: GrammarSpec, field: str) -> None:
    """Raise ValueError naming ``field`` when the grammar cannot be built.

    Runs at the edge, so a bad schema / regex / grammar is a 400 and never
    reaches the core. Needs no tokenizer: xgrammar converts the spec to its
    grammar form, which is where every syntax error surfaces; a JSON schema
    is also checked against its metaschema (xgrammar skips keywords it does
    not know)."""
    require("xgrammar", "structured", field)
    import xgrammar as xgr  # heavy; only the serving edge and the core load it
    # Not at the top: every server (before its cores spawn) and every core
    # imports this module through kvferry.structured; jsonschema and its
    # referencing cost each ~35-80 ms of a start, for requests that name a schema.
    import jsonschema

    from kvferry.structured.schema_guard import UnsafeSchemaError, check_schema

    try:
        if spec.kind == "json_schema":
            schema = json.loads(spec.source)
            try:
                # xgrammar treats a reference outside the schema as "any
                # value" (with a warning), so such a schema would constrain
                # nothing there; and no code here may ever fetch one.
                check_schema(schema, validation=False)
            except UnsafeSchemaError as exc:
                raise ValueError(f"{field}: {exc}") from None
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"{field} is not a valid JSON Schema: {exc.message}") from None
            xgr.Grammar.from_json_schema(spec.source, any_whitespace=False)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.source)
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.source)
    except RuntimeError as exc:
        # xgrammar's messages start with a timestamp and a C++ source location: keep the reason.
        raise ValueError(f"{field} cannot be compiled: {library_reason(exc)}") from None
