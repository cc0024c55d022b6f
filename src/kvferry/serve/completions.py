"""POST /v1/completions.

``prompt``: a string, token ids, or a list of either: each prompt is its own
engine request (n sequences each), and the choices are numbered
``prompt_index * n + i``, as vLLM numbers them; usage sums them all. Every
prompt is checked before any runs.

``echo``: the returned text starts with the prompt; with ``logprobs`` the
logprobs cover the prompt's tokens too (the first one has none: null), which
is how lm-eval's loglikelihood requests read a continuation's logprob
(``echo=true, logprobs=1, max_tokens=0 or 1``). ``max_tokens=0`` is allowed
only with echo: the engine computes the prompt and samples nothing.
Streamed, a choice's first chunk carries its prompt (and the prompt's
logprobs) before what it generated, as vLLM streams it.

``prompt_logprobs`` (vLLM's extension, 0 to 20): each choice carries
``prompt_logprobs``, one entry per prompt token (the first null), each the
prompt token's and the top-n tokens' ``{logprob, rank, decoded_token}`` by
token id. The engine computes them as it does echo's (the same numbers);
as in vLLM they are not streamed.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from starlette.responses import Response

from kvferry.core.outputs import TokenLogprobs
from kvferry.outputs import RequestOutput
from kvferry.sampling import SamplingParams
from kvferry.serve.choice_streams import ChoiceStreams
from kvferry.serve.errors import APIError, bad_request
from kvferry.serve.logprobs import TokenStrings, completion_logprobs, prompt_logprobs
from kvferry.serve.params import (
    CompletionPrompt, completion_prompts, raise_for_model, resolve_max_tokens, sampling_params,
)
from kvferry.serve.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage, now_s,
)
from kvferry.serve.request_stream import RequestStream
from kvferry.serve.serving import (
    Delta, EventStreamResponse, RequestIds, ServingContext, collect, sse, start_request, stream_events, tokenize,
    usage,
)
from kvferry.serve.tenants import Caller


# OpenAI's default length for completions.
DEFAULT_MAX_TOKENS = 16
MAX_PROMPT_LOGPROBS = 20  # as logprobs (SamplingParams' bound)


async def create_completion(ctx: ServingContext, req: CompletionRequest, caller: Caller, arrival: float,
                            client_request_id: str | None = None) -> Response:
    """``caller``: who sent it (its cache scope); ``arrival``: time.monotonic()
    when the HTTP request arrived (for TTFT)."""
    model = raise_for_model(req.model, ctx.served_model_names)
    _check_prompt_logprobs(req)
    prompts = await tokenize(completion_prompts, req, ctx.client.tokenizer, ctx.client.ready.vocab_size,
                             ctx.client.max_model_len, ctx.max_prompt_chars())
    prompt_only = req.echo and req.max_tokens == 0  # echo the prompt, generate nothing (as vLLM)
    if req.echo and (prompt_only or req.logprobs is not None) and ctx.client.router.mode == "disagg":
        # The prefill core computes the prompt; its prompt results do not travel with the KV.
        raise bad_request("echo with logprobs or max_tokens=0 is not supported with disaggregated prefill", "echo")
    if req.prompt_logprobs is not None and ctx.client.router.mode == "disagg":
        raise bad_request("prompt_logprobs is not supported with disaggregated prefill", "prompt_logprobs")
    params = _prompt_params(ctx, req, prompts, prompt_only)
    ids = RequestIds.make("cmpl", client_request_id)
    echo_texts = await tokenize(_echo_texts, prompts, ctx.client.tokenizer) if req.echo else None
    streams: list[RequestStream] = []
    try:
        for k, (prompt, p) in enumerate(zip(prompts, params)):
            engine_id = ids.engine if len(prompts) == 1 else f"{ids.engine}-{k}"
            streams.append(await start_request(ctx, engine_id, prompt.ids, p, arrival, caller))
    except BaseException:
        # One refused (overload, a dead engine) or the client gone: none runs.
        for stream in streams:
            stream.close()
        raise
    choices = ChoiceStreams(streams, req.n)
    if req.stream:
        chunks = _CompletionChunks(ctx, req, ids.public, model, prompts, echo_texts, choices)
        return EventStreamResponse(stream_events(choices, chunks.render, chunks.final), choices)
    finals = await collect(choices)
    body = _response(ctx, req, ids.public, model, prompts, echo_texts, finals)
    return Response(body.model_dump_json(), media_type="application/json")


def _prompt_params(ctx: ServingContext, req: CompletionRequest, prompts: list[CompletionPrompt],
                   prompt_only: bool) -> list[SamplingParams]:
    """Each prompt's SamplingParams (they differ only in max_tokens, which
    depends on the prompt's length when the request leaves it out)."""
    limits = ctx.max_tokens(DEFAULT_MAX_TOKENS)
    lengths = [resolve_max_tokens(1 if prompt_only else req.max_tokens, len(prompt.ids), ctx.client.max_model_len,
                                  "prompt", limits, which=f"prompt[{k}]" if len(prompts) > 1 else None)
               for k, prompt in enumerate(prompts)]
    # Built (and its output constraint compiled) once; copies differ in max_tokens.
    params = sampling_params(req, lengths[0], req.logprobs)
    # One computation serves echo's logprobs and prompt_logprobs: the larger
    # top-n, each answer cut to its own.
    wanted = [n for n in (req.logprobs if req.echo else None, req.prompt_logprobs) if n is not None]
    if req.echo or wanted:
        params = replace(params, prompt_only=prompt_only, prompt_logprobs=max(wanted) if wanted else None)
    return [params if m == params.max_tokens else replace(params, max_tokens=m) for m in lengths]


