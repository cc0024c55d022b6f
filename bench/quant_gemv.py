"""Batch-1 (and small-batch) GEMV on GGUF block weights against the weight-read floor.

For each type, a [N, K] weight (default 8192 x 2048, a 1B model's FFN
up-projection) in GGUF blocks, timed cold: the run cycles through enough
copies of it (views of one buffer) that together outgrow the L3 cache, as a
decode step's weights do. Reported per type and M:

* ``quant``: kvferry.model.quant.gemv (int8 activations, integer dots), wall
  time and CPU time per call;
* ``floor``: the weight's bytes / memory bandwidth. Bandwidth is
  bench/decode_roofline.py's: the best large-tensor copy, read + write bytes
  counted, and a read-only reduction for comparison;
* ``bf16 tiles`` (from ``--prefill-from`` rows): kvferry.model.quant.prefill (dequantized bf16 tiles, oneDNN);
* ``bf16``: torch.matmul of the dequantized weight in bf16 (oneDNN, AMX where
  present): what expanding the file at load costs per call, also cold.

Not a test. Numbers on a shared machine are indicative: best of
``--repeats`` passes over the copies, so another process's burst does not set
them. Run: ``PYTHONPATH=src python bench/quant_gemv.py [--types Q4_K Q8_0] [--m 1 4 16]``.

``--prefill 1b 8b`` times prefill-sized batches instead (``--m 64 128 512
2048``): for each type, model shape (smol: the embedded SmolLM2-135M's
576x576, 1536x576, 576x1536 and its 49152x576 lm_head; 1b: 2048x2048,
8192x2048, 2048x8192; 8b: 4096x4096, 14336x4096, 4096x14336) and M, the integer dots
(``quant.gemv``: quant_prefill_dots.h's kernel from
``kernels.PREFILL_DOTS_FROM_ROWS`` rows) against the bf16 tiles
(``quant.prefill``), alternated call by call in this process, one warm weight
(prefill is compute-bound), at each of ``--thread-counts``. Reported: median
CPU ms per call (all threads, ``time.process_time``) and the median of the
pairs' ratios tiles / dots (above 1: the dots are faster).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.model.quant.blocks, decode_roofline
from bench.decode_roofline import copy_bandwidth, read_bandwidth  # noqa: E402
from kvferry.model import quant  # noqa: E402
from tests.model.quant.blocks import random_blocks  # noqa: E402


def best_pass(fn, items, repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call: the best of ``repeats`` passes calling fn
    on every item. CPU time (all threads) is what a loaded machine cannot
    inflate: divided by the thread count it is about the wall time unloaded."""
    for item in items[:2]:
        fn(item)  # warm the code and the thread pool
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for item in items:
            fn(item)
        best = min(best, (time.perf_counter() - t0) / len(items))
        best_cpu = min(best_cpu, (time.process_time() - c0) / len(items))
    return best, best_cpu


PREFILL_SHAPES = {"smol": [(576, 576), (1536, 576), (576, 1536), (49152, 576)],  # the embedded model, its lm_head
                  "1b": [(2048, 2048), (8192, 2048), (2048, 8192)],
                  "8b": [(4096, 4096), (14336, 4096), (4096, 14336)]}


