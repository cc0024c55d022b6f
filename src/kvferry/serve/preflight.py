"""Configuration mistakes ``kvferry serve`` can see before it starts a
process: each is a ValueError of one line naming the flag, printed as
``kvferry serve: error: ...`` with exit code 2, where the engine core
would otherwise find it only after loading the model (and the log would
show the core's failure first).

    check_serve_args(args, engine_args, local_cores)

Light: no torch, no numpy (the embedded default model's path excepted).
What only a loaded model can tell (a draft model's vocabulary, a head's
sizes) stays the core's to report, in one line too.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path

from kvferry.autoscale import flags as autoscale_flags
from kvferry.config import SPECULATIVE_DEFAULT, SPECULATIVE_OFF, EngineArgs
from kvferry.engine.core_addresses import parse_cpus
from kvferry.fleet.placement import parse_resources
from kvferry.model.checkpoint_quant import check_checkpoint_quantization
from kvferry.model.config import ModelConfig
from kvferry.model.gguf_header import gguf_context_length
from kvferry.model.resolve import resolve_model
from kvferry.model.tp_split import check_split
from kvferry.router.config import check_pool_tp

_HEAD_METHODS = ("head", "eagle", "eagle3")  # eagle, eagle3: vLLM's names for it (config.py)
# Flags that tune the autoscaler: given without --autoscale they would do
# nothing, and a user who gave one meant to scale.
_AUTOSCALE_TUNING = ("autoscale_slo", "autoscale_min", "autoscale_max", "autoscale_max_cores",
                     "autoscale_interval_s", "autoscale_window_s", "autoscale_down_after", "autoscale_cooldown_s",
                     "autoscale_min_requests", "autoscale_min_attainment", "autoscale_allow_poor_fit")


def check_serve_args(args: argparse.Namespace, engine_args: EngineArgs, local_cores: bool) -> None:
    """Raise ValueError (one line) for the first mistake found.
    ``local_cores``: this server starts engine cores itself (it loads the
    model here; joined cores check their own)."""
    _server_timeouts(args)
    _allowed_origins(getattr(args, "allowed_origins", None))
    for flag in ("ray_engine_resources", "ray_prefill_resources", "ray_decode_resources"):
        parse_resources(getattr(args, flag), "--" + flag.replace("_", "-"))
    _autoscale(args)
    _expert_parallel(args, engine_args)
    _kv_connector(engine_args.kv_connector)
    check_pool_tp(getattr(args, "mode", "colocated"), getattr(args, "prefill_tp", None),
                  getattr(args, "decode_tp", None), getattr(args, "prefill_pp", None), getattr(args, "decode_pp", None))
    _spread_tp_pp(args, engine_args)
    if not local_cores:
        return
    if getattr(args, "ray", None) is None:  # Ray places cores on other nodes, with their own CPUs
        _cpus(args)
    _max_model_len(engine_args)
    check_checkpoint_quantization(_hf_config(engine_args.model), engine_args.model or "the model")
    _tensor_parallel(engine_args)
    _pool_tensor_parallel(args, engine_args)
    _pipeline_parallel(engine_args)
    _speculative(engine_args)


def _server_timeouts(args: argparse.Namespace) -> None:
    for flag, allow_zero in (("shutdown_timeout", True), ("engine_start_timeout", False)):
        value = getattr(args, flag, None)
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise ValueError(f"--{flag.replace('_', '-')} must be a number of seconds "
                             f"{'>= 0' if allow_zero else '> 0'}, got {value}")


def _allowed_origins(origins: list[str] | None) -> None:
    for origin in origins or []:
        if origin != "*" and not (origin.startswith(("http://", "https://")) and len(origin.split("://", 1)[1]) > 0):
            raise ValueError(f"--allowed-origins: each origin must be '*' or scheme://host[:port], got {origin!r}")


def _autoscale(args: argparse.Namespace) -> None:
    if getattr(args, "autoscale", None) is None:
        given = [name for name in _AUTOSCALE_TUNING
                 if hasattr(args, name) and getattr(args, name) != _default(name)]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} tunes the autoscaler: give --autoscale PROFILE too "
                             "(without it the cores stay as started)")
        return
    window = getattr(args, "autoscale_window_s", autoscale_flags.DEFAULT_WINDOW_S)
    if not (math.isfinite(window) and window > 0):
        raise ValueError(f"--autoscale-window-s must be a number of seconds > 0, got {window}")


def _default(name: str) -> object:
    defaults = {"autoscale_max_cores": autoscale_flags.DEFAULT_MAX_CORES,
                "autoscale_interval_s": autoscale_flags.DEFAULT_INTERVAL_S,
                "autoscale_window_s": autoscale_flags.DEFAULT_WINDOW_S,
                "autoscale_down_after": autoscale_flags.DEFAULT_DOWN_AFTER,
                "autoscale_cooldown_s": autoscale_flags.DEFAULT_COOLDOWN_S,
                "autoscale_min_requests": autoscale_flags.DEFAULT_MIN_REQUESTS,
                "autoscale_min_attainment": autoscale_flags.DEFAULT_MIN_ATTAINMENT,
                "autoscale_allow_poor_fit": False}
    return defaults.get(name)


def _kv_connector(value: str) -> None:
    if not value:
        return
    module = value.split(":", 1)[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a relative name
        found = False
    if not found:
        raise ValueError(f"--kv-connector {value}: no module named {module!r} on this Python's path")


def _cpus(args: argparse.Namespace) -> None:
    """Every CPU named by --engine-cpus / --prefill-cpus / --decode-cpus is
    one this process may run on (a core's sched_setaffinity would fail)."""
    available = os.sched_getaffinity(0)
    for flag in ("engine_cpus", "prefill_cpus", "decode_cpus"):
        values = getattr(args, flag, None)
        for text in ([values] if isinstance(values, str) else values or []):
            missing = sorted(parse_cpus(text) - available)
            if missing:
                raise ValueError(f"--{flag.replace('_', '-')} {text}: CPU {', '.join(map(str, missing[:8]))} "
                                 f"{'is' if len(missing) == 1 else 'are'} not available to this process "
                                 f"(available: {_ranges(sorted(available))})")


def _ranges(cpus: list[int]) -> str:
    out: list[str] = []
    for cpu in cpus:
        if out and out[-1].split("-")[-1] == str(cpu - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out)


def model_context_length(model: str | None) -> int | None:
    """The model's trained context (config.json's max_position_embeddings, or
    a GGUF's context_length), read without loading it; None if unknown."""
    resolved = resolve_model(model)
    if resolved.is_gguf:
        return gguf_context_length(resolved.path)
    config = _hf_config(model)
    if not config:
        return None
    # The loader's default when config.json has none (model/config.py).
    value = config.get("max_position_embeddings", 2048)
    return value if isinstance(value, int) and value > 0 else None


def _hf_config(model: str | None) -> dict:
    """config.json of an HF model folder ({} for a GGUF file or none)."""
    resolved = resolve_model(model)
    if resolved.is_gguf:
        return {}
    try:
        config = json.loads((resolved.path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _tensor_parallel(engine_args: EngineArgs) -> None:
    """The split the ranks would refuse after loading (model/tp_split.py,
    as TPShard.check), from config.json alone."""
    size = engine_args.tensor_parallel_size
    if not isinstance(size, int) or size <= 1:
        return
    try:
        config = ModelConfig.from_hf_dict(_hf_config(engine_args.model))
    except (KeyError, TypeError, ValueError):
        return  # no config.json (a .gguf) or one the core will refuse in its own words
    check_split(config, size, engine_args.enable_expert_parallel)


def _spread_tp_pp(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    """TP x PP under --ray places a core's ranks on its node only (each
    stage's sums would need a tcp hub of its own on other nodes): the
    engine's cores, or with --mode disagg a pool's (its own --*-tp / --*-pp)."""
    if not getattr(args, "ray", None) or getattr(args, "ray_rank_placement", "pack") != "spread":
        return
    layouts = [(engine_args.tensor_parallel_size, engine_args.pipeline_parallel_size)]
    if getattr(args, "mode", "colocated") == "disagg":
        layouts = [(tp if tp is not None else layouts[0][0], pp if pp is not None else layouts[0][1])
                   for tp, pp in ((getattr(args, f"{role}_tp", None), getattr(args, f"{role}_pp", None))
                                  for role in ("prefill", "decode"))]
    for tp, pp in layouts:
        if isinstance(tp, int) and isinstance(pp, int) and tp > 1 and pp > 1:
            raise ValueError(f"--ray-rank-placement spread with -tp {tp} -pp {pp}: a core of both places its "
                             "ranks on one node for now (give --ray-rank-placement pack)")


def _expert_parallel(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    """vLLM shards experts over data-parallel x tensor-parallel ranks; here
    they are sharded over one core's -tp ranks, so each core must be the
    only one (more cores would each hold every expert)."""
    cores = getattr(args, "data_parallel_size", 1)
    if engine_args.enable_expert_parallel and isinstance(cores, int) and cores > 1:
        raise ValueError(f"--enable-expert-parallel with --data-parallel-size {cores}: experts are sharded over "
                         "one engine core's -tp ranks only for now: give --data-parallel-size 1")


def _pool_tensor_parallel(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    """--prefill-tp / --decode-tp: the model splits over that many ranks, and
    the pool's configuration runs over them (the engine's one-line refusals)."""
    for role in ("prefill", "decode"):
        size = getattr(args, f"{role}_tp", None)
        if size is None:
            continue
        try:
            pool_args = dataclasses.replace(engine_args, tensor_parallel_size=size)  # validates the engine config
            _tensor_parallel(pool_args)
        except ValueError as exc:
            raise ValueError(f"--{role}-tp {size}: {exc}") from None
    for role in ("prefill", "decode"):
        size = getattr(args, f"{role}_pp", None)
        if size is None:
            continue
        tp = getattr(args, f"{role}_tp", None)
        try:  # the pool's engine config over stages (its one-line refusals), and a layer for each stage
            pool_args = dataclasses.replace(engine_args, pipeline_parallel_size=size,
                                            tensor_parallel_size=tp or engine_args.tensor_parallel_size)
            _pipeline_parallel(pool_args)
        except ValueError as exc:
            raise ValueError(f"--{role}-pp {size}: {exc}") from None


def _pipeline_parallel(engine_args: EngineArgs) -> None:
    """Each stage needs a layer (parallel/pipeline.py's pp_layer_range), from config.json alone."""
    size = engine_args.pipeline_parallel_size
    if not isinstance(size, int) or size <= 1:
        return
    layers = _hf_config(engine_args.model).get("num_hidden_layers")
    if isinstance(layers, int) and layers < size:
        raise ValueError(f"pipeline_parallel_size {size}: the model has only {layers} layers "
                         "(each stage needs at least one)")


def _max_model_len(engine_args: EngineArgs) -> None:
    asked = engine_args.max_model_len
    if not asked:
        return
    limit = model_context_length(engine_args.model)
    if limit is not None and asked > limit:
        raise ValueError(f"--max-model-len {asked} exceeds the model's context length {limit}")


def _speculative(engine_args: EngineArgs) -> None:
    spec = engine_args.speculative
    if isinstance(spec, str):
        if spec.strip().lower() in (*SPECULATIVE_OFF, SPECULATIVE_DEFAULT):
            return  # the default checks nothing a start could fail on
        spec = json.loads(spec)  # valid JSON: EngineArgs checked it
    if not isinstance(spec, dict):
        return
    method, model = spec.get("method", "ngram"), spec.get("model")
    if method in _HEAD_METHODS or (method == "auto" and model is not None):  # auto's "model": a head
        _draft_head(method, model, engine_args.model)
    elif method == "draft":
        try:
            resolve_model(model)
        except ValueError as exc:
            raise ValueError(f"--speculative-config: the draft model: {exc}") from None


def _draft_head(method: str, path: str | None, target: str | None) -> None:
    what = (f'method "{method}" runs a kvferry draft head, a file that `kvferry train-draft` writes, or an '
            "EAGLE-3 checkpoint folder (config.json + safetensors, as vLLM loads it)")
    if path is None:
        if target is not None:
            raise ValueError(f"--speculative-config: {what}; without \"model\" it is the embedded default model's "
                             "head, which does not fit this target: train one and give its path as \"model\"")
        return
    p = Path(path).expanduser()
    if (p / "head.safetensors").is_file() or p.is_file() or (p / "config.json").is_file():
        return  # (an EAGLE-3 folder's config and shapes are checked as the core loads it: spec/eagle3.py)
    hint = " (a Hugging Face id is not looked up: give a local head file)" if "/" in path and not p.exists() else ""
    raise ValueError(f"--speculative-config: no draft head file at {path}{hint}; {what}")
