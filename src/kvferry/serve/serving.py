"""What the chat and completions endpoints share: the request lifecycle
(read body, admit into the engine, collect or stream, always clean up),
SSE framing and usage accounting."""
from __future__ import annotations

import asyncio
import inspect
import json
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvferry.core.hashing import CacheScope
from kvferry.core.outputs import TokenLogprobs
from kvferry.outputs import RequestOutput
from kvferry.sampling import SamplingParams
from kvferry.serve.engine_client import (
    AsyncEngineClient, EngineDeadError, EngineRestartingError, KVTransferFailedError, RequestStream, SloRejectedError,
)
from kvferry.serve.errors import APIError, bad_request, error_body
from kvferry.serve.logprobs import TokenStrings
from kvferry.serve.api_flags import ApiOptions
from kvferry.serve.params import MaxTokens, named_field
from kvferry.serve.protocol import PromptTokensDetails, Usage
from kvferry.serve.public_prefixes import CachePolicy
from kvferry.serve.tenants import Caller

M = TypeVar("M", bound=BaseModel)


@dataclass(slots=True)
class ServingContext:
    """Everything a handler needs; one per app."""

    client: AsyncEngineClient
    served_model_names: list[str]
    token_strings: TokenStrings
    api: ApiOptions = field(default_factory=ApiOptions)
    # Caller and prompt -> where the request's blocks are keyed (tenant
    # namespace, public prefix, quota, weight). None: one tenant, all private.
    cache_policy: CachePolicy | None = None

    def max_tokens(self, default: int | None = None) -> MaxTokens:
        """The server's length policy; ``default`` is the endpoint's own
        (16 for completions), which --max-tokens-default replaces."""
        return MaxTokens(self.api.max_tokens_default or default, self.api.max_tokens_limit)

    def max_prompt_chars(self) -> int | None:
        """Longer text cannot fit the context: it is refused without being
        encoded (None: the tokenizer gives no honest bound)."""
        return self.client.tokenizer.max_prompt_chars(self.client.max_model_len)

    def cache_scope(self, caller: Caller, prompt_ids: list[int]) -> CacheScope:
        """The one scope of a caller's request; it reaches the core unchanged."""
        if self.cache_policy is None:
            return CacheScope()
        return self.cache_policy.scope(caller, prompt_ids)


@dataclass(slots=True, frozen=True)
class RequestIds:
    """``public``: the response's id (``chatcmpl-<X-Request-Id>`` when the
    client sent one). ``engine``: unique per request even when clients reuse
    an X-Request-Id, because the engine keys its requests by it."""

    public: str
    engine: str

    @classmethod
    def make(cls, prefix: str, client_request_id: str | None, sep: str = "-") -> "RequestIds":
        if client_request_id is None:
            rid = f"{prefix}{sep}{uuid.uuid4().hex}"
            return cls(rid, rid)
        public = f"{prefix}{sep}{client_request_id}"
        return cls(public, f"{public}-{uuid.uuid4().hex[:8]}")


# ---- request body ---------------------------------------------------------

async def read_request(request: Request, model: type[M], limit: int) -> M:
    """Read, size-check, JSON-decode and validate a body; 400 / 413 on bad input."""
    return parse_body(await read_body(request, limit), model)


async def read_body(request: Request, limit: int) -> bytes:
    """A request's body, at most ``limit`` bytes (413 past it; 400 if empty).

    Content-Length is checked first (cheap rejection of a declared huge body),
    then the bytes actually read (a lying or chunked body)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
    except ClientDisconnect:
        raise bad_request("the client disconnected while sending the body") from None
    if not body:
        raise bad_request("the request body is empty; expected a JSON object")
    return bytes(body)


def parse_body(body: bytes, model: type[M]) -> M:
    """Validate JSON bytes strictly. pydantic's own JSON parser rejects what
    json.loads lets through and nothing downstream can encode: lone UTF-16
    surrogates (``"\\ud800"``) and invalid UTF-8. It also bounds nesting."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_tag(part: object) -> bool:
    """pydantic puts the union member tried into an error's location
    (``stop.list[str].0``); clients want the field path (``stop.0``)."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


def _too_large(limit: int) -> APIError:
    # The rest of the body is not read: the connection closes after the
    # answer, lingering to drain what the client still sends (http_limits).
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large",
                    close_connection=True)


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False, include_input=False)
    # A union reports one error per member it tried (``input`` as a string,
    # then as a list): the deepest one names what the client got wrong.
    first = max(errors, key=lambda e: len(e["loc"]))
    if first["type"] == "json_invalid":
        return bad_request(f"malformed JSON body: {first['ctx']['error'] if 'ctx' in first else first['msg']}")
    if first["type"] == "model_type" and not first["loc"]:
        return bad_request("the request body must be a JSON object")
    param = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p)) or None
    where = f"{param}: " if param else ""
    more = f" (and {exc.error_count() - 1} more errors)" if exc.error_count() > 1 else ""
    return bad_request(f"{where}{first['msg']}{more}", param)


# ---- admission and collection ---------------------------------------------

def engine_error_code(exc: EngineDeadError) -> str:
    """The OpenAI-style error code of a request the engine side ended."""
    if isinstance(exc, KVTransferFailedError):
        return "kv_transfer_failed"
    # A dead core being started again: the client may retry shortly.
    return "engine_restarting" if isinstance(exc, EngineRestartingError) else "engine_unavailable"


async def start_request(ctx: ServingContext, request_id: str, prompt_ids: list[int], params: SamplingParams,
                        arrival_time: float, caller: Caller) -> RequestStream:
    try:
        scope = ctx.cache_scope(caller, prompt_ids)
        return await ctx.client.add_request(request_id, prompt_ids, params, arrival_time=arrival_time,
                                            cache_scope=scope)
    except ValueError as exc:
        raise bad_request(str(exc), named_field(str(exc)) or "prompt") from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code=engine_error_code(exc)) from None
    except SloRejectedError as exc:
        raise APIError(429, str(exc), code="slo_unattainable",
                       headers={"Retry-After": str(math.ceil(exc.retry_after_s))}) from None


async def collect(stream: RequestStream) -> list[RequestOutput]:
    """Wait for every sequence; the final output of each, by index."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for out in stream:
            if out.finished:
                finals[out.outputs[0].index] = out
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code=engine_error_code(exc)) from None
    finally:
        stream.close()
    return [finals[i] for i in sorted(finals)]


