"""A stage process of a pipeline-parallel engine core (pp_stages.py has the picture).

    python -m kvferry.engine.pp_worker      (a pickled StageSpec on stdin)

It loads its layers (the last stage also the final norm and the lm_head),
reports, builds its runner over rank 0's pool shape, then runs each step
rank 0 sends: the residual stream of each micro-batch in from the stage
before, through its layers, out to the next; the last stage samples and
sends its output to rank 0. It exits on rank 0's shutdown message, on any
error (reported; rank 0's watcher ends the group), and as soon as rank 0's
process is gone.

With -tp T it is TP rank t of its stage: it loads its shard of the stage's
layers, joins the stage's TP group, takes the stream from TP rank t of the
stage before and sends it to TP rank t of the next; on the last stage only
TP rank 0 samples.
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
from kvferry.engine.pp_runner import StageLink, StageRunner
from kvferry.engine.pp_stages import StageSpec
from kvferry.engine.rank_group import connect_to_leader, receive_pickled, watch_parent
from kvferry.engine.tp_ranks import RunnerShape, join_group
from kvferry.parallel.rank_sockets import RankKeys
from kvferry.model.layers.parallel import TPShard
from kvferry.model.loader import load_model
from kvferry.spec import runs_head
from kvferry.spec.head import EagleHead, resolve_head_path

logger = logging.getLogger(__name__)

_POLL_MS = 200


def main() -> int:
    spec: StageSpec = pickle.load(sys.stdin.buffer)
    rank = spec.rank
    name = f"{spec.name} rank {rank}"
    setproctitle.setproctitle(f"kvferry: {name}")
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
    watch_parent(spec.parent_pid, _POLL_MS, private_dirs.folder_of(spec.steps))
    if spec.cpus:
        bind_step_thread(spec.cpus)  # this thread runs every torch op of the process
    else:
        torch.set_num_threads(spec.threads)
    ctx = zmq.Context()
    # Stages on other nodes: CURVE on every tcp:// socket (parallel/rank_sockets.py).
    keys = RankKeys.of_tree() if spec.remote else None
    guard = keys.guard(ctx) if keys is not None else None
    reports, steps = connect_to_leader(ctx, spec.reports, spec.steps, spec.remote)
    prev = None
    if spec.acts_in is not None:  # None: a TP rank of stage 0, which embeds the tokens itself
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
    m, par = spec.config.model, spec.config.parallel
    shard = (TPShard(spec.tp_rank, par.tensor_parallel_size, par.enable_expert_parallel)
             if spec.group is not None else None)
    loaded = load_model(m.model, dtype=m.dtype, device=m.device, quantization=m.quantization, shard=shard,
                        stage=spec.stage)
    reports.send(pickle.dumps(("loaded", spec.rank, None)))
    if shard is not None:  # the stage's TP group: its sums from now on
        shard.group = join_group(spec.tp_rank, spec.group, par)
    shape = receive_pickled(steps, _POLL_MS)
    if shape is None:
        return None
    if not isinstance(shape, RunnerShape):
        raise RuntimeError(f"expected the pool's shape first, got {type(shape).__name__}")
    # Its own worker half of the core's connector (host swap, a connector of one's own: over its
    # layers; the node store: its pool in shared memory, where stage 0 saves and loads it).
    connector = for_engine(spec.config, rank=spec.tp_rank, stage=spec.stage.rank)
    # A draft head drafts on the last stage, which has the hidden states (pp_runner.py: drafts ahead).
    s = spec.config.speculative
    head = EagleHead.load(resolve_head_path(s.model), device=m.device) if runs_head(s) and spec.stage.last else None
    # So does a draft model, whole (its KV beside the stage's, the same block ids), in the target's dtype;
    # with -tp on the stage's sampling rank alone (TP rank 0, which verifies), outside its collectives.
    draft = (load_model(s.model, dtype=str(loaded.dtype).removeprefix("torch."), device=m.device)
             if s is not None and s.method == "draft" and spec.stage.last and spec.tp_rank == 0 else None)
    runner = StageRunner(loaded, spec.config, shape.num_kv_blocks, shape.max_model_len, connector=connector,
                         kv_cache_dtype=shape.kv_cache_dtype, kv_pool=shape.kv_pool, head=head, draft=draft)
    if spec.tp_rank:  # the last stage's TP rank 0 samples; its peers take its tokens with the next step
        runner.samples = False
    return runner


def _serve(runner: StageRunner, steps: zmq.Socket, reports: zmq.Socket) -> None:
    while (message := receive_pickled(steps, _POLL_MS)) is not None:
        sched, sampled, runner.head_requests, draft_kv_received = message  # auto with a head: its requests
        runner._draft_kv_received.update(draft_kv_received)  # a draft model: prompts whose draft KV came
        # The sampling rank (the last stage's TP rank 0) sampled them itself; with a draft head its
        # TP peers took them within the step (StageRunner._sampled_in_step).
        if not runner.samples and not (runner.stage.last and runner.drafter is not None):
            runner.apply_sampled(sampled)
        out = runner.execute(sched)
        if runner.samples and not sched.is_empty:
            reports.send(pickle.dumps(("output", runner.stage.rank, (runner.steps_run, out, runner.timeline,
                                                                     runner.transfer_hidden)),
                                      protocol=pickle.HIGHEST_PROTOCOL))




if __name__ == "__main__":
    sys.exit(run_without_teardown(main))  # fast_exit.py: no interpreter teardown
