"""The OpenAI generation routes: POST /v1/completions, /v1/chat/completions
and /v1/responses; GET and DELETE /v1/responses/{response_id}.

A generation request is tied to its caller here, once: the tenant the auth
middleware authenticated and the body's cache salt make the ``Caller`` that
the handler passes down to where the request's CacheScope is built
(serving.start_request), so nothing below this module looks the caller up.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvferry.serve.chat import create_chat_completion
from kvferry.serve.completions import create_completion
from kvferry.serve.http_limits import client_request_id
from kvferry.serve.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest, SamplingFields
from kvferry.serve.responses import ResponseStore, create_response, delete_response, get_response
from kvferry.serve.serving import ServingContext, run_until_disconnected
from kvferry.serve.tenants import Caller, current_tenant
from kvferry.serve.unknown_fields import read_request_noting_unknown, with_unknown_header

# handler(ctx, request body, caller, arrival time, the client's X-Request-Id)
Handler = Callable[[ServingContext, BaseModel, Caller, float, str | None], Awaitable[Response]]


def generation_routes(ctx: ServingContext, store: ResponseStore, max_body_bytes: int) -> list[Route]:
    def generation(model: type[SamplingFields], handler: Handler):
        async def endpoint(request: Request) -> Response:
            arrival = time.monotonic()
            # The body is read before the disconnect watcher starts: both
            # read from receive(), and the watcher must not eat body chunks.
            req, unknown = await read_request_noting_unknown(request, model, max_body_bytes)
            request_id = client_request_id(request.headers)
            caller = Caller(current_tenant.get(), req.cache_salt)  # the salt narrows the tenant's namespace
            response = await run_until_disconnected(request, handler(ctx, req, caller, arrival, request_id))
            return with_unknown_header(response, unknown)
        return endpoint

    async def respond_with(ctx: ServingContext, req: ResponsesRequest, caller: Caller, arrival: float,
                           request_id: str | None) -> Response:
        return await create_response(store, ctx, req, caller, arrival, request_id)

    async def stored_response(request: Request) -> Response:
        return await get_response(store, request.path_params["response_id"], current_tenant.get().name)

    async def delete_stored_response(request: Request) -> Response:
        return await delete_response(store, request.path_params["response_id"], current_tenant.get().name)

    return [
        Route("/v1/completions", generation(CompletionRequest, create_completion), methods=["POST"]),
        Route("/v1/chat/completions", generation(ChatCompletionRequest, create_chat_completion), methods=["POST"]),
        Route("/v1/responses", generation(ResponsesRequest, respond_with), methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_stored_response, methods=["DELETE"]),
    ]
