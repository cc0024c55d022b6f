"""GET /v1/models and /v1/models/{model}, and POST /tokenize and /detokenize (also under /v1/) (vLLM's extension
endpoints; its benchmark client probes /tokenize)."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvferry.serve.errors import APIError
from kvferry.serve.protocol import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest, now_s
from kvferry.serve.serving import ServingContext, read_request
from kvferry.serve.tokenize import detokenize_endpoint, tokenize_endpoint


def model_routes(ctx: ServingContext, model_path: str | None) -> list[Route]:
    """``model_path``: reported as every card's root (else the served name)."""

    async def models(request: Request) -> Response:
        cards = [ModelCard(id=name, created=now_s(), root=model_path or name,
                           max_model_len=ctx.client.max_model_len) for name in ctx.served_model_names]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    async def model(request: Request) -> Response:
        # One card, as OpenAI's GET /v1/models/{model} (client.models.retrieve).
        name = request.path_params["model"]
        if name not in ctx.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model", code="model_not_found")
        card = ModelCard(id=name, created=now_s(), root=model_path or name, max_model_len=ctx.client.max_model_len)
        return Response(card.model_dump_json(), media_type="application/json")

    return [Route("/v1/models", models, methods=["GET"]), Route("/v1/models/{model:path}", model, methods=["GET"])]


def tokenize_routes(ctx: ServingContext, max_body_bytes: int) -> list[Route]:
    async def tokenize(request: Request) -> Response:
        return await tokenize_endpoint(ctx, await read_request(request, TokenizeRequest, max_body_bytes))

    async def detokenize(request: Request) -> Response:
        return await detokenize_endpoint(ctx, await read_request(request, DetokenizeRequest, max_body_bytes))

    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        # Aliases under /v1, where OpenAI-style clients look for every route.
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
    ]
