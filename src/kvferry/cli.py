"""kvferry command line, eleven commands:

    kvferry serve [MODEL]      OpenAI-compatible HTTP server (vllm serve's flags work too)
    kvferry chat [MODEL]       chat in the terminal with a running server, or one started for it
    kvferry engine-core        an engine core alone, joined by a server's --worker
    kvferry kvstore            the node's KV store service (DRAM arena, cold tiers)
    kvferry scale              grow or shrink a running server's pools of engine cores
    kvferry demo [PROMPT ...]  generate text in-process from the embedded default model
    kvferry bench              load-test an OpenAI-compatible server (bench compare A B: two runs)
    kvferry profile            fit this machine's prefill and decode step times
    kvferry simulate           predict latency and goodput from a profile
    kvferry plan               search prefill/decode instance counts for goodput per GPU
    kvferry train-draft        train a draft head for speculative decoding

``kvferry --version``; ``kvferry COMMAND --help`` lists a command's flags
with their defaults. Engine flags come from EngineArgs (one flag per field),
so every command that builds an engine takes the same options with the same
defaults. Parsers are kvferry.cli_parser.Parser: no abbreviated flags, and
an error is the short usage and one line (an unknown flag names the nearest
supported one).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from kvferry import envs, peer_auth
from kvferry.cli_parser import Parser, VersionAction, nearest_flag_error
from kvferry.config import EngineArgs

# What `kvferry demo` passes to LLM(...): the model and how it runs, not the
# serving-only options (KV store, disaggregation, connectors).
DEMO_ENGINE_FIELDS = ("model", "dtype", "device", "attention_backend", "enforce_eager", "seed", "max_model_len",
                      "kv_cache_memory_gb", "kv_cache_dtype", "speculative")


def engine_args_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineArgs:
    """Validated EngineArgs; a bad value exits with a usage error naming the flag."""
    try:
        return EngineArgs.from_cli_args(args)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def cmd_demo(args: argparse.Namespace) -> int:
    # Lazy: torch and the model (~1.5 s) load only when demo runs.
    from kvferry import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(args.engine_args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    questions = args.prompt or ["What is the capital of France?", "Write a haiku about the sea."]
    for q, out in zip(questions, llm.chat([[{"role": "user", "content": q}] for q in questions], params)):
        print(f"### {q}\n{out.text.strip()}\n")
    return 0


def cmd_engine_core(args: argparse.Namespace) -> int:
    # Lazy: torch and the model (~1.5 s) load only when an engine core runs.
    from kvferry.engine.core_proc import run_from_args

    try:
        # Its front end's, KV store's and KV transfer peers' tokens derive
        # from it: a core started apart (another node) agrees with them
        # through the same --cache-secret-file, and refuses a server without it.
        if args.cache_secret_file is None and envs.socket_secret() is None:
            print("kvferry engine-core: no --cache-secret-file: no server can join this core (a join is refused "
                  "unless the server and the core are given the same --cache-secret-file)", file=sys.stderr)
        peer_auth.socket_secret(args.cache_secret_file)
        # -tp is serve's flag too (there vLLM's, serve/vllm_flags.py): the
        # engine field has no flag of its own, so each command maps it.
        engine_args = dataclasses.replace(args.engine_args, tensor_parallel_size=args.tensor_parallel_size,
                                          pipeline_parallel_size=args.pipeline_parallel_size)
        config = engine_args.create_engine_config()
    except ValueError as exc:
        args.subparser.error(str(exc))
    return run_from_args(args, config)


# Each command's parser module, imported inside its adder: only the command
# that runs is imported (all of them for ``kvferry --help`` or a mistyped
# command). Every process spawned under ``kvferry`` or ``python -m
# kvferry.cli`` (engine cores, rank and stage processes) imports this module
# again as its ``__mp_main__``: with the parser modules at the top, each
# paid ~0.25 CPU-s for parsers it never builds (bench's numpy, scale's
# router, ...). Each parser module is light itself: its command's heavy
# modules (torch, httpx, uvicorn, the simulator) load when the command runs.
def _add_serve(sub) -> None:
    from kvferry.serve.cli import add_serve_parser

    add_serve_parser(sub)


def _add_chat(sub) -> None:
    from kvferry.chat.cli import add_chat_parser

    add_chat_parser(sub)


def _add_kvstore(sub) -> None:
    from kvferry.kvstore.process import add_kvstore_args, run as run_kvstore

    kvstore = sub.add_parser("kvstore", help="the node's KV store service (shared-memory DRAM arena, cold tiers)")
    add_kvstore_args(kvstore)
    kvstore.set_defaults(func=run_kvstore)


def _add_scale(sub) -> None:
    from kvferry.fleet.scale_cli import add_scale_parser

    add_scale_parser(sub)


def _add_bench(sub) -> None:
    from kvferry.bench.cli import add_bench_parsers  # bench, profile

    add_bench_parsers(sub)


def _add_plan(sub) -> None:
    from kvferry.plan.cli import add_plan_parsers  # simulate, plan

    add_plan_parsers(sub)


def _add_train(sub) -> None:
    from kvferry.train.cli import add_train_parser  # train-draft

    add_train_parser(sub)


def _add_demo(sub) -> None:
    demo = sub.add_parser("demo", help="generate text in-process from the embedded default model",
                          description="Generate text in-process (no server): greedy answers to PROMPTs.")
    EngineArgs.add_cli_args(demo, only=DEMO_ENGINE_FIELDS)
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per prompt")
    demo.add_argument("prompt", nargs="*", metavar="PROMPT",
                      help="questions to answer (default: two examples)")
    demo.set_defaults(func=cmd_demo, subparser=demo)


def _add_engine_core(sub) -> None:
    core = sub.add_parser("engine-core", help="an engine core alone, reached by socket address")
    EngineArgs.add_cli_args(core)
    _add_core_args(core)
    core.set_defaults(func=cmd_engine_core, subparser=core)


# (the commands an adder defines, the adder), in --help's order.
_COMMANDS = (
    (("demo",), _add_demo),
    (("engine-core",), _add_engine_core),
    (("serve",), _add_serve),
    (("chat",), _add_chat),
    (("kvstore",), _add_kvstore),
    (("scale",), _add_scale),
    (("bench", "profile"), _add_bench),
    (("simulate", "plan"), _add_plan),
    (("train-draft",), _add_train),
)


def build_parser(command: str | None = None) -> Parser:
    """The whole command line; with ``command`` (one of its commands), only
    that command's parser under the top level (what running it needs)."""
    parser = Parser(prog="kvferry", description="LLM serving with paged KV, prefix sharing, KV tiers, "
                                                "disaggregation and speculative decoding.")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for names, add in _COMMANDS:
        if command is None or command in names:
            add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    known = {name for names, _ in _COMMANDS for name in names}
    # A known command first: only its parser (flags before it are the top
    # level's own, --version or --help, which list every command).
    parser = build_parser(argv[0] if argv and argv[0] in known else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        nearest_flag_error(_command_parser(parser, args), unknown)
    if getattr(args, "subparser", None) is not None:  # commands that build an engine
        if (before := getattr(args, "before_engine_args", None)) is not None:
            before(args.subparser, args)
        args.engine_args = engine_args_from(args.subparser, args)
    return args.func(args)


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)parser the command line chose: the one whose
    flags an unknown argument is compared with."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen is None or chosen not in subs[0].choices:
            return parser
        parser = subs[0].choices[chosen]


