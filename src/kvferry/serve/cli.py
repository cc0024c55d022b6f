"""``kvferry serve`` arguments. Kept free of heavy imports: the top-level CLI
imports this module for every subcommand; the server itself is imported
only when ``serve`` runs.

    kvferry serve [MODEL | --model MODEL] [--host 127.0.0.1] [--port 8000]
                  [--served-model-name NAME ...] [engine flags] [vLLM's flags]

MODEL is a folder, a .gguf file or a Hugging Face id in the local cache
(``kvferry.model.resolve``); a bad one fails before anything starts, in one
line. vLLM's ``vllm serve`` flags are accepted too (serve/vllm_flags.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvferry.autoscale.flags import add_autoscale_args  # light: the planner is policy.py's
from kvferry.config import EngineArgs
from kvferry.engine.fast_exit import end_without_teardown

from kvferry.serve.afd import add_afd_args, afd_folder, apply_afd_args, start_ffn_pool
from kvferry.serve.api_flags import add_api_args
from kvferry.serve.defaults import DEFAULT_MAX_REQUEST_BODY_BYTES
from kvferry.model.resolve import resolve_model  # light: paths and names, no torch
from kvferry.serve.preflight import check_serve_args
from kvferry.serve.vllm_flags import add_vllm_args, apply_vllm_args
from kvferry.serve.vllm_serve_flags import REFUSED



def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {port}")
    return port


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                                   description="Serve a model over the OpenAI API (vllm serve's flags work too).")
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model: a folder, a .gguf file or a Hugging Face id in the local "
                             "cache (default: the embedded SmolLM2-135M-Instruct)")
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000, help="0: pick a free port (named in the ready line)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients send as 'model' (default: the model folder / file name)")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES)
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--log-stats-interval-s", type=float, default=10.0,
                        help="seconds between engine stats lines in the log (throughput, queue, KV cache, "
                             "hit rates), logged only while busy; 0: off")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    parser.add_argument("--engine-start-timeout", type=float, default=600.0,
                        help="seconds the engine core gets to load the model and report ready")
    parser.add_argument("--check-kv-integrity", action="store_true",
                        help="check the KV bookkeeping whenever the engine goes idle (debugging, tests)")
    parser.add_argument("--metrics-prefix", default="both", choices=["vllm", "kvferry", "both"],
                        help="/metrics names: vLLM's (vllm:..., its labels and buckets, for its dashboards), "
                             "kvferry's own (kvferry:...), or both (default)")
    add_api_args(parser)
    add_router_args(parser)
    add_ray_args(parser)
    add_autoscale_args(parser)
    add_vllm_args(parser)
    parser.refused = REFUSED  # vLLM's flags kvferry does not take: the error says why
    parser.set_defaults(func=_run, subparser=parser, before_engine_args=_merge_model_args)
    return parser


def _merge_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``kvferry serve MODEL`` is ``--model MODEL`` (vLLM's form); both, differing: a usage error."""
    positional = args.model_positional
    if positional is not None and args.model is not None and positional != args.model:
        parser.error(f"the model is given twice: {positional!r} and --model {args.model!r}; give one")
    if positional is not None:
        args.model = positional


