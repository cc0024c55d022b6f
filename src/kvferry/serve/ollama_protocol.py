"""Ollama's API bodies, and their translation to and from the OpenAI
bodies kvferry serves (serve/routes/ollama.py runs them through the same
chat, completion and embedding functions as /v1/...).

Ollama's ``options`` map onto the sampling fields: temperature, top_p,
top_k, min_p, seed, stop, num_predict (max_tokens; -1 or -2: none),
repeat_penalty (repetition_penalty), presence_penalty, frequency_penalty.
Options that tune Ollama's own runtime (num_ctx, num_gpu, num_thread,
mirostat...) are accepted and ignored. ``format``: "json" is a JSON object
output, a JSON schema a schema-constrained one (structured outputs).
"""
from __future__ import annotations

import datetime
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

NDJSON = "application/x-ndjson"
# Ollama's generation options and the OpenAI/vLLM field each maps onto.
_OPTION_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OllamaMessage(_Body):
    role: str
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[dict] | None = None


class OllamaChatRequest(_Body):
    model: str
    messages: list[OllamaMessage] = []
    tools: list[dict] | None = None
    format: str | dict | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None


class OllamaGenerateRequest(_Body):
    model: str
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None  # refused: text models only
    format: str | dict | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None


class OllamaEmbedRequest(_Body):
    model: str
    input: str | list[str] = ""
    truncate: bool = True
    options: dict[str, Any] | None = None


class OllamaEmbeddingsRequest(_Body):
    """The older /api/embeddings: one prompt, one vector."""
    model: str
    prompt: str = ""


class OllamaShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # the older spelling


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def served_name(model: str, served: list[str]) -> str:
    """Ollama names carry a tag (``name:latest``); the bare served name matches."""
    if model not in served and model.endswith(":latest") and model[: -len(":latest")] in served:
        return model[: -len(":latest")]
    return model


def sampling_fields(options: dict[str, Any] | None, format: str | dict | None) -> dict[str, Any]:
    """The OpenAI/vLLM request fields for Ollama's ``options`` and ``format``.
    Raises ValueError for a ``format`` that is neither "json" nor a schema."""
    if isinstance(format, str) and format not in ("", "json"):
        raise ValueError(f'format must be "json" or a JSON schema object, got {format!r}')
    out: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if key in _OPTION_FIELDS and value is not None:
            out[_OPTION_FIELDS[key]] = value
    num_predict = (options or {}).get("num_predict")
    if isinstance(num_predict, int) and num_predict >= 0:  # -1: until the end; -2: fill the context
        out["max_tokens"] = num_predict
    if format == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(format, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": format}}
    return out


def openai_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Raises ValueError for images: the served models read text only."""
    out = []
    for i, m in enumerate(messages):
        if m.images:
            raise ValueError(f"messages[{i}].images: images are not supported (the served model reads text only)")
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:  # Ollama's arguments are an object, OpenAI's a JSON string
            msg["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                  "function": {"name": c.get("function", {}).get("name", ""),
                                               "arguments": json.dumps(c.get("function", {}).get("arguments", {}))}}
                                 for i, c in enumerate(m.tool_calls)]
        out.append(msg)
    return out


def done_fields(reason: str | None, usage: dict | None, started_ns: int, first_ns: int | None, end_ns: int) -> dict:
    """The counters Ollama's last object carries (durations in nanoseconds)."""
    usage = usage or {}
    first = first_ns if first_ns is not None else end_ns
    return {
        "done": True,
        "done_reason": "length" if reason == "length" else "stop",
        "total_duration": end_ns - started_ns,
        "load_duration": 0,
        "prompt_eval_count": usage.get("prompt_tokens", 0),
        "prompt_eval_duration": first - started_ns,
        "eval_count": usage.get("completion_tokens", 0),
        "eval_duration": end_ns - first,
    }


def model_details() -> dict[str, Any]:
    return {"parent_model": "", "format": "safetensors", "family": "", "families": None,
            "parameter_size": "", "quantization_level": ""}