def prefill_ab(args: argparse.Namespace) -> None:
    """Dots against tiles at prefill sizes, interleaved (see the module's doc)."""
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"kernel {quant.kernel_path()}, prefill dots from {quant.kernels.PREFILL_DOTS_FROM_ROWS} rows, "
          f"load {load}; median CPU ms per call (all threads) of {args.repeats} pairs")
    rng = np.random.default_rng(0)
    for name in args.types:
        for model in args.prefill:
            for n, k in PREFILL_SHAPES[model]:
                w = quant.QuantizedWeight.from_blocks("w", name, torch.from_numpy(random_blocks(name, n, k, rng)), (n, k))
                for m in args.m:
                    x = torch.randn(m, k).bfloat16()
                    for threads in args.thread_counts:
                        torch.set_num_threads(threads)
                        quant.gemv(x, w), quant.prefill(x, w)  # warm both
                        dots, tiles = [], []
                        for _ in range(args.repeats):
                            for fn, out in ((quant.gemv, dots), (quant.prefill, tiles)):
                                c0 = time.process_time()
                                fn(x, w)
                                out.append(time.process_time() - c0)
                        ratio = statistics.median(t / d for d, t in zip(dots, tiles))
                        print(f"{name} {model} {n:5d}x{k:5d} M={m:4d} threads {threads}: dots "
                              f"{statistics.median(dots) * 1e3:8.1f} | tiles {statistics.median(tiles) * 1e3:8.1f} | "
                              f"tiles / dots {ratio:4.2f}x", flush=True)
    with open("/proc/loadavg") as f:
        print(f"load at the end {' '.join(f.read().split()[:3])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q8_0"])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--cold-mib", type=int, default=640, help="bytes the copies of each weight span")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--prefill-from", type=int, default=16, help="also time the prefill path from this M")
    parser.add_argument("--prefill", nargs="+", choices=sorted(PREFILL_SHAPES), default=[],
                        help="dots against tiles at these models' shapes (prefill-sized --m)")
    parser.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2], help="with --prefill")
    args = parser.parse_args()
    if args.prefill:
        if not quant.available():
            sys.exit("the C++ quantized matmul is unavailable here")
        return prefill_ab(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not quant.available():
        sys.exit("the C++ quantized matmul is unavailable here")
    copy_bw, read_bw = copy_bandwidth(), read_bandwidth()
    print(f"threads {torch.get_num_threads()}, kernel {quant.kernel_path()}, "
          f"copy bandwidth {copy_bw / 1e9:.1f} GB/s (read+write), read {read_bw / 1e9:.1f} GB/s")
    rng = np.random.default_rng(0)
    for name in args.types:
        one = torch.from_numpy(random_blocks(name, args.n, args.k, rng))
        copies = max(2, (args.cold_mib << 20) // one.numel())
        blob = one.repeat(copies, 1)  # one buffer; each copy a view of its rows
        weights = [quant.QuantizedWeight.from_blocks(f"w{i}", name, blob[i * args.n:(i + 1) * args.n],
                                                     (args.n, args.k)) for i in range(copies)]
        dense = quant.dequantize_rows(weights[0], dtype=torch.bfloat16)
        dense_copies = [dense.clone() for _ in range(max(2, (args.cold_mib << 20) // (dense.numel() * 2)))]
        floor = one.numel() / copy_bw
        print(f"{name} {args.n}x{args.k}: {one.numel() / 2**20:.1f} MiB ({copies} copies cold), "
              f"bf16 {dense.numel() * 2 / 2**20:.1f} MiB; floor {floor * 1e3:.3f} ms "
              f"({one.numel() / read_bw * 1e3:.3f} ms at the read bandwidth)")
        for m in args.m:
            x = torch.randn(m, args.k)
            t_q, c_q = best_pass(lambda w: quant.gemv(x, w), weights, args.repeats)
            xb = x.bfloat16()
            t_b, c_b = best_pass(lambda w: torch.matmul(xb, w.t()), dense_copies, args.repeats)
            line = (f"  M={m:3d}: quant {t_q * 1e3:7.3f} ms = {t_q / floor:5.2f}x floor | bf16 {t_b * 1e3:7.3f} ms "
                    f"| quant {t_b / t_q:4.2f}x faster | CPU ms/call quant {c_q * 1e3:6.2f} bf16 {c_b * 1e3:6.2f}")
            if m >= args.prefill_from:
                t_p, c_p = best_pass(lambda w: quant.prefill(x, w), weights[:8], 2)
                line += f" | bf16 tiles {t_p * 1e3:6.2f} ms (CPU {c_p * 1e3:6.2f})"
            print(line)
        del blob, weights, dense_copies


if __name__ == "__main__":
    main()
