"""The rest of vLLM's common ``vllm serve`` flags: those a script passes
as a matter of course (``--trust-remote-code``, ``--generation-config
auto``, ``--load-format safetensors`` ...). Each is a no-op, mapped onto
kvferry's own option, or refused in one line that says why; and the vLLM
flags kvferry does not take at all have a reason too (``REFUSED``), which
the parser's "unrecognized argument" line gives instead of a guess.

    add_serve_compat_args(group)                   the flags, into vllm_flags' group
    apply_serve_compat_args(args, engine_args)     -> EngineArgs; ValueError (one line)
    REFUSED                                        flag -> why kvferry does not take it

No heavy imports: the CLI imports this for every command.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from kvferry.config import EngineArgs
from kvferry.model.resolve import resolve_model

# vLLM's --dtype aliases: half and float name the same types as kvferry's.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# kvferry's top_logprobs bound (serve/params.py), vLLM's --max-logprobs default.
MAX_LOGPROBS = 20

_LORA = "LoRA adapters are not supported yet"
_MULTIMODAL = "multimodal inputs are not supported (text models only)"
_DOWNLOAD = ("models are not downloaded at start-up: run `hf download ORG/NAME` first, then pass the id "
             "(found in the local HF cache) or the folder")
_TLS = "TLS is not served: put a TLS-terminating proxy (nginx, envoy, caddy) in front"
# vLLM flags that are not added to the parser: the unknown-flag error gives
# the reason (cli_parser.Parser.refused), and no "nearest flag" guess.
REFUSED: dict[str, str] = {
    **{flag: _LORA for flag in ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank",
                                "--max-cpu-loras", "--fully-sharded-loras", "--lora-extra-vocab-size",
                                "--lora-dtype", "--enable-lora-bias")},
    **{flag: _MULTIMODAL for flag in ("--limit-mm-per-prompt", "--mm-processor-kwargs",
                                      "--disable-mm-preprocessor-cache", "--allowed-local-media-path")},
    **{flag: _DOWNLOAD for flag in ("--download-dir", "--hf-token")},
    **{flag: _TLS for flag in ("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs")},
    "--cpu-offload-gb": "offloading weights to host memory is not supported (the model must fit the device)",
    "--enable-sleep-mode": "sleep mode is not supported (stop the server to free its memory)",
    "--speculative-model": "give the draft as --speculative-config '{\"method\": \"draft\", \"model\": PATH}'",
    "--num-speculative-tokens": "give it in --speculative-config '{\"num_speculative_tokens\": K, ...}'",
    "--kv-transfer-config": "kvferry's own P/D transfer takes --kv-transfer-address (docs/disaggregation.md)",
    "--uds": "listening on a unix socket is not supported: give --host and --port",
    "--hf-overrides": "config.json is read as it is: edit a copy of the model folder instead",
    "--rope-scaling": "config.json's rope_scaling is used as it is: edit a copy of the model folder instead",
    "--quantization-param-path": "scaled fp8 KV caches are not supported (--kv-cache-dtype fp8 stores no scales)",
    "--middleware": "custom ASGI middleware is not supported",
    "--lora-modules-path": _LORA,
    "--reasoning-parser": "reasoning parsers are not supported yet: the reasoning text stays in the content",
    "--allow-credentials": ("credentialed CORS requests are not allowed (a browser sends the API key in the "
                            "Authorization header, which needs none)"),
}

LOAD_FORMATS_OK = ("auto", "safetensors", "gguf")
TOKENIZER_MODES_OK = ("auto", "hf", "slow")
EXECUTOR_BACKENDS_OK = ("mp", "uni")
# A flag given: one line on stderr (vllm_flags.note).
Note = Callable[[str], None]


def add_serve_compat_args(g: argparse._ArgumentGroup) -> None:
    """The flags, into vLLM's argument group of ``kvferry serve``."""
    g.add_argument("--trust-remote-code", action="store_true",
                   help="no-op: kvferry runs no code from a model repository (its architectures are built in)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no-op: kvferry logs no prompts (the access log: --disable-uvicorn-access-log)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="no-op: kvferry logs no prompts, only the access log's one line per request")
    g.add_argument("--enable-log-unknown-fields", action="store_true",
                   help="no-op: unknown request fields are always logged once and listed in a response header")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no-op: kvferry serves no OpenAPI docs pages")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="no-op: tensor-parallel ranks all-reduce over shared memory or gloo (--tp-all-reduce)")
    g.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="no-op: the front end is one process; the engine cores are processes of their own")
    g.add_argument("--generation-config", default=None, metavar="auto|vllm",
                   help="no-op for auto and vllm: the model's generation_config.json gives only the stop tokens; "
                        "sampling defaults are the OpenAI API's (vLLM's 'vllm'); a folder is refused")
    g.add_argument("--load-format", default=None, metavar="FORMAT",
                   help="auto, safetensors or gguf: no-op (the format follows the model path: a folder of "
                        "safetensors or a .gguf file); other formats are refused")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="no-op when it names the model itself: the model folder's tokenizer.json (or the GGUF's) is "
                        "always used; another tokenizer is refused")
    g.add_argument("--tokenizer-mode", default=None, metavar="MODE",
                   help="auto, hf or slow: no-op (tokenizer.json through the tokenizers library); mistral and custom "
                        "are refused")
    g.add_argument("--revision", default=None, metavar="REV",
                   help="main: no-op (an HF id is the cached snapshot refs/main names); another revision is refused: "
                        "pass that snapshot's folder")
    g.add_argument("--code-revision", default=None, metavar="REV",
                   help="no-op: kvferry runs no code from a model repository")
    g.add_argument("--tokenizer-revision", default=None, metavar="REV",
                   help="main: no-op (the tokenizer is the model snapshot's); another revision is refused")
    g.add_argument("--distributed-executor-backend", default=None, metavar="BACKEND",
                   help="mp or uni: no-op (engine cores are processes); ray is refused: kvferry serve --ray ADDRESS "
                        "places the engine cores on a Ray cluster")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, metavar="N",
                   help="pipeline stage processes per engine core on this host, each with its share of the layers "
                        "(docs/parallelism.md)")
    g.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                   help=f"only {MAX_LOGPROBS}: requests may ask for top_logprobs up to {MAX_LOGPROBS}")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="the same as --num-kv-blocks N")
    g.add_argument("--root-path", default=None, metavar="PATH",
                   help="no-op: the routes stay at / (a proxy that serves them under PATH strips it, as vLLM's flag "
                        "expects)")
    for what in ("methods", "headers"):
        g.add_argument(f"--allowed-{what}", nargs="+", default=None, metavar=what.upper()[:-1],
                       help=f"CORS: only '*' (no-op): an origin of --allowed-origins may send every {what[:-1]}")
    g.add_argument("--guided-decoding-backend", default=None, metavar="BACKEND",
                   help="auto or xgrammar: no-op (structured output always runs on xgrammar); others are refused")


