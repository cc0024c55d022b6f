"""One metadata value of a GGUF file, read from its header alone, without
numpy or torch: what the front end checks a flag against before any model
loads (``serve/preflight.py``: ``--max-model-len`` against the model's
context length).

    read_gguf_value(path, "llama.context_length")   -> 8192 (None: absent or unreadable)
    gguf_context_length(path)                       -> the architecture's context_length

``gguf.GGUFReader`` parses every tensor's description and the whole
vocabulary into numpy arrays (5 s for the embedded 98 MB model on a busy
machine); this walks the key/value section and stops at the key. Format:
github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3).
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

# Value types of the key/value section: struct format of the fixed-size ones.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Larger than any real header: a corrupt length must not make us read gigabytes.
_MAX_STRING = 1 << 24


class _Corrupt(Exception):
    pass


def read_gguf_value(path: str | Path, key: str) -> object | None:
    """The value of ``key`` in the GGUF header, or None when the file has no
    such key or is not a GGUF file we can read (the loader then decides)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or _unpack(f, "<I") not in (2, 3):
                return None
            _unpack(f, "<Q")  # tensor count
            for _ in range(_unpack(f, "<Q")):
                name = _string(f)
                kind = _unpack(f, "<I")
                if name == key:
                    return _value(f, kind)
                _skip(f, kind)
    except (OSError, struct.error, UnicodeDecodeError, _Corrupt):
        return None
    return None


def gguf_context_length(path: str | Path) -> int | None:
    """``{general.architecture}.context_length``: the model's trained context."""
    arch = read_gguf_value(path, "general.architecture")
    if not isinstance(arch, str):
        return None
    value = read_gguf_value(path, f"{arch}.context_length")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _unpack(f: BinaryIO, fmt: str):  # noqa: ANN202 - int | float | bool
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise _Corrupt("truncated")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    n = _unpack(f, "<Q")
    if n > _MAX_STRING:
        raise _Corrupt("string too long")
    return f.read(n).decode("utf-8")


def _value(f: BinaryIO, kind: int) -> object:
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    raise _Corrupt("an array is not read as a value")


def _skip(f: BinaryIO, kind: int) -> None:
    if kind in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[kind]), 1)
    elif kind == _STRING:
        n = _unpack(f, "<Q")
        f.seek(n, 1)
    elif kind == _ARRAY:
        item, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if item in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(count):
                _skip(f, item)
    else:
        raise _Corrupt(f"value type {kind}")
