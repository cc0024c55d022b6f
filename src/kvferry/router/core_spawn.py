"""Spawning the engine core processes a server starts, and each core's
config. Apart from the router's supervisor (router/supervisor.py, which
also restarts them) so that ``kvferry serve`` spawns its cores before it
imports the rest of the router and the web side (membership and speculation
bring numpy): the model loads while those imports run.
"""
from __future__ import annotations

import dataclasses

from kvferry.config import EngineArgs
from kvferry.engine.core_client import CoreProcess
from kvferry.router.config import RouterConfig


def core_config(args: EngineArgs, role: str, tp: int | None = None, pp: int | None = None):
    """The engine config of a core with this role: prefill and decode cores
    get a KV transfer socket (a free loopback port unless one was given);
    ``tp`` / ``pp``: its pool's tensor-parallel ranks and pipeline stages (None: the engine's)."""
    if tp is not None:
        args = dataclasses.replace(args, tensor_parallel_size=tp)
    if pp is not None:
        args = dataclasses.replace(args, pipeline_parallel_size=pp)
    if role == "prefill" and args.ffn:  # --mode disagg --ffn M: the decode pool alone splits (serve/afd.py)
        args = dataclasses.replace(args, ffn=0, afd_folder=None)
    config = args.create_engine_config()
    if role != "engine" and not config.kv_transfer.kv_transfer_address:
        config.kv_transfer.kv_transfer_address = "tcp://127.0.0.1:0"
    return config


def spawn_cores(args: EngineArgs, router: RouterConfig, check_integrity_when_idle: bool,
                log_level: str) -> list[CoreProcess]:
    """Spawn the local core processes ``router`` names, without waiting for
    them: ``start_cores(..., spawned=)`` waits. All at once, so that N cores
    load their models in parallel. On a failure the ones spawned are stopped."""
    processes: list[CoreProcess] = []
    try:
        for name, role, cpus in router.core_specs():
            processes.append(CoreProcess.start(core_config(args, role, *router.layout_of_role(role)), name,
                                               check_integrity_when_idle, log_level, cpus=cpus))
    except BaseException:
        stop_processes(processes)
        raise
    return processes


def stop_processes(processes: list[CoreProcess]) -> None:
    """Stop spawned cores that no client took over (``spawn_cores``, then a failure)."""
    for process in processes:
        process.stop(timeout_s=0)
