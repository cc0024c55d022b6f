"""Sequence-parallel norms against the all-reduce, between two ranks (issue 47).

A TP rank's layer sums its row-parallel product (o_proj's, down_proj's) over
the ranks, then every rank runs the same residual add and RMSNorm on every
row (``tp_decoder_layers``: ``ShmSums.all_reduce_``, then ``add_rms_norm``).
Sequence parallelism (Megatron's, vLLM's sequence-parallelism pass) splits
that into a reduce-scatter, the add and norm on this rank's share of the rows
only (the residual stream stays split between the ranks), and an all-gather
of the normed rows the next matmul needs in full: half the add and norm
work a rank, for a second exchange (two waits for the peer instead of one)
and the copies of the gather.

Both run here in C++ over the same shared-memory slots as the shipped
ShmSums (csrc/shm_sums.h, built into a small extension of this bench), with
the shipped fused ``add_rms_norm``, on [rows, 2048] bf16 (rank 0 of TP 2 at
c16 sees [16, 2048]), ``--work-us`` of busy work before each (a layer's
matmuls: the ranks arrive at slightly different times, as in a step):

- ``all_reduce``: all_reduce_(o); add_rms_norm(o, h) on every row;
- ``sequence_parallel``: o into this rank's slot and the wait (the
  reduce-scatter's exchange); its rows' sum of the two slots; add_rms_norm
  of those rows with its rows of h; the normed rows into the slot and the
  wait (the all-gather); the peer's rows copied beside its own.

Blocks of ``--calls`` calls alternate between the two in both processes;
medians of the blocks' means of wall and thread CPU time per call.

    python bench/tp_sequence_parallel_ab.py [--rows 16] [--blocks 20] [--calls 200] [--work-us 200]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from kvferry.model import fused_ops
from kvferry.parallel import ShmAllReduce, launch

CSRC = Path(__file__).resolve().parents[1] / "src" / "kvferry" / "model" / "csrc"

SOURCE = r"""
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ATen.h>
#include <chrono>
namespace { using at::Tensor; }  // shm_sums.h names it as decoder_layer.cpp declares it
#include "shm_sums.h"

namespace {
using Norm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
const c10::TypedOperatorHandle<Norm>& norm_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kvferry_fused::add_rms_norm", "").typed<Norm>();
  return op;
}

void spin_us(int64_t us) {  // the layer's other work before the sum
  const int64_t end = now_ns() + us * 1000;
  while (now_ns() < end) {}
}
}  // namespace

// calls x (all_reduce_(o); add_rms_norm over every row), o refilled from partial each call.
at::Tensor all_reduce_norm(at::Tensor flags, at::Tensor data, int64_t rank, int64_t slot_bytes,
                           std::vector<int64_t> pids, at::Tensor partial, at::Tensor h, at::Tensor w, double eps,
                           int64_t calls, int64_t work_us) {
  ShmSums sums(flags, data, rank, slot_bytes, pids, 60.0);
  at::Tensor o = at::empty_like(partial), x;
  for (int64_t i = 0; i < calls; ++i) {
    spin_us(work_us);
    o.copy_(partial);
    sums.all_reduce_(o);
    auto [h1, x1] = norm_op().call(o, h, w, eps);
    x = x1;
  }
  return x;
}

