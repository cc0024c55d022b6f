"""A worker rank of a tensor-parallel engine core (tp_ranks.py has the picture).

    python -m kvferry.engine.tp_worker      (a pickled WorkerSpec on stdin)

It loads its shard, reports, joins the group, builds its runner over rank
0's pool shape, then executes each step rank 0 sends: the same forward pass
with its collectives in the same order, no sampling (rank 0's samples come
with the next step). It exits on rank 0's shutdown message, on any error
(rank 0 sees its collective fail, or its watcher sees the exit), and as
soon as rank 0's process is gone.
"""
from __future__ import annotations

import logging
import pickle
import sys
import traceback

import setproctitle
import torch
import zmq

from kvferry import private_dirs
from kvferry.engine.cpu_threads import bind_step_thread
from kvferry.engine.fast_exit import run_without_teardown
from kvferry.engine.kv_connector import for_engine
from kvferry.engine.rank_group import connect_to_leader, receive_pickled, watch_parent
from kvferry.engine.runner import ModelRunner
from kvferry.engine.tp_ranks import RunnerShape, WorkerSpec, join_group
from kvferry.model.layers.parallel import TPShard
from kvferry.model.loader import load_model
from kvferry.spec import runs_head
from kvferry.spec.eagle3 import is_eagle3_checkpoint
from kvferry.spec.head import EagleHead, resolve_head_path

logger = logging.getLogger(__name__)

_POLL_MS = 200


def main() -> int:
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    name = f"{spec.name} rank {spec.rank}"
    setproctitle.setproctitle(f"kvferry: {name}")
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
    watch_parent(spec.parent_pid, _POLL_MS, private_dirs.folder_of(spec.steps))
    if spec.cpus:
        bind_step_thread(spec.cpus)  # this thread runs every torch op of the process
    else:
        torch.set_num_threads(spec.threads)
    ctx = zmq.Context()
    reports, steps = connect_to_leader(ctx, spec.reports, spec.steps, spec.remote)
    try:
        runner = _start(spec, reports, steps)
        if runner is not None:  # None: rank 0 stopped before its pool was built
            _serve(runner, steps)
    except ValueError as exc:  # a configuration or model-file mistake: one line, as rank 0 says it
        logger.error("tensor-parallel worker failed: %s", exc)
        reports.send(pickle.dumps(("error", spec.rank, str(exc))))
        return 1
    except Exception:  # noqa: BLE001 - reported, then the whole group ends
        logger.exception("tensor-parallel worker failed")
        reports.send(pickle.dumps(("error", spec.rank, traceback.format_exc(limit=4))))
        return 1
    finally:
        steps.close(linger=0)
        reports.close()
        ctx.term()
    return 0


def _start(spec: WorkerSpec, reports: zmq.Socket, steps: zmq.Socket) -> ModelRunner | None:
    m = spec.config.model
    shard = TPShard(spec.rank, spec.world_size, spec.config.parallel.enable_expert_parallel)
    loaded = load_model(m.model, dtype=m.dtype, device=m.device, quantization=m.quantization, shard=shard)
    reports.send(pickle.dumps(("loaded", spec.rank, None)))
    shard.group = join_group(spec.rank, spec.group, spec.config.parallel)
    shape = receive_pickled(steps, _POLL_MS)
    if shape is None:
        return None
    if not isinstance(shape, RunnerShape):
        raise RuntimeError(f"expected the pool's shape first, got {type(shape).__name__}")
    # Its own worker half of the core's connector (P/D: this rank sends its KV heads itself).
    # A draft head drafts on every rank in step (its lookups and logits are
    # the ranks' collectives); a draft model and an EAGLE-3 head run on rank 0
    # alone (engine/speculation.py: drafts_alone), whose drafts come with the step.
    s = spec.config.speculative
    head = (EagleHead.load(resolve_head_path(s.model), device=m.device)
            if runs_head(s) and not is_eagle3_checkpoint(resolve_head_path(s.model)) else None)
    runner = ModelRunner(loaded, spec.config, shape.num_kv_blocks, shape.max_model_len,
                         kv_cache_dtype=shape.kv_cache_dtype, connector=for_engine(spec.config, rank=spec.rank),
                         head=head)
    runner.samples = False
    return runner


def _serve(runner: ModelRunner, steps: zmq.Socket) -> None:
    while (message := receive_pickled(steps, _POLL_MS)) is not None:
        sched, sampled, received_hidden, runner.head_requests = message
        runner.apply_sampled(sampled, received_hidden)
        runner.execute(sched)




if __name__ == "__main__":
    sys.exit(run_without_teardown(main))  # fast_exit.py: no interpreter teardown
