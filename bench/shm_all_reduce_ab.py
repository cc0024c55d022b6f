"""One decode row's all-reduce between two ranks, Python's ShmAllReduce
against the C++ ShmSums it attaches (layer_op.shm_sums), interleaved in
blocks within the same two processes: wall and thread CPU per call,
medians of the blocks' means. ``--work-us`` puts that much busy work
(a bf16 matmul row) before each call, as a layer's matmuls do.

    python bench/shm_all_reduce_ab.py [--blocks 20] [--calls 200] [--rows 1] [--work-us 0]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvferry.model import layer_op
from kvferry.parallel import ShmAllReduce, launch


def rank_fn(group, blocks: int, calls: int, rows: int, work: int) -> dict:  # noqa: ANN001
    torch.set_num_threads(1)
    shm = ShmAllReduce(group)
    native = layer_op.shm_sums(shm)
    x = torch.randn(rows, 2048).bfloat16()
    w = torch.randn(work, 2048).bfloat16() if work else None
    out: dict[str, list[tuple[float, float]]] = {"python": [], "cpp": []}
    for b in range(2 * blocks):
        mode = "python" if b % 2 == 0 else "cpp"
        shm.native = native if mode == "cpp" else None
        shm.barrier()
        spent_w = spent_c = 0.0
        for _ in range(calls):
            if w is not None:
                torch.mv(w, x[0])  # the busy work before a sum
            y = x.clone()
            t0, c0 = time.perf_counter(), time.thread_time()
            shm.all_reduce(y)
            spent_w += time.perf_counter() - t0
            spent_c += time.thread_time() - c0
        out[mode].append((spent_w / calls, spent_c / calls))
    shm.native = None
    shm.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--work-us", type=int, default=0, help="rows of a [rows, 2048] bf16 matrix-vector product")
    args = p.parse_args()
    with open("/proc/loadavg") as f:
        before = " ".join(f.read().split()[:3])
    res = launch(rank_fn, 2, args=(args.blocks, args.calls, args.rows, args.work_us), timeout_s=120)
    with open("/proc/loadavg") as f:
        after = " ".join(f.read().split()[:3])
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load {before} before, "
          f"{after} after; [{args.rows}, 2048] bf16, {args.blocks} blocks of {args.calls} calls each way, "
          f"work {args.work_us} rows")
    summary = {}
    for r, o in enumerate(res):
        for mode in ("python", "cpp"):
            wall = statistics.median(v[0] for v in o[mode]) * 1e6
            cpu = statistics.median(v[1] for v in o[mode]) * 1e6
            summary[f"rank{r}_{mode}"] = {"wall_us": round(wall, 1), "cpu_us": round(cpu, 1)}
            print(f"rank {r} {mode:6s}: wall {wall:8.1f} us  cpu {cpu:8.1f} us per call (median of block means)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
