"""Run the app under uvicorn in the front end process ("kvferry: api-server"),
with the engine core in its own process ("kvferry: engine-0"); announce
readiness, and make a graceful shutdown (SIGTERM) exit 0.

Start-up order: validate the flags, bind the listening socket (a bad or
busy port is reported before any model loads), spawn the core, import the
web side (serve/http_server.py: uvicorn, starlette, the routes) while the
core loads the model, wait for the core's handshake, then serve on the
bound socket. This module itself imports none of the web side.

``--port 0`` binds a free port; the ready line names the real one:
``kvferry serve: ready on http://127.0.0.1:PORT (model NAME, max_model_len N)``.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import setproctitle

from kvferry import peer_auth
from kvferry.config import EngineArgs
from kvferry.engine.core_client import EngineCoreStartError
from kvferry.fleet.placement import RayPlacement, placement_from_args
from kvferry.gc_heap import freeze_startup_heap
from kvferry.kvstore.pool_address import PoolAddress, is_auto
from kvferry.kvstore.secret_file import ensure_secret_file, server_cache_secret, tier_secret_path
from kvferry.router.config import router_config_from
from kvferry.router.core_spawn import spawn_cores, stop_processes
from kvferry.serve.api_flags import ApiOptions
from kvferry.serve.afd import start_ray_ffn, stop_ray_ffn
from kvferry.serve.server_config import ServerConfig
from kvferry.extras import require
from kvferry.structured.spec import import_backend_in_background

if TYPE_CHECKING:
    from kvferry.kvstore.supervisor import StoreSupervisor
    from kvferry.router.config import RouterConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default model

logger = logging.getLogger(__name__)


def default_model_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model.rstrip("/"))
    if not path.exists() and _is_hub_id(model):
        return model  # a Hugging Face id is served under the id itself, as vLLM does
    return path.stem if path.suffix == ".gguf" else path.name


def _is_hub_id(model: str) -> bool:
    """``org/name``: one slash, neither part a path component of its own."""
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def run_server(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    setproctitle.setproctitle("kvferry: api-server")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        keep_tier_secret(args, engine_args)
        # Before any store or core starts (they inherit it): the secret their
        # socket tokens derive from, the cache secret's when one is given, so
        # that a store or cores started apart with the same file accept ours.
        peer_auth.socket_secret(getattr(args, "cache_secret_file", None))
        config = ServerConfig(
            served_model_names=args.served_model_name or [default_model_name(args.model)],
            model_path=args.model,
            max_request_body_bytes=args.max_request_body_bytes,
            api=ApiOptions.from_args(args),
        )
        router = router_config_from(args)
        placement = placement_from_args(args)
        if placement is None and engine_args.kv_cluster:
            PoolAddress.parse(engine_args.kv_cluster)  # "auto" needs --ray: a ValueError saying so
        slo_s = {name: ms / 1000.0 for name, ms in (("ttft", router.slo.ttft_slo_ms), ("tpot", router.slo.tpot_slo_ms))
                 if ms is not None}
        autoscaler = None
        if args.autoscale is not None:  # the planner under it (numpy, the simulator): only when asked for
            from kvferry.autoscale.policy import autoscaler_from_args

            autoscaler = autoscaler_from_args(args, router.mode, slo_s, engine_args)
        if not getattr(args, "log_stats_interval_s", 0.0) >= 0:
            raise ValueError(f"log_stats_interval_s must be >= 0 (0: off), got {args.log_stats_interval_s}")
        listen = bind_socket(args.host, args.port)
    except (ValueError, OSError) as exc:
        print(f"kvferry serve: error: {exc}", file=sys.stderr)
        return 2
    if (line := engine_args.default_speculation_line()) is not None:
        logger.info("%s", line)  # once here, not once per core; after the flags' checks (one-line errors)
    try:
        # With --ray the cores' nodes get a store each instead (start_node_stores).
        store, engine_args = start_kv_store(args, engine_args, router) if placement is None else (None, engine_args)
    except (ValueError, RuntimeError) as exc:
        listen.close()
        print(f"kvferry serve: error: {exc}", file=sys.stderr)
        return 2
    ray_cores = node_stores = cluster_master = grammar_import = None
    try:
        try:
            ray_cores = connect_ray(placement, router.engine_restarts)
            engine_args = start_ray_ffn(args, engine_args)  # --mode afd: FFN workers as Ray actors (serve/afd.py)
            cluster_master = start_cluster_master(placement, engine_args, router.engine_restarts, args.log_level)
            if cluster_master is not None:
                engine_args = dataclasses.replace(engine_args, kv_cluster=cluster_master.url)
            node_stores = start_node_stores(placement, args, engine_args, router.engine_restarts)
            # The local cores start loading the model now; this process's own
            # imports below (the web side, xgrammar) run while they do, not
            # before they start. Every flag was checked above.
            spawned = None if ray_cores is not None else spawn_cores(engine_args, router, args.check_kv_integrity,
                                                                     args.log_level)
            try:
                # Joined before serving, so that no import runs beside
                # uvicorn's own and the start-up heap frozen there holds its objects.
                grammar_import = import_backend_in_background()
                # uvicorn, starlette, the routes: see its docstring.
                from kvferry.serve.http_server import AsyncEngineClient, serve_http
                from kvferry.engine.input_processor import prefetch_tokenizer  # the tokenizer's imports: as above

                if spawned:
                    prefetch_tokenizer(engine_args.model)  # read while the cores load (engine/input_processor.py)

                # The imports' objects exempted from collection now, while
                # the cores load: the freeze once serving starts then walks
                # only what came after (the tokenizer, the app), not ~70k
                # objects (~45 ms after the cores are ready).
                freeze_startup_heap("front end (its modules)")
            except BaseException:
                stop_processes(spawned or [])
                raise
            client = AsyncEngineClient.launch(
                engine_args, check_integrity_when_idle=args.check_kv_integrity,
                ready_timeout_s=args.engine_start_timeout, log_level=args.log_level, router=router, ray=ray_cores,
                spawned=spawned)
        except (ValueError, OSError, EngineCoreStartError) as exc:
            listen.close()
            print(f"kvferry serve: error: {exc}", file=sys.stderr, flush=True)
            if grammar_import is not None:
                grammar_import.join()  # cut off mid-import by the exit, the daemon thread would print a traceback
            return 2
        grammar_import.join()
        client.ffn_pool = getattr(args, "ffn_pool", None)  # --mode afd: kvferry scale --ffn (routes/scale.py)
        try:
            return serve_http(args, config, client, listen, store, autoscaler)
        finally:
            client.kill_processes()  # start-up failed inside uvicorn (after a clean stop: no-op)
    finally:
        if node_stores is not None:
            node_stores.close()  # after the cores (their clients), before the driver leaves the cluster
        if cluster_master is not None:
            cluster_master.close()  # after the node stores (the pool's clients)
        if ray_cores is not None:
            stop_ray_ffn(args)
            ray_cores.close()
        if store is not None:
            store.stop()  # after the cores; removes its socket and arena whatever became of it


def connect_ray(placement: RayPlacement | None, max_restarts: int):
    """``--ray``: join the cluster, whose actors will be the engine cores
    (None without it: ray is never imported). Raises ConnectionError."""
    if placement is None:
        return None
    require("ray", "ray", "--ray")
    from kvferry.fleet.ray_cores import RayCores  # optional dependency: imports ray

    return RayCores.connect(placement, max_restarts)


def start_cluster_master(placement: RayPlacement | None, engine_args: EngineArgs, max_restarts: int,
                         log_level: str):
    """``--ray`` with ``--kv-cluster auto``: the cluster KV pool's
    mooncake_master, started on the Ray head node (kvferry.fleet.cluster_master);
    the node stores get its URL. None when not asked for."""
    if placement is None or not engine_args.kv_cluster:
        return None

    if not is_auto(engine_args.kv_cluster):
        return None
    from kvferry.fleet.cluster_master import ClusterMaster  # optional dependency: imports ray

    return ClusterMaster.start(engine_args.kv_cluster, max_restarts, log_level)


def start_node_stores(placement: RayPlacement | None, args: argparse.Namespace, engine_args: EngineArgs,
                      max_restarts: int):
    """``--ray`` with ``--kv-dram-gb`` (or ``--kv-cluster``) and no
    ``--kv-store``: the server's registry of node KV stores, from which each
    core gets its node's store, started on first use with the server's tier
    flags, key file and one cache secret for all of them (its file's, given
    or kept beside a persistent tier, else a fresh one: a secret per node
    would share nothing through the pool or Redis) (kvferry.fleet.node_store).
    None when there is none to start."""
    if placement is None or not engine_args.kv_dram_gb or engine_args.kv_store:
        return None
    from kvferry.fleet.node_store import NodeStores, NodeStoreSpec, server_env  # optional: imports ray

    spec = NodeStoreSpec(engine_args.create_engine_config().kv_tiers, getattr(args, "api_keys", None),
                         server_cache_secret(getattr(args, "cache_secret_file", None)), server_env(), max_restarts,
                         args.log_level)
    return NodeStores.start(spec)


def keep_tier_secret(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    """A store this server starts with a persistent tier (``--kv-disk``,
    ``--kv-remote``) and no ``--cache-secret-file``: use the secret kept
    beside the tier, generated at its first start. A fresh secret per start
    would change every tenant's namespace, so no block written before a
    restart would ever be found again. The front end (namespaces) and the
    store (keys at rest) both read it."""
    if getattr(args, "cache_secret_file", None) is not None or not engine_args.kv_dram_gb or engine_args.kv_store:
        return
    if engine_args.kv_cluster.startswith("auto") and not engine_args.kv_disk and not engine_args.kv_remote:
        return  # --kv-cluster auto: a pool that lives with this server, nothing of it survives a restart

    path = tier_secret_path(engine_args.kv_disk, engine_args.kv_remote or engine_args.kv_cluster)
    if path is None:
        return
    path, created = ensure_secret_file(path)
    logger.warning("no --cache-secret-file: %s the cache secret in %s, so the KV tiers survive a restart",
                   "generated" if created else "using", path)
    args.cache_secret_file = str(path)


def start_kv_store(args: argparse.Namespace, engine_args: EngineArgs, router: RouterConfig):
    """``--kv-dram-gb`` without ``--kv-store``: start the node's KV store
    ("kvferry: kvstore", with the disk and remote tiers asked for), restarted
    when it dies within the cores' restart budget, and hand its address to
    the engine core. Returns its ``StoreSupervisor`` (None when there is
    none to start) and the engine args to launch with."""
    if not engine_args.kv_dram_gb or engine_args.kv_store:
        return None, engine_args
    from kvferry.kvstore.supervisor import StoreSupervisor  # the store's client: numpy, before the core's spawn

    store = StoreSupervisor(
        engine_args.create_engine_config().kv_tiers, max_restarts=router.engine_restarts,
        window_s=router.engine_restart_window_s, api_keys=getattr(args, "api_keys", None),
        cache_secret_file=getattr(args, "cache_secret_file", None))
    logger.info("KV store started at %s (%.2f GiB DRAM)", store.address, engine_args.kv_dram_gb)
    return store, dataclasses.replace(engine_args, kv_store=store.address)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so that a busy port fails fast.
    Raises OSError naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named, not 0: asyncio sets TCP_NODELAY only on connections whose
    # socket says IPPROTO_TCP. Without it a non-streamed response (headers,
    # then body) waited for the client's delayed ACK: 60 ms for a one-token
    # completion on a kept-alive connection, against 20 with it.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
