"""Mooncake trace replay with the prefix structure intact.

A trace line is ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}``; hash id ``h`` names the ``block_size`` tokens at its
position. Hash id ``h`` always becomes the same words (``block_text(h)``),
so two requests that share leading hash ids share that many prompt tokens,
and the server's prefix cache can find them. The last block holds only
what is left of ``input_length`` (a prefix of the full block's words).

    ids:    [0, 14, 15]    input_length = 2 * 512 + 100
    prompt: block(0)[:512] block(14)[:512] block(15)[:100]
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvferry.bench.text import block_text
from kvferry.bench.workloads import BenchError, RequestSpec, Session, user

DEFAULT_TRACE = "data/mooncake_conversation_head300.jsonl"
MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True, slots=True)
class TraceEntry:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | None) -> list[TraceEntry]:
    """Parse a JSONL trace (None: the slice shipped in the package)."""
    if path is None:
        text = resources.files("kvferry.bench").joinpath(DEFAULT_TRACE).read_text()
        where = f"kvferry/bench/{DEFAULT_TRACE}"
    else:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise BenchError(f"--trace: cannot read {path}: {e.strerror}") from None
        where = path
    entries = [_parse_line(line, where, i + 1) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not entries:
        raise BenchError(f"--trace: {where} holds no requests")
    return entries


def _parse_line(line: str, where: str, lineno: int) -> TraceEntry:
    try:
        d = json.loads(line)
        entry = TraceEntry(float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                           tuple(int(h) for h in d["hash_ids"]))
    except (ValueError, KeyError, TypeError) as e:
        raise BenchError(f"--trace: {where} line {lineno}: not a trace record "
                         f"(timestamp, input_length, output_length, hash_ids): {e}") from None
    if entry.input_length < 1 or entry.output_length < 1:
        raise BenchError(f"--trace: {where} line {lineno}: lengths must be >= 1")
    return entry


def trace_prompt(entry: TraceEntry, block_size: int, max_input_len: int | None) -> tuple[str, int]:
    """The prompt text of one entry and its length in tokens (clipped)."""
    length = entry.input_length if max_input_len is None else min(entry.input_length, max_input_len)
    parts = []
    remaining = length
    for h in entry.hash_ids:
        if remaining <= 0:
            break
        n = min(block_size, remaining)
        parts.append(block_text(h, n, salt="mooncake"))
        remaining -= n
    if remaining > 0:  # input_length beyond the listed blocks: unshared filler
        parts.append(block_text(f"tail-{entry.timestamp_ms}-{len(entry.hash_ids)}", remaining, salt="mooncake"))
    return "".join(parts), length


# Tokens a served context keeps for the chat template around a trace prompt
# (a trace's words are one token each with the usual BPE vocabularies).
TEMPLATE_MARGIN = 64


def clipped_lengths(entry: TraceEntry, max_input_len: int | None, max_output_len: int | None,
                    context_len: int | None) -> tuple[int | None, int]:
    """(input cap, output length) of one entry. ``context_len``: the
    server's context; prompt and output must fit in it, so the input is cut
    to what the output and the template leave (the output, if need be, to
    half the context)."""
    out = entry.output_length if max_output_len is None else min(entry.output_length, max_output_len)
    if context_len is None:
        return max_input_len, out
    out = min(out, max(1, context_len // 2))
    room = max(1, context_len - out - TEMPLATE_MARGIN)
    return (room if max_input_len is None else min(room, max_input_len)), out


def count_clipped(entries: list[TraceEntry], max_input_len: int | None, max_output_len: int | None,
                  context_len: int | None) -> int:
    """How many entries' prompts ``trace_workload`` cuts short."""
    return sum(1 for e in entries
               if (cap := clipped_lengths(e, max_input_len, max_output_len, context_len)[0]) is not None
               and e.input_length > cap)


def trace_workload(entries: list[TraceEntry], block_size: int, time_scale: float,
                   max_input_len: int | None, max_output_len: int | None,
                   context_len: int | None = None) -> Iterator[Session]:
    """One session per entry, arriving at ``timestamp / time_scale`` (relative
    to the first entry). The trace is replayed once. ``context_len``: clip
    each prompt so that it and its output fit (``clipped_lengths``)."""
    t0 = entries[0].timestamp_ms
    for e in entries:
        cap, out = clipped_lengths(e, max_input_len, max_output_len, context_len)
        prompt, n = trace_prompt(e, block_size, cap)
        arrival = (e.timestamp_ms - t0) / 1000.0 / time_scale
        yield Session([RequestSpec(user(prompt), out, n, arrival_s=arrival)])