def alias_dtype_choices(parser: argparse.ArgumentParser) -> None:
    """``--dtype half`` and ``--dtype float`` (vLLM's names) are kvferry's
    float16 and float32: argparse converts before it checks the choices."""
    for action in parser._actions:
        if action.dest == "dtype" and action.option_strings:
            action.type = lambda text: DTYPE_ALIASES.get(text, text)


def apply_serve_compat_args(args: argparse.Namespace, engine_args: EngineArgs, note: Note) -> EngineArgs:
    """Check the flags and print one line for each given; ValueError (one
    line, naming the flag) for a value kvferry cannot honour."""
    for flag, what in (("trust_remote_code", "kvferry runs no code from a model repository"),
                       ("disable_log_requests", "kvferry logs no prompts"),
                       ("enable_log_requests", "kvferry logs no prompts, only the access log's line per request"),
                       ("enable_log_unknown_fields", "unknown request fields are always logged once"),
                       ("disable_fastapi_docs", "kvferry serves no OpenAPI docs pages"),
                       ("disable_custom_all_reduce", "no all-reduce across devices"),
                       ("disable_frontend_multiprocessing", "the front end is one process")):
        if getattr(args, flag, False):
            note(f"--{flag.replace('_', '-')}: no-op ({what})")
    _generation_config(args.generation_config, note)
    _load_format(args.load_format, engine_args, note)
    _tokenizer(args.tokenizer, engine_args, note)
    _one_of("--tokenizer-mode", args.tokenizer_mode, TOKENIZER_MODES_OK,
            "tokenizer.json through the tokenizers library", "only the model's tokenizer.json is supported", note)
    for flag, value in (("--revision", args.revision), ("--tokenizer-revision", args.tokenizer_revision)):
        _one_of(flag, value, ("main",), "an HF id is the cached snapshot refs/main names",
                "only the snapshot refs/main names is found by id: pass that revision's snapshot folder as the model",
                note)
    if args.code_revision is not None:
        note(f"--code-revision {args.code_revision}: no-op (kvferry runs no code from a model repository)")
    _executor_backend(args.distributed_executor_backend, note)
    if args.pipeline_parallel_size == 1:
        note("--pipeline-parallel-size 1: no-op (one pipeline stage)")
    elif args.pipeline_parallel_size is not None:  # the engine's own option (no flag of its own there)
        engine_args = dataclasses.replace(engine_args, pipeline_parallel_size=args.pipeline_parallel_size)
        note(f"--pipeline-parallel-size {args.pipeline_parallel_size}: pipeline stage processes per engine core")
    if args.max_logprobs is not None:
        if args.max_logprobs != MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs {args.max_logprobs}: kvferry's bound is fixed at {MAX_LOGPROBS} "
                             f"(top_logprobs in [0, {MAX_LOGPROBS}]); give {MAX_LOGPROBS} or leave it out")
        note(f"--max-logprobs {MAX_LOGPROBS}: no-op (top_logprobs up to {MAX_LOGPROBS})")
    if args.root_path is not None:
        if not args.root_path.startswith("/"):
            raise ValueError(f"--root-path must start with '/', got {args.root_path!r}")
        note(f"--root-path {args.root_path}: no-op (the routes stay at /; the proxy strips {args.root_path})")
    _one_of("--guided-decoding-backend", args.guided_decoding_backend, ("auto", "xgrammar"),
            "structured output runs on xgrammar", "only xgrammar is built in", note)
    for what in ("methods", "headers"):
        values = getattr(args, f"allowed_{what}")
        if values is not None:
            if values != ["*"]:
                raise ValueError(f"--allowed-{what} {' '.join(values)}: not supported (an origin of --allowed-origins "
                                 f"may send every {what[:-1]}); give '*' or leave it out")
            note(f"--allowed-{what} *: no-op (every {what[:-1]} is allowed)")
    if args.num_gpu_blocks_override is not None:
        engine_args = _num_blocks_override(args.num_gpu_blocks_override, engine_args, note)
    return engine_args