def check_model(model: str | None) -> None:
    """Raise ValueError (one line) unless ``model`` names a model on this
    machine; before any process starts, so a typo fails at once."""
    if model is None:
        return  # the embedded default

    resolve_model(model)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("router (several engine cores behind one front end)")
    group.add_argument("--mode", default="colocated", choices=["colocated", "disagg", "afd"],
                       help="colocated: every core runs both phases (chunked prefill); disagg: prefill and decode "
                            "pools; afd: attention cores and FFN workers apart (--attention N --ffn M)")
    add_afd_args(group)
    group.add_argument("--data-parallel-size", type=int, default=1,
                       help="engine cores to start in colocated mode (0 with --worker: joined cores only)")
    group.add_argument("--prefill", type=int, default=1, help="prefill cores to start in disagg mode")
    group.add_argument("--decode", type=int, default=1, help="decode cores to start in disagg mode")
    group.add_argument("--prefill-cpus", default=None, help='CPUs of the prefill cores in disagg mode, e.g. "0"')
    group.add_argument("--decode-cpus", default=None, help='CPUs of the decode cores in disagg mode, e.g. "1"')
    group.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                       help="disagg mode: tensor-parallel ranks of each prefill core (default: --tensor-parallel-size); "
                            "the KV transfer reshards heads to the decode cores' ranks (docs/parallelism.md)")
    group.add_argument("--decode-tp", type=int, default=None, metavar="N",
                       help="disagg mode: tensor-parallel ranks of each decode core (default: --tensor-parallel-size)")
    group.add_argument("--prefill-pp", type=int, default=None, metavar="N",
                       help="disagg mode: pipeline stages of each prefill core (default: --pipeline-parallel-size); "
                            "each stage sends the layers it holds to the decode stage that holds them")
    group.add_argument("--decode-pp", type=int, default=None, metavar="N",
                       help="disagg mode: pipeline stages of each decode core (default: --pipeline-parallel-size)")
    group.add_argument("--worker", action="append", default=[], metavar="ADDRESS",
                       help="join a running `kvferry engine-core --address ADDRESS` (repeatable; disagg: prefill=ADDRESS or decode=ADDRESS)")
    group.add_argument("--engine-cpus", action="append", default=[], metavar="CPUS",
                       help='CPUs of each started core, e.g. "0" then "1" (repeat per core, or once for all)')
    group.add_argument("--ttft-slo-ms", type=float, default=None,
                       help="refuse (429, Retry-After) a request whose predicted time to first token exceeds this")
    group.add_argument("--tpot-slo-ms", type=float, default=None,
                       help="refuse (429, Retry-After) a request whose predicted time per output token exceeds this")
    group.add_argument("--health-check-interval", type=float, default=1.0,
                       help="seconds between hellos to each core")
    group.add_argument("--health-timeout", type=float, default=30.0,
                       help="a joined core silent this long counts as dead (started cores: when their process exits, "
                            "or see --engine-heartbeat-timeout)")
    group.add_argument("--engine-heartbeat-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="a started core that answers no hello for this long counts as hung: /health reports it, "
                            "its requests end with an error, and it is killed and restarted (0: off)")
    group.add_argument("--engine-restarts", type=int, default=3, metavar="N",
                       help="a started core that dies is restarted (backoff 0.5 s doubling to 30 s), at most N times "
                            "within --engine-restart-window; one more death exits the server with code 3. The node "
                            "KV store this server starts (--kv-dram-gb) gets the same budget, counted apart: one "
                            "more death leaves it down and the server serves on without the KV tiers")
    group.add_argument("--engine-restart-window", type=float, default=600.0, metavar="SECONDS",
                       help="the window --engine-restarts counts in (the cores' restarts, and the node KV store's "
                            "apart)")
    group.add_argument("--engine-restart-wait", type=float, default=60.0, metavar="SECONDS",
                       help="a request that arrives while every core of its role restarts waits this long for one, "
                            "then gets 503 engine_restarting (0: at once)")


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Ray cluster (the engine cores as Ray actors, placed by resources)")
    group.add_argument("--ray", default=None, metavar="ADDRESS",
                       help="start the engine cores as actors on this running Ray cluster: 'auto' or the head's "
                            "HOST:PORT (the front end and router stay in this process; default: local processes)")
    for role, what in (("engine", "colocated mode"), ("prefill", "disagg mode"), ("decode", "disagg mode")):
        group.add_argument(f"--ray-{role}-resources", default='{"CPU": 1}', metavar="JSON",
                           help=f'Ray resources of each {role} core\'s actor ({what}), e.g. \'{{"GPU": 1}}\' or a '
                                f'custom node resource \'{{"{role[0]}node": 1}}\'')
    group.add_argument("--ray-rank-placement", choices=("pack", "spread"), default="pack",
                       help="where a -tp/-pp core's ranks go: one Ray placement group per core, packed on one node "
                            "(shared memory between its ranks) or spread over the nodes (tcp with CURVE between "
                            "them); each rank asks for its role's --ray-*-resources")
    group.add_argument("--scale-timeout-s", type=float, default=60.0, metavar="SECONDS",
                       help="a scale (kvferry scale, POST /v1/admin/scale, --autoscale) whose new cores the Ray "
                            "cluster cannot all place within this fails, naming the resources missing; the pools "
                            "stay as they were")


def _starts_local_cores(args: argparse.Namespace) -> bool:
    if args.mode == "disagg":
        return args.prefill + args.decode > 0
    return args.data_parallel_size > 0


def _run(args: argparse.Namespace) -> int:
    try:
        local_cores = _starts_local_cores(args)
        if local_cores:  # joined cores (--worker) load the model on their own machines
            check_model(args.model)
        engine_args = apply_afd_args(args, apply_vllm_args(args, args.engine_args))  # --mode afd: N cores
        # What would otherwise fail only in a started process, after the model loads.
        check_serve_args(args, engine_args, local_cores)
    except ValueError as exc:
        print(f"kvferry serve: error: {exc}", file=sys.stderr)
        return 2
    # Before the server's modules are imported, so that every atexit
    # callback they register (multiprocessing's, finalizers) still runs.
    exit_code = end_without_teardown() if _owns_the_process() else None
    from kvferry.serve.server import run_server  # lazy: the router and the front end (its web side after the spawn)

    engine_args = afd_folder(engine_args)
    pool = start_ffn_pool(args, engine_args)  # --mode afd: the FFN workers, shared by the cores
    args.ffn_pool = pool  # kvferry scale --ffn resizes it (routes/scale.py)
    try:
        code = run_server(args, engine_args)
    finally:
        if pool is not None:
            pool.stop()
    if exit_code is not None:
        exit_code.code = code
    return code


def _owns_the_process() -> bool:
    """This process is ``kvferry serve`` itself (``python -m kvferry.cli``
    or the ``kvferry`` script), not a program that called ``kvferry.cli.main``.
    Only then does it end without the interpreter's teardown (engine/fast_exit.py):
    once the server has stopped its cores and stores, that teardown (every
    module, the web stack, the tokenizer) was 0.2-0.3 s of each stop."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (spec is not None and spec.name == "kvferry.cli") or Path(sys.argv[0]).name == "kvferry"
