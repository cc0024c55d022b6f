"""POST /tokenize and /detokenize (vLLM's extension endpoints; its benchmark
client probes /tokenize)."""
from __future__ import annotations

from starlette.responses import Response

from kvferry.serve.chat import render_prompt
from kvferry.serve.errors import bad_request
from kvferry.model.tokenizer import PromptTooLong
from kvferry.serve.params import raise_for_model, too_long
from kvferry.serve.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from kvferry.serve.serving import ServingContext, tokenize
from kvferry.serve.tools import plan_tools


async def tokenize_endpoint(ctx: ServingContext, req: TokenizeRequest) -> Response:
    raise_for_model(req.model, ctx.served_model_names)
    tokenizer = ctx.client.tokenizer
    if req.messages is not None:
        plan = plan_tools(req.tools, "auto" if req.tools else None, ctx.api.tool_call_parser)
        ids = await render_prompt(ctx, req.messages, plan, req.add_generation_prompt)
    else:
        assert req.prompt is not None
        try:
            ids = await tokenize(tokenizer.encode, req.prompt, req.add_special_tokens, ctx.max_prompt_chars())
        except PromptTooLong as exc:
            raise too_long(exc, "prompt", "prompt", ctx.client.max_model_len) from None
    body = TokenizeResponse(count=len(ids), max_model_len=ctx.client.max_model_len, tokens=ids)
    return Response(body.model_dump_json(), media_type="application/json")


async def detokenize_endpoint(ctx: ServingContext, req: DetokenizeRequest) -> Response:
    raise_for_model(req.model, ctx.served_model_names)
    tokenizer = ctx.client.tokenizer
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise bad_request(f"tokens[{bad}] = {req.tokens[bad]} is not a token id (vocabulary size "
                          f"{tokenizer.vocab_size})", f"tokens.{bad}")
    text = tokenizer.decode(req.tokens, skip_special_tokens=False)
    return Response(DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")
