"""POST /v1/completions.

``echo``: the returned text starts with the prompt; with ``logprobs`` the
logprobs cover the prompt's tokens too (the first one has none: null), which
is how lm-eval's loglikelihood requests read a continuation's logprob
(``echo=true, logprobs=1, max_tokens=0 or 1``). ``max_tokens=0`` is allowed
only with echo: the engine computes the prompt and samples nothing.
"""
from __future__ import annotations

from dataclasses import replace

from starlette.responses import Response

from kvferry.core.outputs import TokenLogprobs
from kvferry.outputs import RequestOutput
from kvferry.serve.errors import APIError, bad_request
from kvferry.serve.logprobs import TokenStrings, completion_logprobs
from kvferry.serve.params import completion_prompt_ids, raise_for_model, resolve_max_tokens, sampling_params
from kvferry.serve.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, now_s
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
    if req.echo and req.stream:
        raise bad_request("echo is not supported with stream", "echo")
    prompt_ids = await tokenize(completion_prompt_ids, req, ctx.client.tokenizer)
    prompt_only = req.echo and req.max_tokens == 0  # echo the prompt, generate nothing (as vLLM)
    max_tokens = resolve_max_tokens(1 if prompt_only else req.max_tokens, len(prompt_ids),
                                    ctx.client.max_model_len, "prompt", ctx.max_tokens(DEFAULT_MAX_TOKENS))
    if req.echo and (prompt_only or req.logprobs is not None) and ctx.client.router.mode == "disagg":
        # The prefill core computes the prompt; its prompt results do not travel with the KV.
        raise bad_request("echo with logprobs or max_tokens=0 is not supported with disaggregated prefill", "echo")
    params = sampling_params(req, max_tokens, req.logprobs)
    if req.echo:
        params = replace(params, prompt_only=prompt_only, prompt_logprobs=req.logprobs)
    ids = RequestIds.make("cmpl", client_request_id)
    prompt_text = None
    if req.echo:
        # Token ids are echoed as their text, special tokens included.
        prompt_text = _prompt_text(req) or await tokenize(ctx.client.tokenizer.decode, prompt_ids, False)
    return await respond(
        ctx, ids, prompt_ids, params, arrival, caller, req.stream,
        make_chunks=lambda: _CompletionChunks(ctx, req, ids.public, model, len(prompt_ids)),
        make_body=lambda finals: _response(ctx, req, ids.public, model, prompt_ids, prompt_text, finals),
    )


def _prompt_text(req: CompletionRequest) -> str | None:
    """The prompt as the client sent it, when it sent text."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def _response(ctx: ServingContext, req: CompletionRequest, request_id: str, model: str,
              prompt_ids: list[int], prompt_text: str | None, finals: list[RequestOutput]) -> CompletionResponse:
    """``prompt_text``: set with echo (the text's prefix)."""
    choices = []
    for out in finals:
        seq = out.outputs[0]
        text, logprobs = seq.text, None
        if prompt_text is not None:
            text = prompt_text + seq.text
            if req.logprobs is not None:
                logprobs = _echo_logprobs(prompt_ids, out.prompt_logprobs, seq.logprobs or [], ctx.token_strings)
        elif req.logprobs is not None:
            logprobs = completion_logprobs(seq.logprobs or [], ctx.token_strings, 0)
        choices.append(CompletionChoice(index=seq.index, text=text, logprobs=logprobs,
                                        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
    return CompletionResponse(
        id=request_id, created=now_s(), model=model, choices=choices,
        usage=final_usage(len(prompt_ids), finals),
    )


def _echo_logprobs(prompt_ids: list[int], prompt_logprobs: list[TokenLogprobs | None] | None,
                   generated: list[TokenLogprobs], strings: TokenStrings) -> CompletionLogprobs:
    """The prompt's tokens then the generated ones, as one logprobs object:
    the first prompt token's logprob and top_logprobs are null (nothing
    precedes it), as in vLLM and OpenAI."""
    entries = prompt_logprobs[1:] if prompt_logprobs is not None else []
    if len(entries) != len(prompt_ids) - 1 or any(e is None for e in entries):
        # The engine reports them with the step that ends the prompt; a
        # request that ended before that (an error) has none.
        raise APIError(500, "the prompt's logprobs are missing: the request ended before its prompt was computed")
    first = prompt_ids[0]
    out = completion_logprobs(entries, strings, len(strings(first)))
    out.tokens.insert(0, strings(first))
    out.token_logprobs.insert(0, None)
    out.top_logprobs.insert(0, None)
    out.text_offset.insert(0, 0)
    offset = out.text_offset[-1] + len(out.tokens[-1])
    rest = completion_logprobs(generated, strings, offset)
    out.tokens += rest.tokens
    out.token_logprobs += rest.token_logprobs
    out.top_logprobs += rest.top_logprobs
    out.text_offset += rest.text_offset
    return out


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
