"""Ollama's API, for its clients (the ``ollama`` Python package, Open WebUI,
editor plugins)::

    POST /api/chat        a conversation; NDJSON stream by default, one JSON object with "stream": false
    POST /api/generate    a prompt (the chat template applied unless "raw": true); streamed the same way
    POST /api/embed       {"input": str | [str]} -> {"embeddings": [[...]]}; /api/embeddings: the older one-prompt form
    GET  /api/tags        the served models;  GET /api/ps: the loaded ones (the same)
    POST /api/show        a model's details;  GET /api/version

Each runs through the /v1 functions (create_chat_completion,
create_completion, create_embeddings): the bodies are translated in
serve/ollama_protocol.py, the answers and SSE events back here. Errors are
Ollama's shape, ``{"error": "..."}`` with the same status as /v1's.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvferry.cli_parser import package_version
from kvferry.serve.chat import create_chat_completion
from kvferry.serve.completions import create_completion
from kvferry.serve.embeddings import create_embeddings
from kvferry.serve.errors import APIError, bad_request
from kvferry.serve.ollama_protocol import (
    NDJSON, OllamaChatRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest, OllamaGenerateRequest, OllamaShowRequest,
    done_fields, model_details, now_iso, openai_messages, sampling_fields, served_name,
)
from kvferry.serve.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from kvferry.serve.serving import ServingContext, parse_body, read_body, run_until_disconnected
from kvferry.serve.tenants import Caller, current_tenant


def _ollama_errors(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """/v1's OpenAI error bodies in Ollama's shape, which its clients read."""
    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except APIError as exc:
            return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)
    return wrapped


@contextlib.contextmanager
def _bad_input() -> Iterator[None]:
    """A body the translation refuses (ValueError) is a 400."""
    try:
        yield
    except ValueError as exc:
        raise bad_request(str(exc), str(exc).partition(":")[0].split(" ")[0] or None) from None


def _text(choice: dict) -> str:
    """A choice's new text: a chat delta's or message's content, or a completion's text."""
    part = choice.get("delta") or choice.get("message")
    if part is not None:
        return part.get("content") or ""
    return choice.get("text") or ""


def _tool_calls(message: dict) -> list[dict] | None:
    calls = message.get("tool_calls")
    if not calls:
        return None
    out = []
    for call in calls:
        fn = call.get("function", {})
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            arguments = {}
        out.append({"function": {"name": fn.get("name", ""), "arguments": arguments}})
    return out


def _piece(model: str, chat: bool, text: str) -> dict[str, Any]:
    head = {"model": model, "created_at": now_iso()}
    return head | ({"message": {"role": "assistant", "content": text}} if chat else {"response": text})


async def _ndjson(events: AsyncIterator[str], model: str, chat: bool, started_ns: int) -> AsyncIterator[str]:
    """/v1's SSE events as Ollama's NDJSON lines: one per delta, then the
    closing one with the counts (from the usage event)."""
    reason, usage, first_ns = None, None, None
    calls: dict[int, dict[str, str]] = {}  # streamed tool calls by index: name, arguments so far
    async for event in events:
        if not event.startswith("data: "):
            continue
        data = event[len("data: "):].strip()
        if data == "[DONE]":
            if calls:  # Ollama sends the calls whole, in a line of their own
                line = _piece(model, chat, "")
                line["message"]["tool_calls"] = _tool_calls({"tool_calls": [
                    {"function": call} for _, call in sorted(calls.items())]})
                yield json.dumps(line) + "\n"
            line = _piece(model, chat, "") | done_fields(reason, usage, started_ns, first_ns, time.monotonic_ns())
            yield json.dumps(line) + "\n"
            continue
        obj = json.loads(data)
        if "error" in obj:  # in-band, as Ollama reports an error mid-stream
            yield json.dumps({"error": obj["error"].get("message", "error")}) + "\n"
            continue
        usage = obj.get("usage") or usage
        for choice in obj.get("choices") or []:
            reason = choice.get("finish_reason") or reason
            for call in (choice.get("delta") or {}).get("tool_calls") or []:
                acc = calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                fn = call.get("function") or {}
                acc["name"] += fn.get("name") or ""
                acc["arguments"] += fn.get("arguments") or ""
            text = _text(choice)
            if text:
                first_ns = first_ns or time.monotonic_ns()
                yield json.dumps(_piece(model, chat, text)) + "\n"


def ollama_routes(ctx: ServingContext, model_path: str | None, max_body_bytes: int) -> list[Route]:
    def card(name: str) -> dict[str, Any]:
        return {"name": name, "model": name, "modified_at": now_iso(), "size": 0, "digest": "",
                "details": model_details()}

    async def generation(request: Request, model: str, chat: bool, stream: bool, fields: dict[str, Any],
                         as_chat: bool | None = None) -> Response:
        """Run an OpenAI body through /v1's chat (``chat``) or completion
        function and answer in Ollama's shape: /api/chat's ``message``, or
        /api/generate's ``response`` (``as_chat`` False)."""
        as_chat = chat if as_chat is None else as_chat
        arrival, started_ns = time.monotonic(), time.monotonic_ns()
        fields = fields | {"model": served_name(model, ctx.served_model_names), "stream": stream}
        if stream:
            fields["stream_options"] = {"include_usage": True}
        caller = Caller(current_tenant.get(), None)
        if chat:
            req = parse_body(json.dumps(fields).encode(), ChatCompletionRequest)
            handler = create_chat_completion(ctx, req, caller, arrival)
        else:
            req = parse_body(json.dumps(fields).encode(), CompletionRequest)
            handler = create_completion(ctx, req, caller, arrival)
        response = await run_until_disconnected(request, handler)
        if stream:
            if response.status_code != 200:
                return response
            # The same response object, so its closing of the engine request stays.
            response.body_iterator = _ndjson(response.body_iterator, model, as_chat, started_ns)
            response.headers["content-type"] = NDJSON
            return response
        body = json.loads(response.body)
        choice = body["choices"][0]
        line = _piece(model, as_chat, _text(choice))
        if as_chat and (calls := _tool_calls(choice.get("message") or {})):
            line["message"]["tool_calls"] = calls
        return JSONResponse(line | done_fields(choice.get("finish_reason"), body.get("usage"), started_ns,
                                               None, time.monotonic_ns()))

    @_ollama_errors
    async def chat(request: Request) -> Response:
        req = parse_body(await read_body(request, max_body_bytes), OllamaChatRequest)
        with _bad_input():
            fields = {"messages": openai_messages(req.messages), **sampling_fields(req.options, req.format)}
        if req.tools:
            fields["tools"] = req.tools
        return await generation(request, req.model, True, req.stream, fields)

    @_ollama_errors
    async def generate(request: Request) -> Response:
        req = parse_body(await read_body(request, max_body_bytes), OllamaGenerateRequest)
        with _bad_input():
            if req.images:
                raise ValueError("images: images are not supported (the served model reads text only)")
            sampling = sampling_fields(req.options, req.format)
        if req.raw:  # the prompt as given, no template
            return await generation(request, req.model, False, req.stream, {"prompt": req.prompt, **sampling})
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
            {"role": "user", "content": req.prompt}]
        return await generation(request, req.model, True, req.stream, {"messages": messages, **sampling},
                                as_chat=False)

    async def embed_vectors(request: Request, model: str, inputs: str | list[str]) -> tuple[list, dict]:
        req = parse_body(json.dumps({"model": served_name(model, ctx.served_model_names),
                                     "input": inputs}).encode(), EmbeddingRequest)
        caller = Caller(current_tenant.get(), None)
        response = await run_until_disconnected(
            request, create_embeddings(ctx, req, caller, time.monotonic(), ctx.api.embedding_pooling))
        if response.status_code != 200:
            raise APIError(response.status_code, "the embedding request did not finish")
        body = json.loads(response.body)
        return [d["embedding"] for d in body["data"]], body.get("usage") or {}

    @_ollama_errors
    async def embed(request: Request) -> Response:
        started = time.monotonic_ns()
        req = parse_body(await read_body(request, max_body_bytes), OllamaEmbedRequest)
        vectors, usage = await embed_vectors(request, req.model, req.input)
        return JSONResponse({"model": req.model, "embeddings": vectors, "total_duration": time.monotonic_ns() - started,
                             "load_duration": 0, "prompt_eval_count": usage.get("prompt_tokens", 0)})

    @_ollama_errors
    async def embeddings(request: Request) -> Response:
        req = parse_body(await read_body(request, max_body_bytes), OllamaEmbeddingsRequest)
        vectors, _ = await embed_vectors(request, req.model, req.prompt)
        return JSONResponse({"embedding": vectors[0]})

    async def tags(request: Request) -> Response:
        return JSONResponse({"models": [card(name) for name in ctx.served_model_names]})

    async def ps(request: Request) -> Response:
        # Every served model is loaded while the server runs; none expires.
        return JSONResponse({"models": [card(name) | {"expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                                                      "context_length": ctx.client.max_model_len}
                                        for name in ctx.served_model_names]})

    @_ollama_errors
    async def show(request: Request) -> Response:
        req = parse_body(await read_body(request, max_body_bytes), OllamaShowRequest)
        name = served_name(req.model or req.name or "", ctx.served_model_names)
        if name not in ctx.served_model_names:
            raise APIError(404, f"model '{req.model or req.name}' not found", "model", code="model_not_found")
        return JSONResponse({
            "modelfile": "", "parameters": "", "template": ctx.api.chat_template
            or getattr(ctx.client.tokenizer, "chat_template", None) or "", "license": "", "details": model_details(), "modified_at": now_iso(),
            "model_info": {"general.basename": model_path or name, "general.context_length": ctx.client.max_model_len},
            "capabilities": ["completion", "tools", "embedding"],
        })

    async def version(request: Request) -> Response:
        return JSONResponse({"version": package_version()})

    return [
        Route("/api/chat", chat, methods=["POST"]),
        Route("/api/generate", generate, methods=["POST"]),
        Route("/api/embed", embed, methods=["POST"]),
        Route("/api/embeddings", embeddings, methods=["POST"]),
        Route("/api/tags", tags, methods=["GET"]),
        Route("/api/ps", ps, methods=["GET"]),
        Route("/api/show", show, methods=["POST"]),
        Route("/api/version", version, methods=["GET"]),
    ]
