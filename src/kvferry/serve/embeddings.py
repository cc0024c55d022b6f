"""POST /v1/embeddings: the served model's final hidden state (after the
final norm), pooled over each input's tokens and L2-normalized (vLLM's
default for a decoder model).

Each input is one prompt-only engine request (``SamplingParams.pooling``):
the core computes its prompt, samples nothing and returns the pooled vector;
its blocks are freed when it finishes, as any request's. The pooling, "last"
token or "mean", is the server's (``--embedding-pooling``).
"""
from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import numpy as np
from starlette.responses import Response

from kvferry.model.tokenizer import PromptTooLong
from kvferry.sampling import SamplingParams
from kvferry.serve.errors import APIError, bad_request
from kvferry.serve.params import raise_for_model, too_long
from kvferry.serve.protocol import (
    MAX_EMBEDDING_INPUTS, EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage,
)
from kvferry.serve.request_stream import RequestStream
from kvferry.serve.serving import ServingContext, collect, start_request, tokenize
from kvferry.serve.tenants import Caller


async def create_embeddings(ctx: ServingContext, req: EmbeddingRequest, caller: Caller, arrival: float,
                            pooling: str) -> Response:
    model = raise_for_model(req.model, ctx.served_model_names)
    if ctx.client.router.mode == "disagg":
        # A prompt-only request has no first token for a decode core to continue from.
        raise bad_request("embeddings are not supported with disaggregated prefill", "model")
    if req.dimensions is not None:
        raise bad_request("dimensions is not supported (the model's hidden size is returned)", "dimensions")
    inputs = await tokenize(embedding_inputs, req.input, ctx.client.tokenizer, ctx.client.max_model_len,
                            ctx.max_prompt_chars())
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    base_id = f"embd-{uuid.uuid4().hex}"
    streams: list[RequestStream] = []
    tasks: list[asyncio.Future] = []
    try:
        for i, ids in enumerate(inputs):
            streams.append(await start_request(ctx, f"{base_id}-{i}", ids, params, arrival, caller))
        tasks = [asyncio.ensure_future(collect(s)) for s in streams]
        finals = await asyncio.gather(*tasks)
    finally:
        # On an error or a client gone: stop the other inputs' collection
        # and abort their requests (closing is idempotent).
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()
    data = []
    for i, outs in enumerate(finals):
        vector = outs[0].embedding if outs else None
        if vector is None:
            raise APIError(500, f"input {i} ended without an embedding (finish_reason "
                                f"{outs[0].finish_reason if outs else None!r})", code="embedding_failed")
        data.append(EmbeddingData(index=i, embedding=_encode(vector, req.encoding_format)))
    num_tokens = sum(len(ids) for ids in inputs)
    body = EmbeddingResponse(data=data, model=model,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
    return Response(body.model_dump_json(), media_type="application/json")


def embedding_inputs(value: str | list[Any], tokenizer: Any, max_model_len: int | None = None,
                     max_chars: int | None = None) -> list[list[int]]:
    """The request's inputs as token ids, one list per vector (400 naming
    ``input`` on an empty input or too many of them, or a text too long to
    fit the context: ``max_chars``, refused before encoding)."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and all(isinstance(t, int) for t in value):
        items = [value]  # one input as token ids
    else:
        items = list(value)
    if not items:
        raise bad_request("input must not be empty", "input")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"input holds {len(items)} items; at most {MAX_EMBEDDING_INPUTS} per request", "input")
    out = []
    for i, item in enumerate(items):
        try:
            ids = tokenizer.encode(item, max_chars=max_chars) if isinstance(item, str) else list(item)
        except PromptTooLong as exc:
            raise too_long(exc, f"input[{i}]" if len(items) > 1 else "input", "input", max_model_len or 0) from None
        if not ids:
            raise bad_request(f"input[{i}] must not be empty", "input")
        out.append(ids)
    return out


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64: the float32 little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
