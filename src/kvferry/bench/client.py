"""One streaming OpenAI request -> one RequestRecord.

Speaks plain HTTP + server-sent events (httpx) rather than the ``openai``
client: the timing of each chunk is what is measured, and vendor fields
(``ignore_eos``) go straight into the body.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx

from kvferry.bench.metrics import RequestRecord
from kvferry.bench.workloads import Message


def render_prompt(messages: list[Message]) -> str:
    """Chat messages as one completions prompt: a lone user turn is sent as is;
    a conversation becomes 'User: ...' / 'Assistant: ...' lines."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    lines = []
    for m in messages:
        if m["role"] == "system":
            lines.append(m["content"])
        else:
            lines.append(f"{m['role'].capitalize()}: {m['content']}")
    return "\n".join(lines) + "\nAssistant:"


def request_body(endpoint: str, model: str, messages: list[Message], max_tokens: int,
                 ignore_eos: bool, temperature: float) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = messages
    else:
        body["prompt"] = render_prompt(messages)
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:200]
    return f"HTTP {status}: {message}"


async def send(client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict,
               endpoint: str, record: RequestRecord, t0: float) -> str:
    """Send ``body`` and fill ``record`` (times relative to ``t0``, a
    ``perf_counter`` value). Returns the generated text. Errors go into
    ``record.error``; cancellation (the run's deadline) too, then re-raises."""
    start = time.perf_counter()
    record.start_s = start - t0
    last = None
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                record.error = _error_text(resp.status_code, await resp.aread())
                return ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return "".join(pieces)
                now = time.perf_counter()
                if text := _chunk_text(chunk, endpoint):
                    pieces.append(text)
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                if usage := chunk.get("usage"):
                    record.prompt_tokens = usage.get("prompt_tokens") or 0
                    record.completion_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens") or 0
        record.e2e_s = time.perf_counter() - start
        if record.ttft_s is None:
            # no text at all (e.g. an immediate stop): the first token is the end
            record.ttft_s = record.e2e_s
        if not record.completion_tokens:  # a server without include_usage
            record.completion_tokens = len(pieces)
        return "".join(pieces)
    except asyncio.CancelledError:
        record.error = "cancelled: run time limit reached"
        raise
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return "".join(pieces)
