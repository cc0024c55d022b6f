"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the Responses API
in the subset vLLM serves.

A request becomes a chat conversation: ``instructions`` as the system turn,
then the stored conversation of ``previous_response_id`` (its input and
output items; not its instructions, as OpenAI), then the new ``input``
items. It is rendered through the same chat template and tool plan as
/v1/chat/completions, so a continued conversation's prompt starts with the
previous one's and its prefix KV blocks are reused (``cached_tokens``).
``text.format`` constrains the output as chat's ``response_format`` does
(params.structured_outputs compiles it, with the same schema checks).

Stored responses live in a bounded in-memory store with expiry, keyed by
(tenant, id): one tenant can never read, continue, replace or delete
another's. Response ids are the server's own (``resp_<random hex>``, as
vLLM's): a client's X-Request-Id stays the request's trace id (echoed, and
in the engine's request id) and never names a stored response, so no
client can pick an id that lands on another's entry.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import Response

from kvferry.serve.chat import render_prompt
from kvferry.serve.errors import APIError, bad_request
from kvferry.serve.params import raise_for_model, resolve_max_tokens, sampling_params
from kvferry.serve.protocol import (
    ChatMessage, DeletedResponse, FunctionCall, FunctionCallItem, FunctionCallOutputItem, IncompleteDetails,
    InputTokensDetails, NamedToolChoice, NamedToolChoiceFunction, OutputFunctionCall, OutputMessage, OutputText,
    ResponseObject, ResponsesNamedToolChoice, ResponsesRequest, ResponseUsage, ToolCall, now_s,
)
from kvferry.serve.serving import (
    Delta, EventStreamResponse, ServingContext, collect, start_request, stream_events,
)
from kvferry.serve.tenants import Caller
from kvferry.serve.tools import ParsedOutput, ParsedToolCall, ToolPlan, plan_tools


# ---- the store ---------------------------------------------------------------

@dataclass(slots=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[ChatMessage]  # input and output of every turn so far, without instructions
    expires_at: float
    owner: str  # the tenant that stored it: no other tenant can read, continue, replace or delete it


class ResponseStore:
    """Bounded LRU of stored responses with a time to live, keyed by
    (owner, response id). Event-loop only."""

    def __init__(self, max_size: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_size = max_size
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def put(self, response: ResponseObject, conversation: list[ChatMessage], owner: str) -> None:
        self._expire()
        key = (owner, response.id)
        self._entries[key] = StoredResponse(response, conversation, self.clock() + self.ttl_s, owner)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)  # the least recently used goes first

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The entry if ``owner`` stored it; another tenant's id reads as
        absent, so ids reveal nothing across tenants."""
        self._expire()
        key = (owner, response_id)
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry

    def delete(self, response_id: str, owner: str) -> bool:
        self._expire()
        return self._entries.pop((owner, response_id), None) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        now = self.clock()
        for key in [key for key, e in self._entries.items() if e.expires_at <= now]:
            del self._entries[key]


# ---- POST /v1/responses ---------------------------------------------------------

async def create_response(store: ResponseStore, ctx: ServingContext, req: ResponsesRequest, caller: Caller,
                          arrival: float, client_request_id: str | None = None) -> Response:
    model = raise_for_model(req.model, ctx.served_model_names)
    if req.n != 1:
        raise bad_request("n must be 1 for /v1/responses", "n")
    if req.stream_options is not None:
        raise bad_request("stream_options is not supported on /v1/responses", "stream_options")
    _check_text_format(req)
    owner = caller.tenant.name
    previous = _previous(store, req.previous_response_id, owner)
    conversation = previous + input_messages(req.input)
    messages = ([ChatMessage(role="system", content=req.instructions)] if req.instructions else []) + conversation
    plan = plan_tools([t.as_chat_tool() for t in req.tools] if req.tools else None, _tool_choice(req.tool_choice),
                      ctx.api.tool_call_parser)
    prompt_ids = await render_prompt(ctx, messages, plan, param="input")
    max_tokens = resolve_max_tokens(req.max_output_tokens, len(prompt_ids), ctx.client.max_model_len, "input",
                                    ctx.max_tokens(), "max_output_tokens")
    params = sampling_params(req, max_tokens, None, plan)
    response_id = new_response_id()
    builder = _Builder(req, response_id, model, len(prompt_ids), plan)
    handle = await start_request(ctx, _engine_request_id(response_id, client_request_id), prompt_ids, params,
                                 arrival, caller)

    def keep(response: ResponseObject, parsed: ParsedOutput) -> None:
        if req.store:
            store.put(response, conversation + [_assistant_message(parsed)], owner)

    if req.stream:
        events = _StreamEvents(builder, keep)
        return EventStreamResponse(stream_events(handle, events.render, events.final, done=False), handle)
    finals = await collect(handle)
    seq = finals[0].outputs[0]
    parsed = await plan.parse_async(seq.text) if plan.active else ParsedOutput(seq.text)
    response = builder.response(parsed, seq.finish_reason, len(seq.token_ids), finals[0].num_cached_tokens)
    keep(response, parsed)
    return _json(response)


def new_response_id() -> str:
    """The server's id of a response (OpenAI's style, as vLLM makes it):
    random, so no client can choose it."""
    return f"resp_{uuid.uuid4().hex}"


def _engine_request_id(response_id: str, client_request_id: str | None) -> str:
    """The engine's (and the logs') id of the request: the client's
    X-Request-Id, where it sent one, stays findable in it, as on the other
    endpoints; the response id keeps it unique."""
    if client_request_id is None:
        return response_id
    return f"{response_id}-{client_request_id}"


def _check_text_format(req: ResponsesRequest) -> None:
    """``text.format`` becomes the request's output constraint in
    ``sampling_params`` (the grammar path of chat's response_format, schema
    checks included); here only the fields its type requires."""
    fmt = req.text.format if req.text is not None else None
    missing = fmt.missing_field() if fmt is not None else None
    if missing is not None:
        raise bad_request(f"text.format.{missing} is required when text.format.type is {fmt.type}",
                          f"text.format.{missing}")


def _previous(store: ResponseStore, response_id: str | None, owner: str) -> list[ChatMessage]:
    if response_id is None:
        return []
    entry = store.get(response_id, owner)
    if entry is None:
        raise APIError(404, f"Previous response with id '{response_id}' not found (never stored, deleted or "
                            "expired).", param="previous_response_id", code="response_not_found")
    return list(entry.conversation)


def input_messages(items: str | list) -> list[ChatMessage]:
    """Responses input items -> chat messages (consecutive function calls
    become one assistant turn, as chat templates expect)."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls and last.content is None:
                last.tool_calls.append(call)
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        else:
            messages.append(ChatMessage(role=item.role, content=item.content))
    return messages


