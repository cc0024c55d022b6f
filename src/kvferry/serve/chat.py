"""POST /v1/chat/completions."""
from __future__ import annotations

from starlette.responses import Response

from kvferry.outputs import RequestOutput
from kvferry.serve.logprobs import chat_logprobs
from kvferry.serve.params import chat_logprobs as requested_logprobs
from kvferry.serve.params import chat_prompt_ids, raise_for_model, resolve_max_tokens, sampling_params
from kvferry.serve.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, DeltaMessage, now_s, random_id,
)
from kvferry.serve.serving import (
    Delta, ServingContext, final_usage, respond, sse, tokenize, usage,
)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, arrival: float) -> Response:
    """``arrival``: time.monotonic() when the HTTP request arrived (for TTFT)."""
    model = raise_for_model(req.model, ctx.served_model_names)
    logprobs = requested_logprobs(req)
    prompt_ids = await tokenize(chat_prompt_ids, req, ctx.client.tokenizer)
    # max_completion_tokens is the newer name; it wins when both are sent.
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), ctx.client.max_model_len, "messages")
    params = sampling_params(req, max_tokens, logprobs)
    request_id = random_id("chatcmpl")
    return await respond(
        ctx, request_id, prompt_ids, params, arrival, req.stream,
        make_chunks=lambda: _ChatChunks(ctx, req, request_id, model, len(prompt_ids)),
        make_body=lambda finals: _response(ctx, req, request_id, model, len(prompt_ids), finals),
    )


def _response(ctx: ServingContext, req: ChatCompletionRequest, request_id: str, model: str,
              num_prompt_tokens: int, finals: list[RequestOutput]) -> ChatCompletionResponse:
    choices = []
    for out in finals:
        seq = out.outputs[0]
        logprobs = chat_logprobs(seq.logprobs or [], ctx.token_strings) if req.logprobs else None
        choices.append(ChatChoice(index=seq.index, message=AssistantMessage(content=seq.text), logprobs=logprobs,
                                  finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
    return ChatCompletionResponse(
        id=request_id, created=now_s(), model=model, choices=choices,
        usage=final_usage(num_prompt_tokens, finals),
    )


class _ChatChunks:
    """Renders one streamed chat completion: a role chunk per choice first
    (as OpenAI does), then content deltas, then the optional usage chunk."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, request_id: str, model: str,
                 num_prompt_tokens: int) -> None:
        self.ctx = ctx
        self.req = req
        self.request_id = request_id
        self.model = model
        self.created = now_s()
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0
        self.sent_role: set[int] = set()

    def render(self, deltas: list[Delta]) -> list[str]:
        events = []
        for d in deltas:
            self.num_completion_tokens += d.num_tokens
            self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
            if d.index not in self.sent_role:
                self.sent_role.add(d.index)
                role = ChatChunkChoice(index=d.index, delta=DeltaMessage(role="assistant", content=""))
                events.append(sse(self._chunk([role])))
            logprobs = chat_logprobs(d.logprobs, self.ctx.token_strings) if self.req.logprobs and d.logprobs else None
            if not d.text and logprobs is None and d.finish_reason is None:
                continue  # text held back (partial character or possible stop string)
            choice = ChatChunkChoice(index=d.index, delta=DeltaMessage(content=d.text if d.text else None),
                                     logprobs=logprobs, finish_reason=d.finish_reason, stop_reason=d.stop_reason)
            events.append(sse(self._chunk([choice])))
        return events

    def final(self) -> list[str]:
        if not (self.req.stream_options and self.req.stream_options.include_usage):
            return []
        chunk = self._chunk([])
        chunk.usage = usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)
        return [sse(chunk)]

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices)
