"""Per-phase timers for a tensor-parallel decode step, in every rank
(bench/tp_step_profile.py puts this folder on the ranks' PYTHONPATH and sets
TP_STEP_PROFILE to the folder the ranks write their records to; unset, this
does nothing). Each rank records, per ModelRunner.execute, wall and thread
CPU seconds of: the C++ layer halves, the all-reduce's copy / wait / add,
the logits' all-gather, the step's message (rank 0: publish; a worker: its
wait on the socket and the unpickle), and the whole execute."""
from __future__ import annotations

import atexit
import json
import os
import time

_OUT = os.environ.get("TP_STEP_PROFILE")
_records: list[dict] = []
_cur: dict[str, list[float]] = {}
_rank = [-1]


def _add(name: str, wall: float, cpu: float) -> None:
    v = _cur.setdefault(name, [0.0, 0.0, 0])
    v[0] += wall
    v[1] += cpu
    v[2] += 1


def _timed(name: str, fn):  # noqa: ANN001, ANN202
    def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
        w, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            _add(name, time.perf_counter() - w, time.thread_time() - c)
    return wrapper


def install() -> None:
    import torch

    from kvferry.engine import rank_group, runner, tp_ranks
    from kvferry.model import layer_op
    from kvferry.parallel import shm_all_reduce

    shm = shm_all_reduce.ShmAllReduce
    orig_exchange, orig_wait, orig_reduce, orig_gather = shm._exchange, shm._wait, shm._reduce_chunk, shm.all_gather
    state = {"in_gather": False}

    def wait(self, seq, name):  # noqa: ANN001, ANN202
        w, c = time.perf_counter(), time.thread_time()
        try:
            return orig_wait(self, seq, name)
        finally:
            _add("gather_wait" if state["in_gather"] else "ar_wait", time.perf_counter() - w, time.thread_time() - c)

    def exchange(self, x, name):  # noqa: ANN001, ANN202
        w, c = time.perf_counter(), time.thread_time()
        try:
            return orig_exchange(self, x, name)
        finally:
            _add("gather_exchange" if state["in_gather"] else "ar_exchange", time.perf_counter() - w,
                 time.thread_time() - c)

    def gather(self, tensor, dim=0):  # noqa: ANN001, ANN202
        state["in_gather"] = True
        w, c = time.perf_counter(), time.thread_time()
        try:
            return orig_gather(self, tensor, dim)
        finally:
            state["in_gather"] = False
            _add("gather_total", time.perf_counter() - w, time.thread_time() - c)

    shm._wait, shm._exchange, shm._reduce_chunk, shm.all_gather = wait, exchange, _timed("ar_total", orig_reduce), gather

    ops = torch.ops.kvferry_layer
    add_rms_norm = layer_op.add_rms_norm

    def run_tp_layer(args, h, x, cos, sin, kv_cache_layer, meta, shard):  # noqa: ANN001, ANN202
        w, c = time.perf_counter(), time.thread_time()
        o = ops.tp_attention(x, cos, sin, kv_cache_layer, meta.slot_mapping, meta.kernel_block_tables,
                             meta.kernel_seq_lens, meta.kernel_query_starts, meta.kernel_query_lens,
                             meta.kernel_tree_masks, *args.attention())
        _add("cpp_attention", time.perf_counter() - w, time.thread_time() - c)
        o = shard.all_reduce(o)
        w, c = time.perf_counter(), time.thread_time()
        h, d = ops.tp_mlp(o, h, *args.mlp())
        _add("cpp_mlp", time.perf_counter() - w, time.thread_time() - c)
        d = shard.all_reduce(d)
        w, c = time.perf_counter(), time.thread_time()
        out = add_rms_norm(d, h, args.next_norm_w, args.next_eps)
        _add("add_rms_norm", time.perf_counter() - w, time.thread_time() - c)
        return out

    layer_op.run_tp_layer = _timed("tp_layer_total", run_tp_layer)
    if hasattr(layer_op, "run_tp_layers"):  # every layer in one C++ call, the sums inside
        layer_op.run_tp_layers = _timed("tp_layers_cpp", layer_op.run_tp_layers)
    shm.all_reduce = _timed("all_reduce_call", shm.all_reduce)

    orig_execute = runner.ModelRunner.execute

    def execute(self, sched):  # noqa: ANN001, ANN202
        global _cur
        _rank[0] = getattr(getattr(self.model, "shard", None), "rank", 0)
        w, c = time.perf_counter(), time.thread_time()
        out = orig_execute(self, sched)
        _add("execute", time.perf_counter() - w, time.thread_time() - c)
        _cur["tokens"] = [float(sched.total_num_scheduled_tokens), 0.0, 1]
        _records.append(_cur)
        _cur = {}
        return out

    runner.ModelRunner.execute = execute
    tp_ranks.TPLeader.publish = _timed("publish", tp_ranks.TPLeader.publish)
    rank_group.receive_pickled = _timed("receive", rank_group.receive_pickled)

    def dump() -> None:
        if _records:
            with open(os.path.join(_OUT, f"rank{_rank[0]}-{os.getpid()}.json"), "w") as f:
                json.dump(_records, f)

    atexit.register(dump)


if _OUT:
    install()
