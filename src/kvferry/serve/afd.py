"""``kvferry serve --mode afd --attention N --ffn M``: attention/FFN
disaggregation, mapped onto what the server already runs (no torch here).

N attention cores are N engine cores behind the router, as data-parallel
replicas (each its own scheduler and KV cache, requests placed by the
router's KV-aware policy); all N share the M FFN workers this server
starts, through one 0700 socket folder, so each FFN call batches the rows
of every core (engine/afd_leader.py). The router sees N colocated cores,
so ``kvferry scale --engines N`` (alias ``--attention N``) adds or drains
attention cores, which find the same workers.

``--mode disagg --prefill P --decode D --ffn M`` composes the two: the
decode pool splits (its D cores are attention cores sharing the M FFN
workers), the prefill pool stays colocated (router/supervisor.py's
core_config gives its cores no FFN workers).

    apply_afd_args(args, engine_args)   the flags' checks (one-line ValueError) and the mapping
    afd_folder(engine_args)             the shared folder, made just before the cores start
    start_ffn_pool(args, engine_args)   the M FFN workers (engine/afd_pool.py), restarted whole when one
                                        dies, within the cores' restart budget
    start_ray_ffn(args, engine_args)    under --ray (once the server joined the cluster): the same pool, its
                                        workers Ray actors placed by --ray-ffn-resources (fleet/ffn_actors.py)
    stop_ray_ffn(args)                  ... stopped before the server leaves the cluster
    resize_ffn(pool, M)                 kvferry scale --ffn M (POST /v1/admin/scale {"ffn": M}) on a live server
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import shutil
import uuid

from kvferry import private_dirs
from kvferry.afd_config import RAY_BOARD, add_ray_ffn_args
from kvferry.config import EngineArgs
from kvferry.engine.afd_pool import MAX_FFN_WORKERS, FFNLoadError, FFNPool
from kvferry.fleet.placement import parse_resources
from kvferry.model.config import ModelConfig
from kvferry.model.tp_split import check_split
from kvferry.serve.preflight import _hf_config as hf_config  # config.json, or {} (a .gguf)


def add_afd_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--attention", type=int, default=None, metavar="N",
                       help="--mode afd: attention engine cores (data-parallel replicas, each with its scheduler "
                            "and KV cache) that share the --ffn FFN workers (docs/parallelism.md; default 1)")
    add_ray_ffn_args(group)


def apply_afd_args(args: argparse.Namespace, engine_args: EngineArgs) -> EngineArgs:
    """The engine args of this server's cores; ``--mode afd`` becomes N
    colocated cores with ``ffn`` workers each, ``--mode disagg --ffn M``
    splits the decode pool alone (the folder comes later). ValueError (one
    line) for a combination that does not run."""
    attention, ffn, mode = getattr(args, "attention", None), engine_args.ffn, getattr(args, "mode", "colocated")
    if attention is not None and mode != "afd":
        raise ValueError(f"--attention {attention}: only with --mode afd (a colocated server takes "
                         "--data-parallel-size)")
    if mode == "colocated" and ffn:
        raise ValueError(f"--ffn {ffn}: only with --mode afd, or --mode disagg (its decode pool splits)")
    if (ffn or mode == "afd") and getattr(args, "ray", None) is not None:  # before Ray is joined
        parse_resources(getattr(args, "ray_ffn_resources", '{"CPU": 1}'), "--ray-ffn-resources")
    if mode == "disagg" and ffn:
        _refuse(args, "--mode disagg --ffn", [(getattr(args, "decode_tp", None) not in (None, 1),
                                               f"--decode-tp {getattr(args, 'decode_tp', None)}: the decode "
                                               "pool's cores run attention in one process each with --ffn")])
        return _checked(engine_args)
    if mode != "afd":
        return engine_args
    attention = 1 if attention is None else attention
    if isinstance(attention, bool) or not isinstance(attention, int) or attention < 1:
        raise ValueError(f"--attention must be an integer >= 1 (attention cores of --mode afd), got {attention!r}")
    _refuse(args, "--mode afd", [(args.data_parallel_size != 1, f"--data-parallel-size {args.data_parallel_size}: "
                                                                "--mode afd counts its attention cores with "
                                                                "--attention N")])
    engine_args = _checked(dataclasses.replace(engine_args, ffn=ffn or 1))
    args.mode, args.data_parallel_size = "colocated", attention
    return engine_args


def _refuse(args: argparse.Namespace, what: str, more: list[tuple[bool, str]]) -> None:
    refused = [*more,
               (bool(args.worker), f"--worker: {what} does not join cores started apart yet"),
               (bool(getattr(args, "autoscale", None)), f"--autoscale: {what} does not scale yet")]
    for bad, line in refused:
        if bad:
            raise ValueError(line)


def _checked(engine_args: EngineArgs) -> EngineArgs:
    if not isinstance(engine_args.ffn, int) or engine_args.ffn < 0:
        raise ValueError(f"--ffn must be an integer >= 1 (FFN workers of --mode afd), got {engine_args.ffn!r}")
    engine_args.create_engine_config()  # the engine's one-line refusals (afd_config.afd_refusals)
    _check_split(engine_args)
    return engine_args


def _check_split(engine_args: EngineArgs) -> None:
    check_ffn_split(engine_args.model, engine_args.ffn)


def check_ffn_split(model: str, ffn: int) -> None:
    """M > 1 FFN workers split each MLP (or the experts) as -tp M ranks
    would (a .gguf's blocks too: each worker reads its own slice of them)."""
    if ffn <= 1:
        return
    try:
        config = ModelConfig.from_hf_dict(hf_config(model))
    except (KeyError, TypeError, ValueError):
        return  # a .gguf (each worker checks the split as it loads) or a config the core refuses in its own words
    try:
        check_split(config, ffn, expert_parallel=True)
    except ValueError as exc:
        raise ValueError(f"--ffn {ffn}: {str(exc).partition(': ')[2]}") from None


def resize_ffn(pool: FFNPool | None, ffn: object) -> dict:
    """``kvferry scale --ffn M``: the pool serves with M workers once this
    returns (each attention core moves to them between two steps; a step
    under way finishes on the old ones). ValueError (one line, the
    request's fault), RuntimeError (the pool could not: nothing changed)."""
    if pool is None:
        raise ValueError("ffn: only a server started with --mode afd (or --mode disagg --ffn) has FFN workers")
    if isinstance(ffn, bool) or not isinstance(ffn, int) or not 1 <= ffn <= MAX_FFN_WORKERS:
        raise ValueError(f"ffn: must be an integer from 1 to {MAX_FFN_WORKERS} (FFN workers), got {ffn!r}")
    check_ffn_split(pool.config.model.model, ffn)
    before = pool.size
    seconds = pool.resize(ffn)
    return {"before": before, "after": pool.size, "seconds": round(seconds, 3)}


def afd_folder(engine_args: EngineArgs) -> EngineArgs:
    """A 0700 folder for the FFN workers' sockets, removed when the server exits."""
    if not engine_args.ffn or engine_args.afd_folder is not None:
        return engine_args
    folder = private_dirs.make("kvferry-afd-")  # 0700; the FFN workers remove it if we are killed
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return dataclasses.replace(engine_args, afd_folder=folder)


def start_ffn_pool(args: argparse.Namespace, engine_args: EngineArgs) -> FFNPool | None:
    """The server's FFN workers (None without --mode afd, or under --ray:
    start_ray_ffn's); they load while the cores do."""
    if not engine_args.ffn or engine_args.afd_folder is None or getattr(args, "ray", None) is not None:
        return None
    return FFNPool(engine_args.create_engine_config(), max_restarts=args.engine_restarts,
                   window_s=args.engine_restart_window)


def start_ray_ffn(args: argparse.Namespace, engine_args: EngineArgs) -> EngineArgs:
    """``--mode afd --ray``: the FFN workers as Ray actors (the server has
    joined the cluster), their generations on a board actor the cores
    read; returns the engine args that name it (AFDConfig.folder
    "ray:NAME"). ValueError (one line) when Ray cannot place them."""
    if not engine_args.ffn or getattr(args, "ray", None) is None:
        return engine_args
    from kvferry.fleet.ffn_actors import RayFFN  # optional dependency: imports ray

    board = f"kvferry-ffn-{uuid.uuid4().hex[:12]}"  # two servers on one cluster: two boards
    engine_args = dataclasses.replace(engine_args, afd_folder=RAY_BOARD + board)
    config = engine_args.create_engine_config()
    resources = parse_resources(getattr(args, "ray_ffn_resources", '{"CPU": 1}'), "--ray-ffn-resources")
    try:
        launcher = RayFFN(config, "afd", resources, board, args.scale_timeout_s)
        args.ffn_pool = FFNPool(config, max_restarts=args.engine_restarts, window_s=args.engine_restart_window,
                                launcher=launcher)
    except FFNLoadError as exc:
        raise ValueError(str(exc)) from None
    return engine_args


def stop_ray_ffn(args: argparse.Namespace) -> None:
    """The Ray FFN workers' end (their actors and the board), before the server leaves the cluster."""
    pool = getattr(args, "ffn_pool", None)
    if pool is not None and getattr(args, "ray", None) is not None:
        pool.stop()
