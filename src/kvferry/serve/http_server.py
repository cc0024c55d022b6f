"""The HTTP side of ``kvferry serve``, once its engine cores are up: the
app under uvicorn (``serve_http``), the ready line, the bounded graceful
drain. Imported by ``serve/server.py`` only after the cores are spawned:
uvicorn, starlette and the front end's modules (~0.5 s on a slow CPU) then
load while the cores load the model, not before they start.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import prometheus_client
import uvicorn

from kvferry.autoscale.window import window_from_args

from kvferry.gc_heap import freeze_startup_heap
from kvferry.serve.access_log import quiet_probes
from kvferry.serve.autoscaling import AutoscaleService
from kvferry.serve.api_flags import uvicorn_options
from kvferry.serve.app import build_app
from kvferry.serve.engine_client import AsyncEngineClient
from kvferry.serve.server_config import ServerConfig
from kvferry.serve.stats_logger import StatsLogger
from kvferry.serve.vllm_flags import set_uvicorn_log_level, uvicorn_log_level

if TYPE_CHECKING:
    from kvferry.kvstore.supervisor import StoreSupervisor
    from kvferry.autoscale.policy import Autoscaler

READY_PREFIX = "kvferry serve: ready on "
# uvicorn's own drain limit, past ours: it cancels tasks, cutting connections.
_BACKSTOP_S = 5.0
# The exit status once an engine core died past --engine-restarts: not 0
# (a supervisor must restart the server), not 1 or 2 (start-up failures).
EXIT_ENGINE_FAILED = 3

# Its lines keep the name they had when this was part of serve/server.py (operators grep for it).
logger = logging.getLogger("kvferry.serve.server")


def serve_http(args: argparse.Namespace, config: ServerConfig, client: AsyncEngineClient, listen: socket.socket,
               store: StoreSupervisor | None = None, autoscaler: Autoscaler | None = None) -> int:
    """Serve until shutdown on ``listen``, the cores up; the exit status."""
    # No *_created series: vLLM-style dashboards do not use them. Before the app's metrics exist.
    prometheus_client.disable_created_metrics()
    if autoscaler is not None:
        client.autoscaler = AutoscaleService(autoscaler, window_from_args(args), client)
    app = build_app(client, config)
    if store is not None:  # /health and /metrics say how the node's KV store is
        app.state.kv_store = store
        app.state.metrics.kv_store_health = lambda: store.health
    uv_config = uvicorn.Config(
        app, log_level=uvicorn_log_level(args), lifespan="on",
        access_log=not args.disable_uvicorn_access_log,
        # A backstop only: _Server ends the requests itself at shutdown_timeout.
        timeout_graceful_shutdown=args.shutdown_timeout + _BACKSTOP_S,
        **uvicorn_options(config.api),
    )
    set_uvicorn_log_level(args)  # after uvicorn.Config, which configures its loggers
    quiet_probes()
    interval_s = getattr(args, "log_stats_interval_s", 0.0)
    stats_logger = None
    if interval_s > 0:
        stats_logger = StatsLogger(interval_s, app.state.metrics.token_totals, lambda: client.stats)
    model = f"model {config.served_model_names[0]}, max_model_len {client.max_model_len}"
    server = _Server(uv_config, lambda url: print(f"{READY_PREFIX}{url} ({model})", flush=True),
                     client, args.shutdown_timeout, stats_logger)
    # A core dead past its restart budget: stop serving (the same graceful
    # path as SIGTERM, so the other cores are stopped too) and exit non-zero.
    client.on_fatal = lambda reason: setattr(server, "should_exit", True)
    _make_signal_reraise_harmless()
    server.run(sockets=[listen])
    if client.fatal_error is not None:
        print(f"kvferry serve: error: {client.fatal_error}", file=sys.stderr, flush=True)
        return EXIT_ENGINE_FAILED
    return 0 if server.started else 1


class _Server(uvicorn.Server):
    """uvicorn.Server that announces the bound address once it listens, and
    bounds the graceful drain: at ``drain_timeout_s`` after shutdown begins,
    the requests still running are aborted *through the app*, so each gets
    a proper end (a 503, or an error event and ``[DONE]`` on a stream)
    instead of uvicorn cancelling its task and cutting the connection."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str], None],
                 client: AsyncEngineClient, drain_timeout_s: float, stats_logger: StatsLogger | None = None) -> None:
        super().__init__(config)
        self.on_ready = on_ready
        self.client = client
        self.drain_timeout_s = drain_timeout_s
        self.stats_logger = stats_logger
        self._stats_task: asyncio.Task | None = None

    async def shutdown(self, sockets=None) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
        # A scale in flight (waiting for room on a Ray cluster, say) ends now: its POST must not hold the drain.
        self.client.scaler.stop("the server is shutting down")
        deadline = asyncio.ensure_future(self._abort_after_deadline())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _abort_after_deadline(self) -> None:
        await asyncio.sleep(self.drain_timeout_s)
        n = self.client.abort_all("the server is shutting down; the request was aborted")
        if n:
            logger.warning("graceful shutdown timed out after %.1f s: aborted %d request(s)", self.drain_timeout_s, n)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        freeze_startup_heap("front end")  # no full-heap GC pauses between arrival and hand-off
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.on_ready(f"http://{host}:{port}")
        if self.started and self.stats_logger is not None:
            self._stats_task = asyncio.ensure_future(self.stats_logger.run())


def _make_signal_reraise_harmless() -> None:
    """uvicorn handles SIGTERM / SIGINT itself (stop accepting, drain the
    in-flight requests, run the lifespan shutdown), then re-raises the signal
    under the handler it found installed. With the default handlers a clean
    shutdown would end as status 143 (or a KeyboardInterrupt traceback);
    with these no-ops it exits 0."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
