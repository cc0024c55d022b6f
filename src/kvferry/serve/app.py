"""The ASGI app: assembles the routes, middleware, error handlers and
lifespan (engine loop start / stop).

    build_app(client, ServerConfig(...)) -> Starlette

The routes live in ``serve/routes/`` (one module per group) and
``serve/kv_routes.py``; each takes its dependencies as arguments. The app
uses an AsyncEngineClient whose core is up (handshake done); its lifespan
starts the client's output handling on the server's event loop and stops
the core after uvicorn has drained the in-flight requests (graceful
shutdown).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from kvferry.serve.api_flags import ApiOptions
from kvferry.serve.auth import AuthMiddleware
from kvferry.serve.engine_client import AsyncEngineClient
from kvferry.serve.errors import EXCEPTION_HANDLERS
from kvferry.serve.http_limits import RequestLimitsMiddleware
from kvferry.serve.kv_routes import PublicPrefixService, kv_tenant_routes, public_prefix_routes
from kvferry.serve.logprobs import TokenStrings
from kvferry.serve.metrics import PUBLIC_POOL_LABEL, ServerMetrics, TenantLabels
from kvferry.serve.public_prefixes import CachePolicy, PrefixLimits, PublicPrefixes, PublicPrefixRegistry
from kvferry.serve.responses import ResponseStore
from kvferry.serve.server_config import ServerConfig
from kvferry.serve.routes.embeddings import embedding_routes
from kvferry.serve.routes.health import health_routes
from kvferry.serve.routes.models import model_routes, tokenize_routes
from kvferry.serve.routes.ollama import ollama_routes
from kvferry.serve.routes.openai import generation_routes
from kvferry.serve.request_stream import ObserverGroup
from kvferry.serve.routes.scale import scale_routes
from kvferry.serve.routes.workers import worker_routes
from kvferry.serve.serving import ServingContext
from kvferry.serve.tenants import ApiKeys, CacheNamespaces

logger = logging.getLogger(__name__)


def build_app(client: AsyncEngineClient, config: ServerConfig) -> Starlette:
    api = config.api
    namespaces = CacheNamespaces.from_file(api.cache_secret_file)
    tenant_labels = TenantLabels(api.metrics_max_tenants) if api.metrics_tenant_labels else None
    metrics = ServerMetrics(config.served_model_names[0], lambda: client.stats, tenant_labels,
                            owner_label=lambda owner: PUBLIC_POOL_LABEL if owner == namespaces.public else owner,
                            prefix=api.metrics_prefix, max_model_len=client.max_model_len)
    # The autoscaler's window (--autoscale) hears every request too.
    client.observer = metrics if client.autoscaler is None else ObserverGroup(metrics, client.autoscaler)
    store = ResponseStore(api.responses_store_size, api.responses_store_ttl_s)
    keys = ApiKeys(api.api_keys_file, api.plain_api_keys) if api.api_keys_file or api.plain_api_keys else None
    public = _public_prefixes(client, api)
    ctx = ServingContext(client, list(config.served_model_names), TokenStrings(client.tokenizer), api,
                         cache_policy=CachePolicy(namespaces, public.prefixes))
    prefix_service = PublicPrefixService(client, public, namespaces)
    # A restarted core has lost its pinned public blocks: prefill them again
    # (until then readers keep to their private chains, which is safe).
    client.on_restarted = lambda name: prefix_service.prefill_soon()

    max_body = config.max_request_body_bytes
    routes = [
        *health_routes(client, metrics, keys, api.metrics_public),
        *model_routes(ctx, config.model_path),
        *generation_routes(ctx, store, max_body),
        *public_prefix_routes(prefix_service, max_body),
        *kv_tenant_routes(client, namespaces, keys),
        *worker_routes(client, keys, max_body),
        *scale_routes(client, keys, max_body),
        *tokenize_routes(ctx, max_body),
        *embedding_routes(ctx, max_body),
        *ollama_routes(ctx, config.model_path, max_body),
    ]
    middleware = [Middleware(RequestLimitsMiddleware, max_header_count=api.max_header_count,
                             max_header_bytes=api.max_header_bytes, body_read_timeout_s=api.body_read_timeout_s)]
    if api.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=api.allowed_origins,
                                     allow_methods=["*"], allow_headers=["*"], expose_headers=["X-Request-Id"]))
    # After CORS: a browser's preflight carries no key and must still pass.
    middleware.append(Middleware(AuthMiddleware, keys=keys))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS,
                    lifespan=_lifespan(client, prefix_service, keys, config.engine_stop_timeout_s))
    app.state.client = client
    app.state.metrics = metrics
    app.state.responses = store
    return app


def _public_prefixes(client: AsyncEngineClient, api: ApiOptions) -> PublicPrefixRegistry:
    """The declared public prefixes, with the operator's file loaded."""
    ready = client.ready
    limits = PrefixLimits(
        max_tokens_per_prefix=client.max_model_len - 1,
        # Public blocks stay pinned in the device pool while declared: at
        # most a quarter of it, so tenants always keep the rest.
        max_total_tokens=ready.num_kv_blocks * ready.block_size // 4,
        max_prefixes_per_tenant=api.max_public_prefixes_per_tenant,
        max_tokens_per_tenant=api.max_public_prefix_tokens_per_tenant)
    public = PublicPrefixRegistry(PublicPrefixes(ready.block_size, limits=limits), client.tokenizer, api.chat_template,
                                  client.tokenizer.max_prompt_chars(client.max_model_len))
    if api.public_prefixes_file:
        public.load_file(api.public_prefixes_file)
    return public


def _lifespan(client: AsyncEngineClient, prefix_service: PublicPrefixService, keys: ApiKeys | None,
              engine_stop_timeout_s: float) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    def reload_keys() -> None:
        try:
            keys.reload()
            logger.warning("reloaded %d API keys from %s", keys.num_keys, keys.path)
        except ValueError as exc:
            logger.error("kept the previous API keys: %s", exc)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()
        # The file's prefixes are computed before the server is ready: their
        # declarations are the only writers of public blocks.
        if num := await prefix_service.prefill_all():
            logger.info("prefilled %d public prefixes", num)
        if keys is not None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_keys)
        if client.autoscaler is not None:
            await client.autoscaler.start()
        try:
            yield
        finally:
            if client.autoscaler is not None:
                await client.autoscaler.stop()
            if keys is not None:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            # uvicorn has stopped accepting and drained (or cancelled) the
            # in-flight requests by now; abort anything left and stop the core.
            await client.shutdown(engine_stop_timeout_s)

    return lifespan
