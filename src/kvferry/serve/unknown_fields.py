"""Body fields a route does not know: accepted (as OpenAI's clients send
fields a server may lack), but named back to the caller in the
``X-Unknown-Fields`` response header and logged once per field name, as
vLLM's ``--enable-log-unknown-fields``.

Field names are the caller's text: only names of at most 64 characters
from ``[A-Za-z0-9_.-]`` are echoed (others are counted as ``<other>``, so
a header can never carry a line break), at most 32 per response, and the
log remembers at most 1024 names (then stays quiet), so a client sending
random names can neither bloat the log nor grow the server's memory.
"""
from __future__ import annotations

import logging
import re

from typing import TypeVar

import pydantic_core
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from kvferry.serve.serving import parse_body, read_body

logger = logging.getLogger(__name__)

UNKNOWN_FIELDS_HEADER = "X-Unknown-Fields"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MAX_LISTED = 32
_MAX_LOGGED = 1024
_logged: set[str] = set()
M = TypeVar("M", bound=BaseModel)


def _known(model: type[BaseModel]) -> set[str]:
    names = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
        if isinstance(info.validation_alias, str):
            names.add(info.validation_alias)
    return names


def unknown_fields(body: bytes, model: type[BaseModel]) -> list[str]:
    """The top-level keys of a JSON object body that ``model`` has no field
    for (sanitized, at most 32); [] for a body that is no object. Call it
    after the body validated (pydantic's parser bounds nesting)."""
    try:
        data = pydantic_core.from_json(body)
    except ValueError:
        return []
    if not isinstance(data, dict):
        return []
    known = _known(model)
    out: list[str] = []
    for key in data:
        if key in known:
            continue
        name = key if _NAME.fullmatch(key) else "<other>"
        if name not in out:
            out.append(name)
        if len(out) >= _MAX_LISTED:
            break
    return out


def log_unknown(route: str, fields: list[str]) -> None:
    """Log each field name the first time any request sends it."""
    for name in fields:
        if name in _logged or len(_logged) >= _MAX_LOGGED:
            continue
        _logged.add(name)
        logger.warning("%s: ignored the unknown body field %r (logged once per field name; "
                       "each response lists its own in the %s header)", route, name, UNKNOWN_FIELDS_HEADER)


async def read_request_noting_unknown(request: Request, model: type[M], limit: int) -> tuple[M, list[str]]:
    """serving.read_request, plus the body's unknown fields (logged once per name)."""
    body = await read_body(request, limit)
    req = parse_body(body, model)
    unknown = unknown_fields(body, model)
    log_unknown(request.url.path, unknown)
    return req, unknown


def with_unknown_header(response: Response, unknown: list[str]) -> Response:
    """``response`` with the X-Unknown-Fields header when there are any
    (before it is sent: a streamed response's headers too)."""
    if unknown:
        response.headers[UNKNOWN_FIELDS_HEADER] = ", ".join(unknown)
    return response