async def run_until_disconnected(request: Request, handler: Awaitable[Response]) -> Response:
    """Run a handler, cancelling it if the client goes away first.

    The handler's ``finally`` blocks then abort its engine request, so a
    client that gives up on a long non-streamed completion frees its KV
    blocks at once rather than when generation ends."""
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is cancelling us (shutdown)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait({task})  # let its finally blocks run (the abort)
        if not task.cancelled() and task.exception() is not None:
            pass  # retrieved: the client is gone, nobody to report it to
        return Response(status_code=499)  # nobody reads it
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # After the body has been read, the server's receive() only returns
    # when the client disconnects (or the response completes).
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- streaming ---------------------------------------------------------------

@dataclass(slots=True)
class Delta:
    """What one sequence gained since the last chunk (possibly several
    engine outputs merged when the client reads slower than the engine)."""

    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


def merge_deltas(outputs: list[RequestOutput]) -> list[Delta]:
    by_index: dict[int, Delta] = {}
    for out in outputs:
        seq = out.outputs[0]
        d = by_index.setdefault(seq.index, Delta(seq.index))
        d.text += out.new_text
        d.num_tokens += len(out.new_token_ids)
        d.logprobs += out.new_logprobs
        d.num_cached_tokens = max(d.num_cached_tokens, out.num_cached_tokens)
        if out.finished:
            d.finish_reason, d.stop_reason = seq.finish_reason, seq.stop_reason
    return list(by_index.values())


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def stream_events(stream: RequestStream,
                        render: Callable[[list[Delta]], list[str] | Awaitable[list[str]]],
                        final: Callable[[], list[str]], done: bool = True) -> AsyncIterator[str]:
    """SSE chunks of a stream: ``render`` turns merged deltas into events
    (a coroutine where it checks tool calls off the event loop), ``final``
    adds the closing ones (usage) before ``[DONE]`` (which the Responses API
    does not send: ``done=False``)."""
    try:
        async for out in stream:
            events = render(merge_deltas([out, *stream.pending()]))
            for event in await events if inspect.isawaitable(events) else events:
                yield event
        for event in final():
            yield event
    except EngineDeadError as exc:
        # Headers are gone already; report in-band as vLLM does.
        yield sse(error_body(503, str(exc), code=engine_error_code(exc)))
    except APIError as exc:
        # The same for a request that fails mid-stream (a tool call that
        # cannot be checked against its schema): the status line is sent.
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
    finally:
        stream.close()
    if done:
        yield SSE_DONE


class EventStreamResponse(StreamingResponse):
    """An SSE response that closes its request however it ends: finished,
    client gone (Starlette cancels the body mid-iteration) or server
    shutting down. Closing aborts the engine request if it still runs."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Not left to the generator's own finally: a generator cancelled
            # while suspended at a yield only runs it when garbage-collected.
            self._stream.close()


async def respond(ctx: ServingContext, request_id: RequestIds, prompt_ids: list[int], params: SamplingParams,
                  arrival_time: float, caller: Caller, stream: bool, make_chunks: Callable[[], Any],
                  make_body: Callable[[list[RequestOutput]], BaseModel | Awaitable[BaseModel]]) -> Response:
    """Admit a request in ``caller``'s cache scope, then stream it as SSE
    (``make_chunks()`` renders the events) or wait for every sequence and
    answer ``make_body(finals)`` (a coroutine where it checks tool calls off
    the event loop)."""
    handle = await start_request(ctx, request_id.engine, prompt_ids, params, arrival_time, caller)
    if stream:
        chunks = make_chunks()
        return EventStreamResponse(stream_events(handle, chunks.render, chunks.final), handle)
    finals = await collect(handle)
    body = make_body(finals)
    body = await body if inspect.isawaitable(body) else body
    return Response(body.model_dump_json(), media_type="application/json")


def final_usage(num_prompt_tokens: int, finals: list[RequestOutput]) -> Usage:
    """Usage of a whole (non-streamed) request: all n sequences' tokens."""
    num_completion = sum(len(out.outputs[0].token_ids) for out in finals)
    return usage(num_prompt_tokens, num_completion, finals[0].num_cached_tokens if finals else 0)


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


async def tokenize(fn: Callable[..., Any], *args: Any) -> Any:
    """Chat templates and long prompts off the event loop (the tokenizer
    releases the GIL while it encodes, model/tokenizer.py)."""
    return await asyncio.to_thread(fn, *args)
