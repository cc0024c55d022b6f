"""POST /v1/completions."""
from __future__ import annotations

from starlette.responses import Response

from kvferry.outputs import RequestOutput
from kvferry.serve.logprobs import completion_logprobs
from kvferry.serve.params import completion_prompt_ids, raise_for_model, resolve_max_tokens, sampling_params
from kvferry.serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse, now_s
from kvferry.serve.serving import (
    Delta, RequestIds, ServingContext, final_usage, respond, sse, tokenize, usage,
)
from kvferry.serve.tenants import Caller


# OpenAI's default length for completions.
DEFAULT_MAX_TOKENS = 16


async def create_completion(ctx: ServingContext, req: CompletionRequest, caller: Caller, arrival: float,
                            client_request_id: str | None = None) -> Response:
    """``caller``: who sent it (its cache scope); ``arrival``: time.monotonic()
    when the HTTP request arrived (for TTFT)."""
    model = raise_for_model(req.model, ctx.served_model_names)
    prompt_ids = await tokenize(completion_prompt_ids, req, ctx.client.tokenizer)
    max_tokens = resolve_max_tokens(req.max_tokens, len(prompt_ids), ctx.client.max_model_len, "prompt",
                                    ctx.max_tokens(DEFAULT_MAX_TOKENS))
    params = sampling_params(req, max_tokens, req.logprobs)
    ids = RequestIds.make("cmpl", client_request_id)
    return await respond(
        ctx, ids, prompt_ids, params, arrival, caller, req.stream,
        make_chunks=lambda: _CompletionChunks(ctx, req, ids.public, model, len(prompt_ids)),
        make_body=lambda finals: _response(ctx, req, ids.public, model, len(prompt_ids), finals),
    )


def _response(ctx: ServingContext, req: CompletionRequest, request_id: str, model: str,
              num_prompt_tokens: int, finals: list[RequestOutput]) -> CompletionResponse:
    choices = []
    for out in finals:
        seq = out.outputs[0]
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(seq.logprobs or [], ctx.token_strings, 0)
        choices.append(CompletionChoice(index=seq.index, text=seq.text, logprobs=logprobs,
                                        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
    return CompletionResponse(
        id=request_id, created=now_s(), model=model, choices=choices,
        usage=final_usage(num_prompt_tokens, finals),
    )


class _CompletionChunks:
    """Renders one streamed completion; keeps the running counts that the
    usage chunk and the logprobs text offsets need."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, request_id: str, model: str,
                 num_prompt_tokens: int) -> None:
        self.ctx = ctx
        self.req = req
        self.request_id = request_id
        self.model = model
        self.created = now_s()
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0
        self.text_offset = [0] * req.n

    def render(self, deltas: list[Delta]) -> list[str]:
        events = []
        for d in deltas:
            self.num_completion_tokens += d.num_tokens
            self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
            logprobs = None
            if self.req.logprobs is not None and d.logprobs:
                logprobs = completion_logprobs(d.logprobs, self.ctx.token_strings, self.text_offset[d.index])
                # Offsets count token strings, as in the non-streamed response.
                self.text_offset[d.index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            if not d.text and logprobs is None and d.finish_reason is None:
                continue  # text held back (partial character or possible stop string)
            choice = CompletionChoice(index=d.index, text=d.text, logprobs=logprobs,
                                      finish_reason=d.finish_reason, stop_reason=d.stop_reason)
            events.append(sse(self._chunk([choice])))
        return events

    def final(self) -> list[str]:
        if not (self.req.stream_options and self.req.stream_options.include_usage):
            return []
        chunk = self._chunk([])
        chunk.usage = usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)
        return [sse(chunk)]

    def _chunk(self, choices: list[CompletionChoice]) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices)