// calls x (reduce-scatter, add_rms_norm over this rank's rows, all-gather of the normed rows).
at::Tensor sequence_parallel_norm(at::Tensor flags, at::Tensor data, int64_t rank, int64_t slot_bytes,
                                  std::vector<int64_t> pids, at::Tensor partial, at::Tensor h, at::Tensor w,
                                  double eps, int64_t calls, int64_t work_us) {
  ShmSums sums(flags, data, rank, slot_bytes, pids, 60.0);
  TORCH_CHECK(sums.world == 2 && partial.size(0) % 2 == 0, "two ranks, an even number of rows");
  const int64_t T = partial.size(0), half = T / 2, start = rank * half;
  at::Tensor o = at::empty_like(partial), x = at::empty_like(partial);
  const at::Tensor h_mine = h.narrow(0, start, half).contiguous();  // the residual stays split
  for (int64_t i = 0; i < calls; ++i) {
    spin_us(work_us);
    o.copy_(partial);
    const int64_t seq = sums.exchange(o, "reduce_scatter");
    const at::Tensor mine = sums.slot_view(seq, rank, o).view(o.sizes()).narrow(0, start, half);
    const at::Tensor peer = sums.slot_view(seq, 1 - rank, o).view(o.sizes()).narrow(0, start, half);
    at::Tensor s = at::add(mine, peer);
    auto [h1, x1] = norm_op().call(s, h_mine, w, eps);
    const int64_t seq2 = sums.exchange(x1, "all_gather");
    x.narrow(0, start, half).copy_(x1);
    x.narrow(0, (1 - rank) * half, half).copy_(sums.slot_view(seq2, 1 - rank, x1).view(x1.sizes()));
  }
  return x;
}
"""


def build():  # noqa: ANN201
    from torch.utils.cpp_extension import load_inline

    return load_inline("tp_sequence_parallel_ab", cpp_sources=SOURCE, functions=["all_reduce_norm",
                       "sequence_parallel_norm"], extra_include_paths=[str(CSRC)],
                       extra_cflags=["-O3", "-march=native"], verbose=False)


def rank_fn(group, blocks: int, calls: int, rows: int, work_us: int) -> dict:  # noqa: ANN001
    torch.set_num_threads(1)
    assert fused_ops.fused_ops_available()
    ext = build()
    shm = ShmAllReduce(group)
    flags, data, rank, slot, pids, _ = shm.segment()
    gen = torch.Generator().manual_seed(rank)
    partial = torch.randn(rows, 2048, generator=gen).bfloat16()
    h = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(9)).bfloat16()
    w = torch.rand(2048, generator=torch.Generator().manual_seed(7)).bfloat16()
    fns = {"all_reduce": ext.all_reduce_norm, "sequence_parallel": ext.sequence_parallel_norm}
    outs = {}
    for name, fn in fns.items():  # the same bits? (not expected: the sum is the same, the norm's rows too)
        shm.barrier()
        outs[name] = fn(flags, data, rank, slot, pids, partial, h, w, 1e-5, 1, 0)
    out: dict = {name: [] for name in fns}
    out["same"] = bool(torch.equal(outs["all_reduce"], outs["sequence_parallel"]))
    for b in range(2 * blocks):
        name = "all_reduce" if b % 2 == 0 else "sequence_parallel"
        shm.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        fns[name](flags, data, rank, slot, pids, partial, h, w, 1e-5, calls, work_us)
        out[name].append(((time.perf_counter() - t0) / calls, (time.thread_time() - c0) / calls))
    shm.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--work-us", type=int, default=200, help="busy work before each sum (a layer's matmuls)")
    args = p.parse_args()
    build()  # once here, so the ranks find it built
    with open("/proc/loadavg") as f:
        before = " ".join(f.read().split()[:3])
    res = launch(rank_fn, 2, args=(args.blocks, args.calls, args.rows, args.work_us), timeout_s=600)
    with open("/proc/loadavg") as f:
        after = " ".join(f.read().split()[:3])
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load {before} before, "
          f"{after} after; [{args.rows}, 2048] bf16, {args.blocks} blocks of {args.calls} calls each way, "
          f"work {args.work_us} us a call (included below)")
    for r, o in enumerate(res):
        base = None
        for name in ("all_reduce", "sequence_parallel"):
            wall = statistics.median(v[0] for v in o[name]) * 1e6
            cpu = statistics.median(v[1] for v in o[name]) * 1e6
            base = base or (wall, cpu)
            print(f"rank {r} {name:17s}: wall {wall:8.1f} us ({wall / base[0]:.3f}x)  cpu {cpu:8.1f} us "
                  f"({cpu / base[1]:.3f}x) per call, medians of block means; same bits as the all-reduce: {o['same']}")


if __name__ == "__main__":
    main()
