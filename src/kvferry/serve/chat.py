"""POST /v1/chat/completions."""
from __future__ import annotations

from starlette.responses import Response

from kvferry.outputs import RequestOutput
from kvferry.serve.logprobs import chat_logprobs
from kvferry.serve.params import chat_logprobs as requested_logprobs
from kvferry.serve.params import chat_prompt_ids, raise_for_model, resolve_max_tokens, sampling_params
from kvferry.serve.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatMessage, DeltaFunctionCall, DeltaMessage, DeltaToolCall, ResponseFunctionCall,
    ResponseToolCall, now_s,
)
from kvferry.serve.serving import (
    Delta, RequestIds, ServingContext, final_usage, respond, sse, tokenize, usage,
)
from kvferry.serve.tenants import Caller
from kvferry.serve.tools import ParsedOutput, ParsedToolCall, ToolPlan, plan_tools, template_for


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, caller: Caller, arrival: float,
                                 client_request_id: str | None = None) -> Response:
    """``caller``: who sent it (its cache scope); ``arrival``: time.monotonic()
    when the HTTP request arrived (for TTFT)."""
    model = raise_for_model(req.model, ctx.served_model_names)
    logprobs = requested_logprobs(req)
    plan = plan_tools(req.tools, req.tool_choice, ctx.api.tool_call_parser)
    prompt_ids = await render_prompt(ctx, req.messages, plan, req.add_generation_prompt)
    # max_completion_tokens is the newer name; it wins when both are sent.
    requested, param = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                        else (req.max_tokens, "max_tokens"))
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), ctx.client.max_model_len, "messages",
                                    ctx.max_tokens(), param)
    params = sampling_params(req, max_tokens, logprobs, plan)
    ids = RequestIds.make("chatcmpl", client_request_id)
    return await respond(
        ctx, ids, prompt_ids, params, arrival, caller, req.stream,
        make_chunks=lambda: _ChatChunks(ctx, req, plan, ids.public, model, len(prompt_ids)),
        make_body=lambda finals: _response(ctx, req, plan, ids.public, model, len(prompt_ids), finals),
    )


async def render_prompt(ctx: ServingContext, messages: list[ChatMessage], plan: ToolPlan,
                        add_generation_prompt: bool = True, param: str = "messages") -> list[int]:
    """Prompt token ids of a conversation, tools included (shared with /v1/responses)."""
    uses_tools = plan.active or any(m.tool_calls or m.role == "tool" for m in messages)
    template = template_for(ctx.client.tokenizer.chat_template, ctx.api.chat_template, uses_tools)
    return await tokenize(chat_prompt_ids, messages, ctx.client.tokenizer, plan, template,
                          add_generation_prompt, param, ctx.api.allow_special_tokens_in_content,
                          ctx.client.max_model_len, ctx.max_prompt_chars())


def finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    # A reply that ended by itself after calling tools asks for their results.
    return "tool_calls" if has_tool_calls and reason == "stop" else reason


def tool_call_models(calls: list[ParsedToolCall]) -> list[ResponseToolCall]:
    return [ResponseToolCall(id=c.id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


async def _response(ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan, request_id: str, model: str,
                    num_prompt_tokens: int, finals: list[RequestOutput]) -> ChatCompletionResponse:
    choices = []
    for out in finals:
        seq = out.outputs[0]
        parsed = await plan.parse_async(seq.text) if plan.active else ParsedOutput(seq.text)
        content = parsed.content
        if parsed.tool_calls and not content.strip():
            content = None  # as OpenAI: a reply that only calls tools has no content
        message = AssistantMessage(content=content, tool_calls=tool_call_models(parsed.tool_calls) or None)
        logprobs = chat_logprobs(seq.logprobs or [], ctx.token_strings) if req.logprobs else None
        choices.append(ChatChoice(index=seq.index, message=message, logprobs=logprobs,
                                  finish_reason=finish_reason(seq.finish_reason, bool(parsed.tool_calls)),
                                  stop_reason=seq.stop_reason))
    return ChatCompletionResponse(
        id=request_id, created=now_s(), model=model, choices=choices,
        usage=final_usage(num_prompt_tokens, finals),
    )


class _ChatChunks:
    """Renders one streamed chat completion: a role chunk per choice first
    (as OpenAI does), then content and tool-call deltas, then the optional
    usage chunk. With tools, text goes through the tool parser's stream:
    content passes at once, a call is sent once its text is complete (its
    arguments in one delta: they are checked against the schema first)."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan, request_id: str,
                 model: str, num_prompt_tokens: int) -> None:
        self.ctx = ctx
        self.req = req
        self.plan = plan
        self.request_id = request_id
        self.model = model
        self.created = now_s()
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0
        self.sent_role: set[int] = set()
        self.tool_streams = {i: plan.stream() for i in range(req.n)} if plan.active else {}
        self.num_calls_sent = [0] * req.n

    async def render(self, deltas: list[Delta]) -> list[str]:
        events = []
        for d in deltas:
            self.num_completion_tokens += d.num_tokens
            self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
            if d.index not in self.sent_role:
                self.sent_role.add(d.index)
                role = ChatChunkChoice(index=d.index, delta=DeltaMessage(role="assistant", content=""))
                events.append(sse(self._chunk([role])))
            text, calls = await self._parse(d)
            logprobs = chat_logprobs(d.logprobs, self.ctx.token_strings) if self.req.logprobs and d.logprobs else None
            if not text and not calls and logprobs is None and d.finish_reason is None:
                continue  # text held back (partial character, possible stop string, a call in progress)
            reason = finish_reason(d.finish_reason, self.num_calls_sent[d.index] > 0)
            # As OpenAI streams a call: one delta opens it (id, type, name,
            # empty arguments), the next carries the arguments.
            deltas_out = [DeltaMessage(content=text or None)] if text or not calls else []
            for call in calls:
                header = call.model_copy(update={"function": DeltaFunctionCall(name=call.function.name,
                                                                                arguments="")})
                arguments = DeltaToolCall(index=call.index, function=DeltaFunctionCall(
                    arguments=call.function.arguments))
                deltas_out += [DeltaMessage(tool_calls=[header]), DeltaMessage(tool_calls=[arguments])]
            for i, delta in enumerate(deltas_out):
                last = i == len(deltas_out) - 1
                choice = ChatChunkChoice(index=d.index, delta=delta, logprobs=logprobs if i == 0 else None,
                                         finish_reason=reason if last else None,
                                         stop_reason=d.stop_reason if last else None)
                events.append(sse(self._chunk([choice])))
        return events

    async def _parse(self, d: Delta) -> tuple[str, list[DeltaToolCall]]:
        stream = self.tool_streams.get(d.index)
        if stream is None:
            return d.text, []
        step = await stream.feed(d.text)
        text, calls = step.content, list(step.tool_calls)
        if d.finish_reason is not None:
            last = await stream.finish()
            text, calls = text + last.content, calls + last.tool_calls
        deltas = []
        for call in calls:
            deltas.append(DeltaToolCall(index=self.num_calls_sent[d.index], id=call.id, type="function",
                                        function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
            self.num_calls_sent[d.index] += 1
        return text, deltas

    def final(self) -> list[str]:
        if not (self.req.stream_options and self.req.stream_options.include_usage):
            return []
        chunk = self._chunk([])
        chunk.usage = usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)
        return [sse(chunk)]

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices)