def _add_core_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None,
                        help="the core's address, as a router joins it: tcp://HOST:PORT (inputs on PORT, outputs on "
                             "PORT+1) or ipc://PATH (PATH-input, PATH-output)")
    parser.add_argument("--input-address", default=None, help="where to receive inputs (ipc:// or tcp://)")
    parser.add_argument("--output-address", default=None, help="where to send outputs (ipc:// or tcp://)")
    parser.add_argument("--cpus", default=None, help='CPUs this core may run on, e.g. "0", "2-3" (sched_setaffinity)')
    parser.add_argument("--name", default="engine-0", help="process title suffix: kvferry: NAME")
    parser.add_argument("--cache-secret-file", default=None,
                        help="the servers' cache secret: the token a server must present to join this core, and "
                             "this core's KV store and KV transfer tokens, derive from it (give the server that "
                             "joins it, its store and its transfer peers the same file; without it no server can "
                             "join)")
    parser.add_argument("--check-kv-integrity", action="store_true",
                        help="check the KV bookkeeping whenever the engine goes idle (debugging, tests)")
    parser.add_argument("--log-level", default="info", help="the core's logging level")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                        help="rank processes of this core (tensor parallelism, docs/parallelism.md): rank 0 "
                             "schedules and answers the server, ranks 1..N-1 run beside it on this host")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                        help="stage processes of this core, each with its share of the layers (pipeline "
                             "parallelism, docs/parallelism.md): stage 0 schedules and answers the server")


if __name__ == "__main__":
    sys.exit(main())
