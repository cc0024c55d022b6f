"""The HTTP side of ``kvferry chat``: list a server's models and stream one
answer from ``POST /v1/chat/completions`` (server-sent events).

Standard library only (``http.client``), as ``kvferry scale``: the command
runs wherever the server runs, without the ``openai`` or ``httpx`` extras.
One connection per answer, so that stopping an answer is closing its
socket: the server sees the client gone and aborts the request.
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field

# A probe of the default URL must not hold up the start of a chat when
# nothing answers there, nor give up on a busy server too early.
PROBE_TIMEOUT_S = 3.0
# A stream that says nothing for this long has failed (the user can stop
# it sooner with Ctrl-C).
READ_TIMEOUT_S = 600.0


class ChatError(Exception):
    """One line for the user: the server refused (``status``: its HTTP
    status), or could not be reached (``status`` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Answer:
    """What one streamed answer ended with."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # the server's usage: the rendered history's length
    completion_tokens: int | None = None
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    ended_at: float | None = None


class ChatClient:
    """``base_url``: ``http[s]://HOST:PORT`` with an optional path prefix;
    a trailing ``/v1`` is accepted (it is what OpenAI clients are given)."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        parts = urllib.parse.urlsplit(base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ChatError(f"--url must be http://HOST:PORT or https://HOST:PORT, got {base_url!r}")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._https = parts.scheme == "https"
        self._netloc = parts.netloc
        self._prefix = parts.path.rstrip("/").removesuffix("/v1")
        self._api_key = api_key

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._netloc, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def models(self, timeout: float = PROBE_TIMEOUT_S) -> list[str]:
        """The served model ids (``GET /v1/models``). ChatError when nothing
        answers, the server refuses, or what answers is not an OpenAI server."""
        conn = self._connect(timeout)
        try:
            conn.request("GET", f"{self._prefix}/v1/models", headers=self._headers())
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ChatError(f"no server answers at {self.base_url} ({exc})") from None
        finally:
            conn.close()
        if resp.status != 200:
            hint = " (--api-key KEY, or $KVFERRY_API_KEY)" if resp.status in (401, 403) else ""
            raise ChatError(f"{self.base_url} answered GET /v1/models with {resp.status}: {_error_text(body)}{hint}",
                            resp.status)
        try:
            return [m["id"] for m in json.loads(body)["data"]]
        except (ValueError, KeyError, TypeError):
            raise ChatError(f"{self.base_url} is not an OpenAI-compatible server (GET /v1/models)") from None

    def stream(self, model: str, messages: list[dict], options: dict, answer: Answer) -> Iterator[str]:
        """Yield the answer's text pieces as they arrive and fill ``answer``
        (finish reason, usage, times). Closing the generator, or an
        exception (KeyboardInterrupt) while it waits, closes the connection,
        which aborts the request on the server."""
        body = json.dumps({"model": model, "messages": messages, "stream": True,
                           "stream_options": {"include_usage": True}, **options})
        conn = self._connect(READ_TIMEOUT_S)
        try:
            try:
                conn.request("POST", f"{self._prefix}/v1/chat/completions", body=body.encode(),
                             headers=self._headers())
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise ChatError(f"cannot reach {self.base_url} ({exc})") from None
            if resp.status != 200:
                raise ChatError(f"the server refused ({resp.status}): {_error_text(resp.read())}", resp.status)
            yield from _events(resp, answer)
        finally:
            conn.close()
            answer.ended_at = time.monotonic()


def _events(resp: http.client.HTTPResponse, answer: Answer) -> Iterator[str]:
    """Parse ``data: {...}`` lines until ``data: [DONE]``."""
    while True:
        try:
            line = resp.readline()
        except (OSError, http.client.HTTPException) as exc:
            raise ChatError(f"the stream broke off ({exc})") from None
        if not line:
            raise ChatError("the stream ended before its [DONE] (the server went away?)")
        line = line.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise ChatError(f"the server sent a line that is not JSON: {data[:200]!r}") from None
        if "error" in chunk:  # an error after the stream began is sent in band
            raise ChatError(_error_text(data))
        if (usage := chunk.get("usage")) is not None:
            answer.prompt_tokens = usage.get("prompt_tokens")
            answer.completion_tokens = usage.get("completion_tokens")
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason"):
                answer.finish_reason = choice["finish_reason"]
            text = (choice.get("delta") or {}).get("content")
            if text:
                if answer.first_token_at is None:
                    answer.first_token_at = time.monotonic()
                answer.text += text
                yield text


def _error_text(body: bytes) -> str:
    """An OpenAI-style error body's message, or the body itself, cut short."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace").strip()[:300] or "(empty body)"
