"""POST /v1/embeddings (serve/embeddings.py does the work)."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvferry.serve.embeddings import create_embeddings
from kvferry.serve.protocol import EmbeddingRequest
from kvferry.serve.serving import ServingContext, read_request, run_until_disconnected
from kvferry.serve.tenants import Caller, current_tenant


def embedding_routes(ctx: ServingContext, max_body_bytes: int) -> list[Route]:
    async def embeddings(request: Request) -> Response:
        arrival = time.monotonic()
        req = await read_request(request, EmbeddingRequest, max_body_bytes)
        caller = Caller(current_tenant.get())
        return await run_until_disconnected(
            request, create_embeddings(ctx, req, caller, arrival, ctx.api.embedding_pooling))

    return [Route("/v1/embeddings", embeddings, methods=["POST"])]
