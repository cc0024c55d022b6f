"""``kvferry chat [MODEL]``: an interactive chat in the terminal, as
``ollama run``.

    kvferry chat                                   # the server at :8000, or the embedded model
    kvferry chat ~/models/qwen2.5-0.5b --system "Answer in French."
    kvferry chat --url http://gpu-box:8000
    echo "Why is the sky blue?" | kvferry chat     # one answer, then exit

Which server: ``--url``'s (it must answer); else the one at
http://127.0.0.1:8000 when it answers and serves MODEL (any model when
MODEL is not given); else a ``kvferry serve MODEL`` of the chat's own on a
free loopback port, stopped when the chat ends (``--serve-args`` always
starts one, with those flags). Standard library only, light to import: the
top-level CLI imports this module for every command.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from pathlib import Path

from kvferry import envs
from kvferry.chat.client import ChatClient, ChatError
from kvferry.chat.launcher import LocalServer, StartError, start_server
from kvferry.chat.session import ChatSession
from kvferry.serve.cli import check_model  # light, and loaded already: the top-level CLI registers serve

DEFAULT_URL = "http://127.0.0.1:8000"


def add_chat_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "chat", help="chat with a model in the terminal (a running server's, or one started for it)",
        description="Chat with a model in the terminal: answers stream as they are generated and the "
                    "conversation is kept. Connects to --url, or to a server at " + DEFAULT_URL + " that "
                    "serves MODEL, or starts `kvferry serve MODEL` for the chat's length. /help lists the "
                    "commands.")
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `kvferry serve MODEL` takes it (default: the running server's "
                             "model, or the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--url", default=None,
                        help=f"a running server's base URL, e.g. {DEFAULT_URL} (default: {DEFAULT_URL} when a "
                             "server there serves MODEL, else a server of the chat's own)")
    parser.add_argument("--system", default=None, help="the system prompt (/system TEXT changes it)")
    parser.add_argument("--api-key", default=None,
                        help="the key a server with --api-keys wants (default: $KVFERRY_API_KEY, "
                             "else $OPENAI_API_KEY)")
    parser.add_argument("--max-tokens", type=_positive_int, default=None,
                        help="the longest answer in tokens (default: the server's, up to the context)")
    parser.add_argument("--temperature", type=_non_negative_float, default=None,
                        help="sampling temperature, 0: greedy (default: the server's, 1.0)")
    parser.add_argument("--verbose", action="store_true",
                        help="after each answer, print the server's prompt and answer token counts and the speed")
    parser.add_argument("--serve-args", default=None, metavar="FLAGS",
                        help='start a server of the chat\'s own with these `kvferry serve` flags, e.g. '
                             '--serve-args="--max-model-len 4096 --kv-cache-memory-gb 1" (never a running one)')
    parser.add_argument("--start-timeout", type=_positive_float, default=600.0,
                        help="seconds a started server gets to load the model")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    api_key = args.api_key or envs.api_key() or os.environ.get("OPENAI_API_KEY")
    try:
        serve_args = shlex.split(args.serve_args) if args.serve_args is not None else None
    except ValueError as exc:
        return _fail(f"--serve-args: {exc}", 2)
    if args.url is not None and serve_args is not None:
        return _fail("--url and --serve-args exclude each other: one connects, the other starts a server", 2)
    # The terminal closing (SIGHUP) or a kill (SIGTERM) must still stop the
    # server the chat started: unwind through the finally below.
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, _exit_on_signal)
    server: LocalServer | None = None
    try:
        try:
            client, model, server = _connect(args, api_key, serve_args)
        except (ChatError, StartError) as exc:
            return _fail(str(exc), 1)
        options = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature))
                   if v is not None}
        interactive = sys.stdin.isatty()
        session = ChatSession(client, model, system=args.system, options=options, verbose=args.verbose,
                              read=_line_reader() if interactive else input)
        if not interactive:  # piped: the whole input is one message, as `ollama run` takes it
            text = sys.stdin.read()
            return 0 if not text.strip() or session.ask(text) is not None else 1
        print(f"Chatting with {model} at {client.base_url}. /help for commands, Ctrl-D or /bye to leave.")
        return session.run()
    except KeyboardInterrupt:  # while a server starts
        print("", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()


def _connect(args: argparse.Namespace, api_key: str | None,
             serve_args: list[str] | None) -> tuple[ChatClient, str, LocalServer | None]:
    """The client, the model id to send, and the server started for it (None: a running one)."""
    if args.url is not None:
        client = ChatClient(args.url, api_key)
        return client, _pick_model(args.model, client.models(), client.base_url), None
    if serve_args is None:
        client = ChatClient(DEFAULT_URL, api_key)
        try:
            served = client.models()
        except ChatError as exc:
            if exc.status in (401, 403):  # a server is there and wants a key: not a reason for a second one
                raise
            served = []  # nothing (or nothing OpenAI-like) at the default URL: start one
        if served and (args.model is None or _match(args.model, served)):
            return client, _pick_model(args.model, served, client.base_url), None
        if served:
            print(f"kvferry chat: the server at {DEFAULT_URL} serves {', '.join(served)}, not {args.model}",
                  file=sys.stderr)
    try:
        check_model(args.model)  # a typo fails in one line, before a server is started for it
    except ValueError as exc:
        raise ChatError(str(exc)) from None
    # Status lines go to stderr: a piped chat's stdout holds the answer only.
    print(f"kvferry chat: starting a server for {args.model or 'the embedded model'} on a free local port "
          "(it stops when the chat ends; loading can take a minute) ...", file=sys.stderr, flush=True)
    server = start_server(args.model, serve_args or [], args.start_timeout)
    print(f"kvferry chat: the server is ready at {server.url}", file=sys.stderr, flush=True)
    try:
        client = ChatClient(server.url, api_key)
        return client, client.models()[0], server
    except BaseException:
        server.stop()
        raise


def _pick_model(model: str | None, served: list[str], url: str) -> str:
    if not served:
        raise ChatError(f"the server at {url} serves no model")
    if model is None:
        return served[0]
    if (match := _match(model, served)) is None:
        raise ChatError(f"the server at {url} serves {', '.join(served)}, not {model}")
    return match


def _match(model: str, served: list[str]) -> str | None:
    """The served id MODEL names: the id itself, or the name a server gives
    a model folder or .gguf file (its folder name, the file's stem)."""
    path = Path(model.rstrip("/"))
    for name in (model, path.name, path.stem if path.suffix == ".gguf" else None):
        if name in served:
            return name
    return None


def _line_reader():
    """``input`` with line editing and recall (↑) where the stdlib has
    readline; imported only for a terminal, since importing it changes how
    ``input`` treats the terminal."""
    try:
        import readline  # noqa: F401  (stdlib; absent on some builds)
    except ImportError:
        pass
    return input


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _fail(message: str, code: int) -> int:
    print(f"kvferry chat: error: {message}", file=sys.stderr)
    return code


def _positive_int(text: str) -> int:
    value = _number(text, int)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text, float)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
