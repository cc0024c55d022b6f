"""vLLM's ``vllm serve`` flags that ``kvferry serve`` accepts, so that a
vLLM command line works unchanged: each is a no-op, or mapped onto
kvferry's own option, with one line on stderr saying which.

    add_vllm_args(parser)                   the flags, in one argument group
    apply_vllm_args(args, engine_args)      -> EngineArgs (mapped); ValueError (one line)
    set_uvicorn_log_level(args)             uvicorn's loggers at --uvicorn-log-level (else --log-level)

    --api-key KEY                  (api_flags.py) a plain key of the one default tenant
    --enable-auto-tool-choice      no-op: tool calls are always parsed when a request sends tools
    --tensor-parallel-size N       EngineArgs.tensor_parallel_size: N rank processes per engine core
    --swap-space GiB               --num-swap-blocks = GiB / the bytes of one KV block of this model
    --uvicorn-log-level LEVEL      the level of uvicorn's loggers (its access log among them); the
                                   rest logs at --log-level
    --disable-log-stats            --log-stats-interval-s 0 (no periodic stats line)
    --gpu-memory-utilization F     CUDA: --kv-cache-memory-gb = F x total memory, less what is in use,
                                   the weights and a reserve; CPU: no-op
    --dtype half | float           kvferry's float16 | float32

The rest of vLLM's common flags (--trust-remote-code, --generation-config,
--load-format, --tokenizer ...) and the reasons for those refused are
vllm_serve_flags.py's.

No heavy imports at module level: the CLI imports this for every command.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

from kvferry.config import EngineArgs
from kvferry.model.resolve import resolve_model
from kvferry.serve.vllm_serve_flags import add_serve_compat_args, alias_dtype_choices, apply_serve_compat_args

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# --gpu-memory-utilization: what the KV cache leaves to activations, the
# sampler and CUDA graphs (vLLM measures it with a profiling run; a fixed
# reserve is the estimate without one).
ACTIVATION_RESERVE_GB = 2.0


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vLLM's flags (accepted so that a vllm serve command line works)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="no-op: tool calls are always parsed when a request sends tools")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                   help="rank processes per engine core (tensor parallelism, docs/parallelism.md; "
                        "--data-parallel-size starts more cores)")
    g.add_argument("--swap-space", type=float, default=None, metavar="GiB",
                   help="host memory for preempted requests' KV: sets --num-swap-blocks from the model's "
                        "KV block size")
    g.add_argument("--uvicorn-log-level", type=str.lower, choices=UVICORN_LOG_LEVELS, default=None,
                   help="the level of uvicorn's loggers (uvicorn, uvicorn.error, uvicorn.access: warning "
                        "and above leaves no access-log line per request); default: --log-level")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line: the same as --log-stats-interval-s 0")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="CUDA: sets --kv-cache-memory-gb to FRACTION of the device's memory, less what is in "
                        f"use, the weights and a {ACTIVATION_RESERVE_GB:g} GiB reserve; CPU: no-op")
    add_serve_compat_args(g)
    alias_dtype_choices(parser)
    _alias_option(parser, "quantization", "-q")  # vLLM's short form: `vllm serve ... -q awq`


def _alias_option(parser: argparse.ArgumentParser, dest: str, alias: str) -> None:
    """``alias`` as a second spelling of the option that sets ``dest`` (its
    help shows both; argparse registers an option string just so)."""
    for action in parser._actions:
        if action.dest == dest and action.option_strings and alias not in action.option_strings:
            action.option_strings.append(alias)
            parser._option_string_actions[alias] = action


def note(message: str) -> None:
    """One line on stderr (logging is configured later, by the server)."""
    print(f"kvferry serve: {message}", file=sys.stderr, flush=True)


def apply_vllm_args(args: argparse.Namespace, engine_args: EngineArgs) -> EngineArgs:
    """The engine args with vLLM's flags mapped in; each flag given prints
    one line. Raises ValueError (one line, naming the flag) for what
    kvferry cannot do."""
    if args.tensor_parallel_size is not None:  # the engine's own option (no flag of its own there)
        note(f"--tensor-parallel-size {args.tensor_parallel_size}: rank processes per engine core")
        engine_args = dataclasses.replace(engine_args, tensor_parallel_size=args.tensor_parallel_size)
    if args.enable_auto_tool_choice:
        note("--enable-auto-tool-choice: no-op (tool calls are always parsed when a request sends tools)")
    if args.uvicorn_log_level is not None:
        note(f"--uvicorn-log-level {args.uvicorn_log_level}: uvicorn's loggers log at {args.uvicorn_log_level} "
             f"(the rest at --log-level {args.log_level})")
    if getattr(args, "disable_log_stats", False):
        note("--disable-log-stats: --log-stats-interval-s 0")
        args.log_stats_interval_s = 0
    if args.swap_space is not None:
        engine_args = _map_swap_space(args.swap_space, engine_args)
    if args.gpu_memory_utilization is not None:
        engine_args = _map_gpu_memory_utilization(args.gpu_memory_utilization, engine_args)
    return apply_serve_compat_args(args, engine_args, note)


def uvicorn_log_level(args: argparse.Namespace) -> str:
    """The level of uvicorn's loggers: --uvicorn-log-level, else --log-level."""
    return getattr(args, "uvicorn_log_level", None) or args.log_level


