"""JSON Schemas from requests, made safe to use inside the server.

Clients send schemas (a tool's ``parameters``, ``response_format``), and
the server uses them twice: xgrammar compiles them into a grammar, and
jsonschema checks the arguments of the tool calls the model writes. Left
to its defaults, jsonschema

* fetches a ``$ref`` that points outside the document (``http://...``):
  one request could make the server open a connection anywhere and wait
  on it, with the event loop blocked;
* matches ``pattern`` and ``patternProperties`` with Python's backtracking
  ``re``: ``^(a+)+$`` against 28 a's and a ``!`` runs for seconds without
  releasing the GIL, so no other thread (nor the event loop) gets to run.

So::

    check_schema(schema, validation=True)  # at request time; UnsafeSchemaError (a ValueError)
    v = validator(schema)                  # RE2 patterns, no retrieval, a deadline per keyword
    is_valid_within(v, instance, deadline) # bool, or SchemaCheckError

RE2 matches in time linear in the input whatever the pattern; the price is
that it has no backreferences or lookaround, which ``check_schema`` rejects
up front (a 400) rather than checking such patterns some slower way.
"""
from __future__ import annotations

import threading
import time
from functools import lru_cache
from typing import Any

import jsonschema
import re2
import referencing
import referencing.exceptions
from jsonschema.exceptions import ValidationError

# Keywords whose value is a reference to another schema.
_REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a bad client pattern is a 400, not a line on the server's stderr


class UnsafeSchemaError(ValueError):
    """A schema the server will not use; the message says where and why."""


class SchemaCheckError(Exception):
    """An instance could not be checked against a schema: over the time
    budget, nested too deeply, or a reference that resolves to nothing."""


# ---- request time -------------------------------------------------------------

def check_schema(schema: Any, *, validation: bool) -> None:
    """Raise UnsafeSchemaError unless ``schema`` is safe to compile and,
    with ``validation``, to validate instances against here.

    Every ``$ref`` must point inside the document ("#..."): nothing is ever
    fetched, so a reference elsewhere could only fail later, after the model
    ran. For validation also: every pattern compiles in RE2; ``$schema``
    appears only at the root (a nested one makes jsonschema switch to its
    stock validator class for that subschema, which matches with ``re``);
    and ``unevaluatedProperties`` is not combined with ``patternProperties``
    (jsonschema evaluates that pair through a helper that calls ``re``
    directly, which no keyword override reaches).

    The walk is generic (any dict key, at any depth) rather than per
    keyword position: a value under ``enum`` or ``const`` that merely looks
    like a remote ``$ref`` is rejected too, which is the safe mistake.
    Iterative, so a deeply nested schema cannot exhaust the stack."""
    has_unevaluated = has_pattern_properties = False
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{where}/{i}") for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            at = f"{where}/{_pointer_token(key)}"
            if key in _REF_KEYWORDS and isinstance(value, str) and not value.startswith("#"):
                raise UnsafeSchemaError(f"{key} {value!r} at #{at} points outside the schema; only references "
                                        "within it (starting with '#') are allowed")
            if validation:
                if key == "$schema" and isinstance(value, str) and where:
                    raise UnsafeSchemaError(f"$schema at #{at}: only the root of the schema may name its dialect")
                if key == "pattern" and isinstance(value, str):
                    _compile(value, at)
                elif key == "patternProperties" and isinstance(value, dict):
                    has_pattern_properties = True
                    for pattern in value:
                        _compile(pattern, f"{at}/{_pointer_token(pattern)}")
                elif key == "unevaluatedProperties":
                    has_unevaluated = True
            stack.append((value, at))
    if has_unevaluated and has_pattern_properties:
        raise UnsafeSchemaError("unevaluatedProperties together with patternProperties is not supported")


def _pointer_token(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


@lru_cache(maxsize=512)
def _re2(pattern: str) -> Any:
    return re2.compile(pattern, _RE2_OPTIONS)


def _compile(pattern: str, at: str) -> Any:
    try:
        return _re2(pattern)
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise UnsafeSchemaError(f"pattern {pattern!r} at #{at} is not supported (it must not need backtracking: "
                                f"no backreferences or lookaround): {reason}") from None


# ---- validation -----------------------------------------------------------------

def _refuse_retrieval(uri: str) -> referencing.Resource:
    # check_schema already rejected references outside the document; this
    # is the second wall, so that no code path can ever fetch a URI.
    raise referencing.exceptions.NoSuchResource(ref=uri)


_NO_RETRIEVAL = referencing.Registry(retrieve=_refuse_retrieval)

_deadline = threading.local()  # .at: time.monotonic() past which keywords give up; per checking thread


class _DeadlinePassed(Exception):
    pass


def _with_deadline(keyword: Any) -> Any:
    """A keyword function that first checks the thread's deadline: schema
    work can grow exponentially with nesting (allOf of allOf of refs), and
    this stops it between keywords instead of letting a worker thread spin
    on after the request has been answered."""

    def checked(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        at = getattr(_deadline, "at", None)
        if at is not None and time.monotonic() > at:
            raise _DeadlinePassed
        return keyword(validator, value, instance, schema)

    return checked


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "string") and not _re2(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict, instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        regex = _re2(pattern)
        for key, value in instance.items():
            if regex.search(key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, additional: Any, instance: Any, schema: Any) -> Any:
    # jsonschema's own joins the patternProperties into one re pattern.
    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = [_re2(p) for p in schema.get("patternProperties", {})]
    extras = [k for k in instance if k not in properties and not any(p.search(k) for p in patterns)]
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        yield ValidationError(f"Additional properties are not allowed ({', '.join(map(repr, sorted(extras)))} "
                              "unexpected)")


_RE2_KEYWORDS = {"pattern": _pattern, "patternProperties": _pattern_properties,
                 "additionalProperties": _additional_properties}


@lru_cache(maxsize=None)
def _guarded(cls: type) -> type:
    """``cls`` (one draft's validator class) with RE2 patterns and a
    deadline on every keyword. Subschemas reached by ``$ref`` or descent
    keep this class, as long as they name no other ``$schema``
    (check_schema makes sure)."""
    keywords = {name: _with_deadline(_RE2_KEYWORDS.get(name, fn)) for name, fn in cls.VALIDATORS.items()}
    return jsonschema.validators.extend(cls, keywords)


def validator(schema: Any) -> Any:
    """A validator for a schema that passed ``check_schema(validation=True)``
    and its dialect's metaschema."""
    cls = jsonschema.validators.validator_for(schema)
    return _guarded(cls)(schema, registry=_NO_RETRIEVAL)


def is_valid_within(checker: Any, instance: Any, deadline: float) -> bool:
    """``checker.is_valid(instance)``, giving up at ``deadline``
    (time.monotonic()). Meant for a worker thread: the event loop awaits it
    with the same budget, so a check that still overruns (one keyword doing
    a lot, such as uniqueItems on a long array) costs the thread, not the
    loop."""
    _deadline.at = deadline
    try:
        return checker.is_valid(instance)
    except _DeadlinePassed:
        raise SchemaCheckError("checking against it took longer than the time allowed") from None
    except RecursionError:
        raise SchemaCheckError("it (or the value checked) nests too deeply to check") from None
    except referencing.exceptions.Unresolvable as exc:
        raise SchemaCheckError(f"a reference in it resolves to nothing: {exc}") from None
    finally:
        _deadline.at = None
