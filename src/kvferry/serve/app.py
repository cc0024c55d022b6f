"""The ASGI app: routes, lifespan (engine loop start / stop), error handlers.

    build_app(client, ServerConfig(...)) -> Starlette

The app uses an AsyncEngineClient whose core is up (handshake done); its
lifespan starts the client's output handling on the server's event loop and
stops the core after uvicorn has drained the in-flight requests (graceful
shutdown).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from functools import partial
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvferry.engine.core_client import EngineCoreStartError
from kvferry.serve.api_flags import ApiOptions
from kvferry.serve.auth import AuthMiddleware, metrics_access
from kvferry.serve.chat import create_chat_completion
from kvferry.serve.cli import DEFAULT_MAX_REQUEST_BODY_BYTES
from kvferry.serve.completions import create_completion
from kvferry.serve.engine_client import AsyncEngineClient, EngineDeadError
from kvferry.serve.errors import EXCEPTION_HANDLERS, APIError, bad_request, error_response
from kvferry.serve.http_limits import RequestLimitsMiddleware, client_request_id
from kvferry.serve.logprobs import TokenStrings
from kvferry.serve.metrics import CONTENT_TYPE, PUBLIC_POOL_LABEL, ServerMetrics, TenantLabels
from kvferry.serve.kv_routes import PublicPrefixService, public_prefix_routes
from kvferry.serve.public_prefixes import CachePolicy, PrefixLimits, PublicPrefixes, PublicPrefixRegistry
from kvferry.serve.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard, ModelList, ResponsesRequest,
    TokenizeRequest, now_s,
)
from kvferry.serve.responses import ResponseStore, create_response, delete_response, get_response
from kvferry.serve.serving import ServingContext, read_body, read_request, run_until_disconnected
from kvferry.serve.tenants import ApiKeys, CacheNamespaces, add_tier_hit_rates, current_cache_salt, current_tenant, empty_tenant_stats
from kvferry.serve.tokenize import detokenize_endpoint, tokenize_endpoint

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerConfig:
    served_model_names: list[str]
    model_path: str | None = None  # reported as the model card's root
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # Time the engine core gets to exit after the HTTP side has drained.
    engine_stop_timeout_s: float = 10.0
    api: ApiOptions = field(default_factory=ApiOptions)  # the OpenAI layer's flags

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(isinstance(n, str) and n for n in self.served_model_names):
            raise ValueError("served_model_names must hold at least one non-empty name")
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}")


class _WorkerBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    address: Annotated[str, Field(min_length=1, max_length=1024)]
    role: Annotated[str, Field(max_length=16)] = "engine"


def _worker_body(body: bytes) -> _WorkerBody:
    """pydantic's JSON parser bounds nesting (json.loads recursed until a
    RecursionError, a 500) and refuses lone surrogates."""
    try:
        return _WorkerBody.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        raise bad_request(f"expected a JSON object with a string 'address' (and 'role'): {first['msg']}",
                          "address") from None


def build_app(client: AsyncEngineClient, config: ServerConfig) -> Starlette:
    namespaces = CacheNamespaces.from_file(config.api.cache_secret_file)
    tenant_labels = TenantLabels(config.api.metrics_max_tenants) if config.api.metrics_tenant_labels else None
    metrics = ServerMetrics(config.served_model_names[0], lambda: client.stats, tenant_labels,
                            owner_label=lambda owner: PUBLIC_POOL_LABEL if owner == namespaces.public else owner)
    client.observer = metrics
    ctx = ServingContext(client, list(config.served_model_names), TokenStrings(client.tokenizer), config.api)
    store = ResponseStore(config.api.responses_store_size, config.api.responses_store_ttl_s)
    keys = ApiKeys(config.api.api_keys_file) if config.api.api_keys_file else None
    ready = client.ready
    limits = PrefixLimits(
        max_tokens_per_prefix=client.max_model_len - 1,
        # Public blocks stay pinned in the device pool while declared: at
        # most a quarter of it, so tenants always keep the rest.
        max_total_tokens=ready.num_kv_blocks * ready.block_size // 4,
        max_prefixes_per_tenant=config.api.max_public_prefixes_per_tenant,
        max_tokens_per_tenant=config.api.max_public_prefix_tokens_per_tenant)
    public = PublicPrefixRegistry(PublicPrefixes(ready.block_size, limits=limits), client.tokenizer,
                                  config.api.chat_template)
    if config.api.public_prefixes_file:
        public.load_file(config.api.public_prefixes_file)
    client.input_processor.cache_policy = CachePolicy(namespaces, public.prefixes)
    prefix_service = PublicPrefixService(client, public, namespaces)
    # A restarted core has lost its pinned public blocks: prefill them again
    # (until then readers keep to their private chains, which is safe).
    client.on_restarted = lambda name: prefix_service.prefill_soon()

    def generation(model: type, handler: Callable[..., Awaitable[Response]]):
        async def endpoint(request: Request) -> Response:
            arrival = time.monotonic()
            # The body is read before the disconnect watcher starts: both
            # read from receive(), and the watcher must not eat body chunks.
            req = await read_request(request, model, config.max_request_body_bytes)
            request_id = client_request_id(request.headers)
            current_cache_salt.set(getattr(req, "cache_salt", None))  # narrows the tenant's namespace
            return await run_until_disconnected(request, handler(ctx, req, arrival, request_id))
        return endpoint

    def utility(model: type, handler: Callable[[ServingContext, Any], Awaitable[Response]]):
        async def endpoint(request: Request) -> Response:
            return await handler(ctx, await read_request(request, model, config.max_request_body_bytes))
        return endpoint

    async def health(request: Request) -> Response:
        state = client.health()
        if state["status"] in ("ok", "degraded"):  # "degraded": some core is down, every role still has one
            return JSONResponse(state)
        code = "engine_restarting" if state["status"] == "restarting" else "engine_unavailable"
        return error_response(503, state["reason"], code=code)

    async def models(request: Request) -> Response:
        cards = [ModelCard(id=name, created=now_s(), root=config.model_path or name,
                           max_model_len=client.max_model_len) for name in config.served_model_names]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    async def kv_stats(request: Request) -> Response:
        """Prefix-cache counters of the caller's tenant (every tenant's and
        the public pool's for an admin)."""
        tenant = current_tenant.get()
        stats = client.stats
        by_tenant, public = namespaces.split_stats(stats.prefix_by_owner)
        add_tier_hit_rates(by_tenant, stats.kv_tier_tenants)
        if not tenant.admin:
            return JSONResponse({"object": "kv.stats",
                                 "tenants": {tenant.name: by_tenant.get(tenant.name, empty_tenant_stats())}})
        return JSONResponse({"object": "kv.stats", "tenants": by_tenant, "public": public})

    async def purge_tenant(request: Request) -> Response:
        """Admin: drop a tenant's unused cached blocks from the device pool now."""
        if not current_tenant.get().admin:
            raise APIError(403, "this API key may not purge tenants", code="permission_denied")
        name = request.path_params["tenant"]
        known = keys.tenant_names() if keys is not None else {current_tenant.get().name}
        if name not in known and name not in client.stats.prefix_by_owner:
            raise APIError(404, f"unknown tenant {name!r}", code="tenant_not_found", param="tenant")
        try:
            purged = await client.purge_tenant(name)
        except TimeoutError:
            raise APIError(503, "the engine core did not answer the purge in time", code="engine_busy") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None
        return JSONResponse({"object": "kv.tenant.purged", "tenant": name, "purged_blocks": purged})

    def require_admin() -> None:
        if keys is not None and not current_tenant.get().admin:
            raise APIError(403, "this API key may not manage workers", code="permission_denied")

    async def list_workers(request: Request) -> Response:
        require_admin()
        return JSONResponse({"object": "list", "data": client.describe_workers()})

    async def join_worker(request: Request) -> Response:
        """{"address": "tcp://HOST:PORT", "role": "engine"}: connect to a running core."""
        require_admin()
        item = _worker_body(await read_body(request, config.max_request_body_bytes))
        address, role = item.address, item.role
        try:
            worker = await client.join_worker(address, role)
        except ValueError as exc:
            raise bad_request(str(exc), "role" if str(exc).startswith("role") else "address") from None
        except EngineCoreStartError as exc:
            raise APIError(502, f"could not join the worker at {address!r}: {exc}", "address",
                           code="worker_unreachable") from None
        return JSONResponse(worker.describe(client.index.num_blocks(worker.name)))

    async def remove_worker(request: Request) -> Response:
        """DELETE /v1/admin/workers/{name or address}, or DELETE with {"address": ...}."""
        require_admin()
        target = request.path_params.get("name")
        if target is None:
            target = _worker_body(await read_body(request, config.max_request_body_bytes)).address
        try:
            worker = await client.leave_worker(str(target))
        except KeyError:
            raise APIError(404, f"no worker named or at {target!r}", "address", code="not_found") from None
        except ValueError as exc:
            raise APIError(409, str(exc), "address", code="last_worker") from None
        return JSONResponse({"name": worker.name, "address": worker.address, "removed": True})

    def reload_keys() -> None:
        try:
            keys.reload()
            logger.warning("reloaded %d API keys from %s", keys.num_keys, keys.path)
        except ValueError as exc:
            logger.error("kept the previous API keys: %s", exc)

    async def prometheus(request: Request) -> Response:
        # Checked here, not by the middleware: open without keys (and with
        # --metrics-public), while per-tenant series are an admin's only.
        admin = metrics_access(keys, request.scope["headers"], public=config.api.metrics_public)
        return Response(metrics.render(include_tenants=admin), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()
        # The file's prefixes are computed before the server is ready: their
        # declarations are the only writers of public blocks.
        if num := await prefix_service.prefill_all():
            logger.info("prefilled %d public prefixes", num)
        if keys is not None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_keys)
        try:
            yield
        finally:
            if keys is not None:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            # uvicorn has stopped accepting and drained (or cancelled) the
            # in-flight requests by now; abort anything left and stop the core.
            await client.shutdown(config.engine_stop_timeout_s)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", generation(CompletionRequest, create_completion), methods=["POST"]),
        Route("/v1/chat/completions", generation(ChatCompletionRequest, create_chat_completion), methods=["POST"]),
        Route("/v1/responses", generation(ResponsesRequest, partial(create_response, store)),
              methods=["POST"]),
        Route("/v1/responses/{response_id}", partial(get_response, store), methods=["GET"]),
        Route("/v1/responses/{response_id}", partial(delete_response, store), methods=["DELETE"]),
        *public_prefix_routes(prefix_service, config.max_request_body_bytes),
        Route("/v1/kv/stats", kv_stats, methods=["GET"]),
        Route("/v1/kv/tenants/{tenant}", purge_tenant, methods=["DELETE"]),
        Route("/v1/admin/workers", list_workers, methods=["GET"]),
        Route("/v1/admin/workers", join_worker, methods=["POST"]),
        Route("/v1/admin/workers", remove_worker, methods=["DELETE"]),
        Route("/v1/admin/workers/{name:path}", remove_worker, methods=["DELETE"]),
        Route("/tokenize", utility(TokenizeRequest, tokenize_endpoint), methods=["POST"]),
        Route("/detokenize", utility(DetokenizeRequest, detokenize_endpoint), methods=["POST"]),
    ]
    middleware = [Middleware(RequestLimitsMiddleware, max_header_count=config.api.max_header_count,
                             max_header_bytes=config.api.max_header_bytes, body_read_timeout_s=config.api.body_read_timeout_s)]
    if config.api.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=config.api.allowed_origins,
                                     allow_methods=["*"], allow_headers=["*"], expose_headers=["X-Request-Id"]))
    # After CORS: a browser's preflight carries no key and must still pass.
    middleware.append(Middleware(AuthMiddleware, keys=keys))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    app.state.client = client
    app.state.metrics = metrics
    app.state.responses = store
    return app
