"""GET /health (and /ping, as vLLM's), GET /version and GET /metrics.

/health and /version are open (probes and deploy checks carry no key). /metrics checks keys itself rather
than through the auth middleware: it is open without keys (and with
--metrics-public), while the per-tenant series are an admin's only.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvferry.cli_parser import package_version
from kvferry.kvstore.supervisor import with_store_health
from kvferry.serve.auth import metrics_access
from kvferry.serve.engine_client import AsyncEngineClient
from kvferry.serve.errors import error_response
from kvferry.serve.metrics import CONTENT_TYPE, ServerMetrics
from kvferry.serve.tenants import ApiKeys


def health_routes(client: AsyncEngineClient, metrics: ServerMetrics, keys: ApiKeys | None,
                  metrics_public: bool) -> list[Route]:
    async def health(request: Request) -> Response:
        state = client.health()
        if (store := getattr(request.app.state, "kv_store", None)) is not None:  # the node KV store this server runs
            state = with_store_health(state, store.health)
        if state["status"] in ("ok", "degraded"):  # "degraded": some core is down, every role still has one
            return JSONResponse(state)
        code = "engine_restarting" if state["status"] == "restarting" else "engine_unavailable"
        return error_response(503, state["reason"], code=code)

    async def version(request: Request) -> Response:
        # As vLLM's /version: the installed distribution's version.
        return JSONResponse({"version": package_version()})

    async def prometheus(request: Request) -> Response:
        admin = metrics_access(keys, request.scope["headers"], public=metrics_public)
        return Response(metrics.render(include_tenants=admin), media_type=CONTENT_TYPE)

    return [
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),  # vLLM's (SageMaker's) liveness probe: /health's answer
        Route("/version", version, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
