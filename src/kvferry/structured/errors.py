"""The grammar library's error messages, made fit for a client.

xgrammar's C++ errors start with a timestamp and the source location of
its build (``[06:48:19] /project/cpp/json_schema_converter.cc:5088: Cannot
find field '$defs' in #/$defs/x``). That says nothing useful to a client
and tells it about the server's build, so every message that leaves the
server keeps the reason only.
"""
from __future__ import annotations

import re

# "[hh:mm:ss] " then "path/to/file.cc:123: ", in any order they appear
# (and a bare location anywhere in the text).
_TIMESTAMP = re.compile(r"\[\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\]\s*")
_SOURCE_LOCATION = re.compile(r"(?:[A-Za-z]:)?[\w./\\-]*[\w-]+\.(?:cc|cpp|cxx|c|h|hh|hpp|cu|py)(?::\d+)+:?\s*")


def library_reason(exc: BaseException | str) -> str:
    """The first non-empty line of a library's error, without timestamps or
    source locations (the reason stays: "Cannot find field '$defs' in ...")."""
    text = str(exc)
    for line in text.splitlines():
        reason = _SOURCE_LOCATION.sub("", _TIMESTAMP.sub("", line)).strip()
        if reason:
            return reason
    return "the grammar library rejected it"