def set_uvicorn_log_level(args: argparse.Namespace) -> None:
    """Set uvicorn's loggers to ``uvicorn_log_level(args)``, as vLLM's flag
    does. Call it after building uvicorn.Config, whose logging set-up resets
    them (it sets the same level on uvicorn.error, .access and .asgi given
    the level; the parent ``uvicorn`` logger is set here too)."""
    from uvicorn.config import LOG_LEVELS  # lazy: the CLI imports this module for every command

    level = LOG_LEVELS[uvicorn_log_level(args)]
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        logging.getLogger(name).setLevel(level)


def _map_swap_space(gib: float, engine_args: EngineArgs) -> EngineArgs:
    if not gib >= 0:
        raise ValueError(f"--swap-space must be >= 0 GiB, got {gib}")
    if engine_args.num_swap_blocks:
        raise ValueError("--swap-space and --num-swap-blocks: give one (--swap-space sets --num-swap-blocks)")
    block_bytes = kv_block_bytes(engine_args)
    blocks = int(gib * 2**30) // block_bytes
    note(f"--swap-space {gib:g}: --num-swap-blocks {blocks} ({block_bytes / 2**20:.2f} MiB per block of "
         f"{engine_args.block_size} tokens)")
    return dataclasses.replace(engine_args, num_swap_blocks=blocks)


def kv_block_bytes(engine_args: EngineArgs) -> int:
    """Bytes of one KV block of this model over every layer, K and V: what
    the engine core computes once the model is loaded
    (``engine.runner.kv_block_bytes``), here from config.json alone."""
    # Lazy: torch (~1.5 s) loads only for --swap-space's arithmetic.
    import torch

    from kvferry.model.kv_cache_dtype import resolve_kv_cache_dtype
    from kvferry.model.loader import read_config, resolve_dtype, resolve_model_folder

    folder = resolve_model_folder(engine_args.model)
    cfg = read_config(folder)
    model_dtype = resolve_dtype(engine_args.dtype, cfg, engine_args.device)
    triton = engine_args.attention_backend == "triton" or (
        engine_args.attention_backend == "auto" and engine_args.device.startswith("cuda"))
    cache_dtype = resolve_kv_cache_dtype(engine_args.kv_cache_dtype, model_dtype,
                                         torch.device(engine_args.device), triton)
    elem = torch.empty((), dtype=cache_dtype).element_size()
    return cfg.num_hidden_layers * 2 * engine_args.block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def _map_gpu_memory_utilization(fraction: float, engine_args: EngineArgs) -> EngineArgs:
    if not 0 < fraction <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
    if not engine_args.device.startswith("cuda"):
        note(f"--gpu-memory-utilization {fraction:g}: no-op on {engine_args.device} "
             f"(the KV cache takes --kv-cache-memory-gb, {_kv_gb_text(engine_args.kv_cache_memory_gb)})")
        return engine_args
    if engine_args.num_kv_blocks is not None:
        raise ValueError("--gpu-memory-utilization and --num-kv-blocks: give one")
    if engine_args.kv_cache_memory_gb != EngineArgs.__dataclass_fields__["kv_cache_memory_gb"].default:
        raise ValueError("--gpu-memory-utilization and --kv-cache-memory-gb: give one "
                         "(--gpu-memory-utilization sets --kv-cache-memory-gb)")
    total_gb, used_gb = _device_memory_gb(engine_args.device)
    weights_gb = _weights_gb(engine_args.model)
    kv_gb = fraction * total_gb - used_gb - weights_gb - ACTIVATION_RESERVE_GB
    if kv_gb <= 0:
        raise ValueError(f"--gpu-memory-utilization {fraction:g}: nothing left for the KV cache ({fraction:g} x "
                         f"{total_gb:.1f} GiB, less {used_gb:.1f} GiB in use, {weights_gb:.1f} GiB of weights and "
                         f"a {ACTIVATION_RESERVE_GB:g} GiB reserve); raise it or give --kv-cache-memory-gb")
    kv_gb = round(kv_gb, 2)
    note(f"--gpu-memory-utilization {fraction:g}: --kv-cache-memory-gb {kv_gb:g} ({fraction:g} x {total_gb:.1f} "
         f"GiB, less {used_gb:.1f} GiB in use, {weights_gb:.1f} GiB of weights, {ACTIVATION_RESERVE_GB:g} GiB reserve)")
    return dataclasses.replace(engine_args, kv_cache_memory_gb=kv_gb)


def _kv_gb_text(kv_gb: float | None) -> str:
    return f"{kv_gb:g} GiB" if kv_gb is not None else "by default a share of the free memory, logged at start"


def _device_memory_gb(device: str) -> tuple[float, float]:
    """(total, in use) GiB of the CUDA device, from nvidia-smi: asking torch
    would make a CUDA context in this front-end process, which keeps its
    memory for as long as the server runs."""
    index = device.partition(":")[2] or "0"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if int(index) < len(ids):
            index = ids[int(index)]
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.total,memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
        total_mib, used_mib = (float(v) for v in out.strip().splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise ValueError(f"--gpu-memory-utilization: cannot read {device}'s memory with nvidia-smi ({exc}); "
                         "give --kv-cache-memory-gb instead") from None
    return total_mib / 1024, used_mib / 1024


def _weights_gb(model: str | None) -> float:
    """The weights' size as stored (safetensors or GGUF): the device holds
    about as much once loaded in the checkpoint's dtype."""
    path = resolve_model(model).path
    files = [path] if path.is_file() else list(Path(path).glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) / 2**30
