"""POST /v1/embeddings (serve/embeddings.py does the work)."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvferry.serve.embeddings import create_embeddings
from kvferry.serve.protocol import EmbeddingRequest
from kvferry.serve.serving import ServingContext, run_until_disconnected
from kvferry.serve.tenants import Caller, current_tenant
from kvferry.serve.unknown_fields import read_request_noting_unknown, with_unknown_header


def embedding_routes(ctx: ServingContext, max_body_bytes: int) -> list[Route]:
    async def embeddings(request: Request) -> Response:
        arrival = time.monotonic()
        req, unknown = await read_request_noting_unknown(request, EmbeddingRequest, max_body_bytes)
        caller = Caller(current_tenant.get())
        return with_unknown_header(await run_until_disconnected(
            request, create_embeddings(ctx, req, caller, arrival, ctx.api.embedding_pooling)), unknown)

    return [Route("/v1/embeddings", embeddings, methods=["POST"])]
