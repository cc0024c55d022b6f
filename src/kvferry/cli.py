"""kvferry command line: serve | engine-core | kvstore | demo | bench | profile.

Engine flags come from EngineArgs (one flag per field), so every command
that builds an engine takes the same options with the same defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from kvferry.config import EngineArgs


def engine_args_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineArgs:
    """Validated EngineArgs; a bad value exits with a usage error naming the flag."""
    try:
        return EngineArgs.from_cli_args(args)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def cmd_demo(args: argparse.Namespace) -> int:
    from kvferry import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(args.engine_args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    questions = args.prompt or ["What is the capital of France?", "Write a haiku about the sea."]
    for q, out in zip(questions, llm.chat([[{"role": "user", "content": q}] for q in questions], params)):
        print(f"### {q}\n{out.text.strip()}\n")
    return 0


def cmd_engine_core(args: argparse.Namespace) -> int:
    from kvferry import peer_auth
    from kvferry.engine.core_proc import run_from_args

    try:
        # The KV store's and the KV transfer peers' tokens derive from it: a
        # core started apart (another node) agrees with its peers through
        # the same --cache-secret-file.
        peer_auth.socket_secret(args.cache_secret_file)
    except ValueError as exc:
        args.subparser.error(str(exc))
    return run_from_args(args, args.engine_args.create_engine_config())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate text from the embedded default model")
    EngineArgs.add_cli_args(demo)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("prompt", nargs="*")
    demo.set_defaults(func=cmd_demo, subparser=demo)
    from kvferry.serve.cli import add_serve_parser  # light: heavy imports happen when serve runs

    core = sub.add_parser("engine-core", help="an engine core alone, reached by socket address")
    EngineArgs.add_cli_args(core)
    _add_core_args(core)
    core.set_defaults(func=cmd_engine_core, subparser=core)

    add_serve_parser(sub)
    from kvferry.kvstore.service import add_kvstore_args, run as run_kvstore  # light: no torch in the store
    kvstore = sub.add_parser("kvstore", help="the node's KV store service (shared-memory DRAM arena, cold tiers)")
    add_kvstore_args(kvstore)
    kvstore.set_defaults(func=run_kvstore)
    from kvferry.bench.cli import add_bench_parsers  # bench, profile; light: tools load when they run
    add_bench_parsers(sub)
    from kvferry.plan.cli import add_plan_parsers  # simulate, plan; light: the simulator loads when it runs
    add_plan_parsers(sub)
    from kvferry.spec.train_cli import add_train_parser  # train-draft; light: torch loads when it runs
    add_train_parser(sub)
    args = parser.parse_args(argv)
    if getattr(args, "subparser", None) is not None:  # commands that build an engine
        args.engine_args = engine_args_from(args.subparser, args)
    return args.func(args)


def _add_core_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None,
                        help="the core's address, as a router joins it: tcp://HOST:PORT (inputs on PORT, outputs on "
                             "PORT+1) or ipc://PATH (PATH-input, PATH-output)")
    parser.add_argument("--input-address", default=None, help="where to receive inputs (ipc:// or tcp://)")
    parser.add_argument("--output-address", default=None, help="where to send outputs (ipc:// or tcp://)")
    parser.add_argument("--cpus", default=None, help='CPUs this core may run on, e.g. "0", "2-3" (sched_setaffinity)')
    parser.add_argument("--name", default="engine-0", help="process title suffix: kvferry: NAME")
    parser.add_argument("--cache-secret-file", default=None,
                        help="the servers' cache secret: this core's KV store and KV transfer tokens derive from it "
                             "(give a store and the cores started apart from it the same file)")
    parser.add_argument("--check-kv-integrity", action="store_true")
    parser.add_argument("--log-level", default="info")


if __name__ == "__main__":
    sys.exit(main())