def _check_prompt_logprobs(req: CompletionRequest) -> None:
    """vLLM's bounds: a count of top tokens (here at most 20, as logprobs),
    and not with stream."""
    n = req.prompt_logprobs
    if n is None:
        return
    if not 0 <= n <= MAX_PROMPT_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], got {n}", "prompt_logprobs")
    if req.stream:
        raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")


def _with_top(entries: list[TokenLogprobs | None], n: int) -> list[TokenLogprobs | None]:
    """Entries cut to the top ``n`` (the engine computed the larger of two counts)."""
    return [e if e is None or len(e.top_token_ids) <= n else
            replace(e, top_token_ids=e.top_token_ids[:n], top_logprobs=e.top_logprobs[:n]) for e in entries]


def _echo_texts(prompts: list[CompletionPrompt], tokenizer: Any) -> list[str]:
    """The text each prompt is echoed as: as sent, or token ids as their
    text, special tokens included."""
    return [p.text if p.text is not None else tokenizer.decode(p.ids, False) for p in prompts]


def _response(ctx: ServingContext, req: CompletionRequest, request_id: str, model: str,
              prompts: list[CompletionPrompt], echo_texts: list[str] | None,
              finals: list[RequestOutput]) -> CompletionResponse:
    """``finals``: every choice's final output, by choice index."""
    choices = []
    for out in finals:
        seq = out.outputs[0]
        prompt = prompts[seq.index // req.n]
        text, logprobs, prompt_entries = seq.text, None, None
        if echo_texts is not None:
            text = echo_texts[seq.index // req.n] + seq.text
            if req.logprobs is not None:
                entries = None if out.prompt_logprobs is None else _with_top(out.prompt_logprobs, req.logprobs)
                logprobs = _echo_logprobs(prompt.ids, entries, seq.logprobs or [], ctx.token_strings)
        elif req.logprobs is not None:
            logprobs = completion_logprobs(seq.logprobs or [], ctx.token_strings, 0)
        if req.prompt_logprobs is not None:
            prompt_entries = prompt_logprobs(_checked_prompt_logprobs(prompt.ids, out.prompt_logprobs),
                                             req.prompt_logprobs, ctx.token_strings)
        choices.append(CompletionChoice(index=seq.index, text=text, logprobs=logprobs,
                                        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                        prompt_logprobs=prompt_entries))
    return CompletionResponse(
        id=request_id, created=now_s(), model=model, choices=choices,
        usage=_usage(prompts, req.n, finals),
    )


def _usage(prompts: list[CompletionPrompt], n: int, finals: list[RequestOutput]) -> Usage:
    """Every prompt once, every choice's tokens; cached tokens per prompt (its
    n sequences share one prompt) summed over the prompts."""
    cached = [0] * len(prompts)
    for out in finals:
        k = out.outputs[0].index // n
        cached[k] = max(cached[k], out.num_cached_tokens)
    return usage(sum(len(p.ids) for p in prompts), sum(len(out.outputs[0].token_ids) for out in finals), sum(cached))


def _checked_prompt_logprobs(prompt_ids: list[int], prompt_logprobs: list[TokenLogprobs | None] | None,
                             ) -> list[TokenLogprobs | None]:
    """The engine's prompt logprobs, one per prompt token (the first None)."""
    entries = prompt_logprobs[1:] if prompt_logprobs is not None else []
    if len(entries) != len(prompt_ids) - 1 or any(e is None for e in entries):
        # The engine reports them with the step that ends the prompt; a
        # request that ended before that (an error) has none.
        raise APIError(500, "the prompt's logprobs are missing: the request ended before its prompt was computed")
    return [None, *entries]


def _echo_logprobs(prompt_ids: list[int], prompt_logprobs: list[TokenLogprobs | None] | None,
                   generated: list[TokenLogprobs], strings: TokenStrings) -> CompletionLogprobs:
    """The prompt's tokens then the generated ones, as one logprobs object:
    the first prompt token's logprob and top_logprobs are null (nothing
    precedes it), as in vLLM and OpenAI."""
    entries = _checked_prompt_logprobs(prompt_ids, prompt_logprobs)[1:]
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
    usage chunk and the logprobs text offsets need. With echo, a choice's
    first chunk starts with its prompt (text and logprobs), as in vLLM."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, request_id: str, model: str,
                 prompts: list[CompletionPrompt], echo_texts: list[str] | None, choices: ChoiceStreams) -> None:
        self.ctx = ctx
        self.req = req
        self.request_id = request_id
        self.model = model
        self.created = now_s()
        self.prompts = prompts
        self.echo_texts = echo_texts
        self.choices = choices
        num_choices = len(prompts) * req.n
        self.num_completion_tokens = 0
        self.num_cached_tokens = [0] * len(prompts)  # per prompt: its n sequences share it
        self.text_offset = [0] * num_choices
        self.to_echo = set(range(num_choices)) if echo_texts is not None else set()

    def render(self, deltas: list[Delta]) -> list[str]:
        events = []
        for d in deltas:
            k = d.index // self.req.n
            self.num_completion_tokens += d.num_tokens
            self.num_cached_tokens[k] = max(self.num_cached_tokens[k], d.num_cached_tokens)
            text, logprobs = d.text, None
            if d.index in self.to_echo:
                assert self.echo_texts is not None
                self.to_echo.discard(d.index)
                text = self.echo_texts[k] + d.text
                if self.req.logprobs is not None:
                    logprobs = _echo_logprobs(self.prompts[k].ids, self.choices.prompt_logprobs.get(d.index),
                                              d.logprobs, self.ctx.token_strings)
            elif self.req.logprobs is not None and d.logprobs:
                logprobs = completion_logprobs(d.logprobs, self.ctx.token_strings, self.text_offset[d.index])
            if logprobs is not None and logprobs.tokens:
                # Offsets count token strings, as in the non-streamed response.
                self.text_offset[d.index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            if not text and logprobs is None and d.finish_reason is None:
                continue  # text held back (partial character or possible stop string)
            choice = CompletionChoice(index=d.index, text=text, logprobs=logprobs,
                                      finish_reason=d.finish_reason, stop_reason=d.stop_reason)
            events.append(sse(self._chunk([choice])))
        return events

    def final(self) -> list[str]:
        if not (self.req.stream_options and self.req.stream_options.include_usage):
            return []
        chunk = self._chunk([])
        chunk.usage = usage(sum(len(p.ids) for p in self.prompts), self.num_completion_tokens,
                            sum(self.num_cached_tokens))
        return [sse(chunk)]

    def _chunk(self, choices: list[CompletionChoice]) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices)