def _tool_choice(choice: object) -> object:
    if isinstance(choice, ResponsesNamedToolChoice):
        return NamedToolChoice(type="function", function=NamedToolChoiceFunction(name=choice.name))
    return choice


def _assistant_message(parsed: ParsedOutput) -> ChatMessage:
    calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.tool_calls]
    content = parsed.content if parsed.content.strip() or not calls else None
    return ChatMessage(role="assistant", content=content, tool_calls=calls or None)


def _json(model: ResponseObject | DeletedResponse) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


class _Builder:
    """Builds the response object (and its output items) of one request."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str, num_prompt_tokens: int,
                 plan: ToolPlan) -> None:
        self.req = req
        self.response_id = response_id
        self.model = model
        self.created_at = now_s()
        self.num_prompt_tokens = num_prompt_tokens
        self.plan = plan
        self.message_id = f"msg_{uuid.uuid4().hex}"

    def base(self, status: str) -> ResponseObject:
        req = self.req
        choice = req.tool_choice
        fmt = req.text.format if req.text is not None else None
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status, model=self.model,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, store=req.store, temperature=req.temperature,
            top_p=req.top_p, tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            tool_choice=choice.model_dump() if isinstance(choice, ResponsesNamedToolChoice) else (choice or "auto"),
            parallel_tool_calls=req.parallel_tool_calls, metadata=req.metadata or {},
            text={"format": fmt.echo() if fmt is not None else {"type": "text"}},
        )

    def response(self, parsed: ParsedOutput, finish_reason: str | None, num_output_tokens: int,
                 num_cached_tokens: int) -> ResponseObject:
        incomplete = finish_reason == "length"
        response = self.base("incomplete" if incomplete else "completed")
        if parsed.content or not parsed.tool_calls:
            response.output.append(self.message(parsed.content, "incomplete" if incomplete else "completed"))
        response.output += [function_call_item(c) for c in parsed.tool_calls]
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if incomplete else None
        response.usage = ResponseUsage(
            input_tokens=self.num_prompt_tokens, output_tokens=num_output_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=num_cached_tokens),
            total_tokens=self.num_prompt_tokens + num_output_tokens,
        )
        return response

    def message(self, text: str | None, status: str) -> OutputMessage:
        content = [] if text is None else [OutputText(text=text)]
        return OutputMessage(id=self.message_id, status=status, content=content)


def function_call_item(call: ParsedToolCall) -> OutputFunctionCall:
    return OutputFunctionCall(id=f"fc_{call.id.removeprefix('call_')}", call_id=call.id, name=call.name,
                              arguments=call.arguments)


class _StreamEvents:
    """Typed SSE events of one streamed response, in OpenAI's order:
    created, in_progress; per output item added, (deltas), done; completed."""

    def __init__(self, builder: _Builder, keep: Callable[[ResponseObject, ParsedOutput], None]) -> None:
        self.b = builder
        self.keep = keep
        self.sequence_number = 0
        self.started = False
        self.text: str | None = None  # the message item's text once it was opened
        self.num_items = 0
        self.message_index = -1
        self.calls: list[ParsedToolCall] = []
        self.tool_stream = builder.plan.stream() if builder.plan.active else None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None

    def event(self, type_: str, **fields: object) -> str:
        payload = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type_}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def render(self, deltas: list[Delta]) -> list[str]:
        events = self._start()
        for d in deltas:
            self.num_output_tokens += d.num_tokens
            self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
            text, calls = d.text, []
            if self.tool_stream is not None:
                step = await self.tool_stream.feed(d.text)
                text, calls = step.content, list(step.tool_calls)
                if d.finish_reason is not None:
                    last = await self.tool_stream.finish()
                    text, calls = text + last.content, calls + last.tool_calls
            if d.finish_reason is not None:
                self.finish_reason = d.finish_reason
            if text:
                events += self._text(text)
            for call in calls:
                events += self._call(call)
        return events

    def final(self) -> list[str]:
        events = self._start()
        if self.text is not None or not self.calls:
            events += self._close_message()
        parsed = ParsedOutput(self.text or "", self.calls)
        response = self.b.response(parsed, self.finish_reason, self.num_output_tokens, self.num_cached_tokens)
        self._order_like_stream(response)
        self.keep(response, parsed)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return events + [self.event(kind, response=response.model_dump())]

    def _start(self) -> list[str]:
        if self.started:
            return []
        self.started = True
        response = self.b.base("in_progress").model_dump()
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def _open_message(self) -> list[str]:
        if self.text is not None:
            return []
        self.text = ""
        self.message_index = self.num_items
        self.num_items += 1
        return [self.event("response.output_item.added", output_index=self.message_index,
                           item=self.b.message(None, "in_progress").model_dump()),
                self.event("response.content_part.added", item_id=self.b.message_id,
                           output_index=self.message_index, content_index=0, part=OutputText(text="").model_dump())]

    def _text(self, text: str) -> list[str]:
        events = self._open_message()
        self.text += text
        events.append(self.event("response.output_text.delta", item_id=self.b.message_id,
                                 output_index=self.message_index, content_index=0, delta=text, logprobs=[]))
        return events

    def _close_message(self) -> list[str]:
        """At the end: the message item stays open while calls stream, so
        that text after a call still has a place."""
        events = self._open_message()
        part = OutputText(text=self.text or "")
        status = "incomplete" if self.finish_reason == "length" else "completed"
        return events + [
            self.event("response.output_text.done", item_id=self.b.message_id, output_index=self.message_index,
                       content_index=0, text=part.text, logprobs=[]),
            self.event("response.content_part.done", item_id=self.b.message_id, output_index=self.message_index,
                       content_index=0, part=part.model_dump()),
            self.event("response.output_item.done", output_index=self.message_index,
                       item=self.b.message(part.text, status).model_dump()),
        ]

    def _call(self, call: ParsedToolCall) -> list[str]:
        self.calls.append(call)
        index = self.num_items
        self.num_items += 1
        item = function_call_item(call)
        added = item.model_copy(update={"arguments": "", "status": "in_progress"})
        return [
            self.event("response.output_item.added", output_index=index, item=added.model_dump()),
            self.event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                       delta=call.arguments),
            self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                       name=call.name, arguments=call.arguments),
            self.event("response.output_item.done", output_index=index, item=item.model_dump()),
        ]

    def _order_like_stream(self, response: ResponseObject) -> None:
        """The completed response lists items in the order they were streamed."""
        if self.message_index < 0:
            return
        message = [o for o in response.output if isinstance(o, OutputMessage)]
        calls = [o for o in response.output if not isinstance(o, OutputMessage)]
        response.output = calls[:self.message_index] + message + calls[self.message_index:]


# ---- GET / DELETE /v1/responses/{id} -------------------------------------------

async def get_response(store: ResponseStore, response_id: str, owner: str) -> Response:
    """``owner``: the caller's tenant; another tenant's response reads as absent."""
    entry = store.get(response_id, owner)
    if entry is None:
        raise _not_found(response_id)
    return _json(entry.response)


async def delete_response(store: ResponseStore, response_id: str, owner: str) -> Response:
    if not store.delete(response_id, owner):
        raise _not_found(response_id)
    return _json(DeletedResponse(id=response_id))


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="response_not_found")