def _one_of(flag: str, value: str | None, accepted: tuple[str, ...], what: str, why_not: str, note: Note) -> None:
    if value is None:
        return
    if value not in accepted:
        raise ValueError(f"{flag} {value}: not supported ({why_not}); accepted: {', '.join(accepted)}")
    note(f"{flag} {value}: no-op ({what})")


def _generation_config(value: str | None, note: Note) -> None:
    if value is None:
        return
    if value not in ("auto", "vllm"):
        raise ValueError(f"--generation-config {value}: a generation config folder is not supported; give auto or "
                         "vllm (the model's generation_config.json gives the stop tokens, requests their sampling)")
    note(f"--generation-config {value}: no-op (generation_config.json gives the stop tokens; sampling defaults "
         "are the OpenAI API's)")


def _load_format(value: str | None, engine_args: EngineArgs, note: Note) -> None:
    if value is None:
        return
    if value not in LOAD_FORMATS_OK:
        raise ValueError(f"--load-format {value}: not supported (kvferry loads a folder of safetensors or a .gguf "
                         f"file); accepted: {', '.join(LOAD_FORMATS_OK)}")
    if value != "auto":
        # The embedded default is a .gguf (resolving it would import torch).
        is_gguf = engine_args.model is None or resolve_model(engine_args.model).is_gguf
        if is_gguf != (value == "gguf"):
            raise ValueError(f"--load-format {value}: the model {engine_args.model or '(the embedded default)'} is "
                             f"{'a .gguf file' if is_gguf else 'a safetensors folder'}")
    note(f"--load-format {value}: no-op (the format follows the model path)")


def _tokenizer(value: str | None, engine_args: EngineArgs, note: Note) -> None:
    if value is None:
        return
    model = engine_args.model
    same = value == model or (model is not None and Path(value).expanduser().exists()
                              and _same_path(value, str(resolve_model(model).path)))
    if not same:
        raise ValueError(f"--tokenizer {value}: a tokenizer other than the model's is not supported (kvferry uses "
                         f"the model's own tokenizer.json); leave it out or give the model itself")
    note(f"--tokenizer {value}: no-op (the model's own tokenizer)")


def _same_path(a: str, b: str) -> bool:
    try:
        return os.path.samefile(Path(a).expanduser(), Path(b))
    except OSError:
        return False


def _executor_backend(value: str | None, note: Note) -> None:
    if value is None:
        return
    if value == "ray":
        raise ValueError("--distributed-executor-backend ray: not supported as such; kvferry serve --ray ADDRESS "
                         "(or auto) places the engine cores on a Ray cluster")
    if value not in EXECUTOR_BACKENDS_OK:
        raise ValueError(f"--distributed-executor-backend {value}: not supported; accepted: "
                         f"{', '.join(EXECUTOR_BACKENDS_OK)} (no-ops: engine cores are processes)")
    note(f"--distributed-executor-backend {value}: no-op (engine cores are processes)")


def _num_blocks_override(blocks: int, engine_args: EngineArgs, note: Note) -> EngineArgs:
    if engine_args.num_kv_blocks is not None and engine_args.num_kv_blocks != blocks:
        raise ValueError("--num-gpu-blocks-override and --num-kv-blocks: give one (it sets --num-kv-blocks)")
    note(f"--num-gpu-blocks-override {blocks}: --num-kv-blocks {blocks}")
    return dataclasses.replace(engine_args, num_kv_blocks=blocks)  # validated by EngineArgs
