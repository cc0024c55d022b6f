"""A stage process of a pipeline-parallel engine core (pp_stages.py has the picture).

    python -m kvferry.engine.pp_worker      (a pickled StageSpec on stdin)

It loads its layers (the last stage also the final norm and the lm_head),
reports, builds its runner over rank 0's pool shape, then runs each step
rank 0 sends: the residual stream of each micro-batch in from the stage
before, through its layers, out to the next; the last stage samples and
sends its output to rank 0. It exits on rank 0's shutdown message, on any
error (reported; rank 0's watcher ends the group), and as soon as rank 0's
process is gone.
"""
from __future__ import annotations

import logging
import pickle
import sys
import traceback

import setproctitle
import torch
import zmq

from kvferry.engine.cpu_threads import bind_step_thread
from kvferry.engine.pp_runner import StageLink, StageRunner
from kvferry.engine.pp_stages import StageSpec
from kvferry.engine.rank_group import connect_to_leader, receive_pickled, watch_parent
from kvferry.engine.tp_ranks import RunnerShape
from kvferry.parallel.rank_sockets import RankKeys
from kvferry.model.loader import load_model

logger = logging.getLogger(__name__)

_POLL_MS = 200


def main() -> int:
    spec: StageSpec = pickle.load(sys.stdin.buffer)
    rank = spec.stage.rank
    name = f"{spec.name} rank {rank}"
    setproctitle.setproctitle(f"kvferry: {name}")
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
    watch_parent(spec.parent_pid, _POLL_MS)
    if spec.cpus:
        bind_step_thread(spec.cpus)  # this thread runs every torch op of the process
    else:
        torch.set_num_threads(spec.threads)
    ctx = zmq.Context()
    # Stages on other nodes: CURVE on every tcp:// socket (parallel/rank_sockets.py).
    keys = RankKeys.of_tree() if spec.remote else None
    guard = keys.guard(ctx) if keys is not None else None
    reports, steps = connect_to_leader(ctx, spec.reports, spec.steps, spec.remote)
    prev = ctx.socket(zmq.PULL)
    if keys is not None:
        keys.server(prev)
    prev.bind(spec.acts_in)
    nxt = None
    if spec.acts_out is not None:
        nxt = ctx.socket(zmq.PUSH)
        nxt.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            keys.client(nxt)
        nxt.connect(spec.acts_out)
    runner = None
    try:
        runner = _start(spec, reports, steps)
        if runner is not None:  # None: rank 0 stopped before its pool was built
            runner.link = StageLink(prev=prev, next=nxt, alive=lambda: None)  # rank 0's watcher ends a broken group
            _serve(runner, steps, reports)
    except ValueError as exc:  # a configuration or model-file mistake: one line
        logger.error("pipeline stage failed: %s", exc)
        reports.send(pickle.dumps(("error", rank, str(exc))))
        return 1
    except Exception:  # noqa: BLE001 - reported, then the whole group ends
        logger.exception("pipeline stage failed")
        reports.send(pickle.dumps(("error", rank, traceback.format_exc(limit=4))))
        return 1
    finally:
        if runner is not None and runner.connector is not None:
            runner.connector.close()  # its KV sender thread and its pool's mapping
        for sock in (steps, prev, nxt):
            if sock is not None:
                sock.close(linger=0)
        reports.close()
        if guard is not None:
            guard.stop()
        ctx.term()
    return 0


def _start(spec: StageSpec, reports: zmq.Socket, steps: zmq.Socket) -> StageRunner | None:
    m = spec.config.model
    loaded = load_model(m.model, dtype=m.dtype, device=m.device, quantization=m.quantization, stage=spec.stage)
    reports.send(pickle.dumps(("loaded", spec.stage.rank, None)))
    shape = receive_pickled(steps, _POLL_MS)
    if shape is None:
        return None
    if not isinstance(shape, RunnerShape):
        raise RuntimeError(f"expected the pool's shape first, got {type(shape).__name__}")
    return StageRunner(loaded, spec.config, shape.num_kv_blocks, shape.max_model_len,
                       kv_cache_dtype=shape.kv_cache_dtype, kv_pool=shape.kv_pool)


def _serve(runner: StageRunner, steps: zmq.Socket, reports: zmq.Socket) -> None:
    last = runner.stage.last
    while (message := receive_pickled(steps, _POLL_MS)) is not None:
        sched, sampled = message
        if not last:  # the last stage sampled them itself
            runner.apply_sampled(sampled)
        out = runner.execute(sched)
        if last and not sched.is_empty:
            reports.send(pickle.dumps(("output", runner.stage.rank, (runner.steps_run, out, runner.timeline)),
                                      protocol=pickle.HIGHEST_PROTOCOL))




if __name__ == "__main__":
    sys.exit(main())
