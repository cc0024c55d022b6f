"""Batch-1 K-quant dots on a 1B model's shapes: CPU time per call and GB/s of weight bytes.

The decode step's batch-1 matmuls (Q4_K_M: Q4_K for most weights, Q6_K for
some and the lm_head) through kvferry.model.quant.gemv at M = 1, each weight
cold: the run cycles through copies of it that together outgrow the L3 cache,
as a step's weights do. Per shape and thread count: the median over
``--passes`` passes of the CPU ms per call (all threads, time.process_time:
a loaded machine inflates wall time, much less CPU time), and the weight
bytes per CPU second of one thread (GB/s), against the read floor (a large
reduction's bandwidth, wall time, so loaded it is low).

``--ab``: in the same process, each pass alternates the blocks with copies
whose Q4_K / Q6_K panels are packed (quant/panels.py: the one-row dots then
read the packed panels, same bits), and prints the ratio packed / blocks of
the medians.

For an A/B of two builds, run this file with each build's source on
PYTHONPATH in turn, several rounds (``--rounds`` inside each run, the runs
themselves alternated), and compare the medians.

Run: ``PYTHONPATH=src python bench/gguf_b1_dots.py [--threads 1 2] [--passes 15]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.model.quant.blocks
from kvferry.model import quant  # noqa: E402
from tests.model.quant.blocks import random_blocks  # noqa: E402

# (type, N, K, what): a 1B Llama's batch-1 weights (q/o, gate/up, down, k/v, lm_head).
SHAPES = [("Q4_K", 2048, 2048, "q/o"), ("Q4_K", 8192, 2048, "gate/up"), ("Q4_K", 2048, 8192, "down"),
          ("Q4_K", 512, 2048, "k/v"), ("Q6_K", 2048, 8192, "down (Q6_K)"), ("Q6_K", 49152, 2048, "lm_head")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--cold-mib", type=int, default=160, help="bytes the copies of each weight span")
    parser.add_argument("--only", nargs="+", default=[], help="only the shapes whose NxK (e.g. 8192x2048) is listed")
    parser.add_argument("--ab", action="store_true", help="blocks vs packed panels, interleaved passes")
    parser.add_argument("--floor", action="store_true", help="also measure the read bandwidth (wall time)")
    args = parser.parse_args()
    if not quant.available():
        sys.exit("the C++ quantized matmul is unavailable here")
    if args.floor:
        from bench.decode_roofline import read_bandwidth
        print(f"read bandwidth {read_bandwidth() / 1e9:.1f} GB/s (wall, best of 7)")
    rng = np.random.default_rng(0)
    print(f"kernel {quant.kernel_path()}")
    for name, n, k, what in SHAPES:
        if args.only and f"{n}x{k}" not in args.only:
            continue
        one = torch.from_numpy(random_blocks(name, n, k, rng))
        copies = max(2, (args.cold_mib << 20) // one.numel())
        blob = one.repeat(copies, 1)
        weights = [quant.QuantizedWeight.from_blocks(f"w{i}", name, blob[i * n:(i + 1) * n], (n, k))
                   for i in range(copies)]
        x = torch.randn(1, k)
        if args.ab:
            _ab(name, n, k, what, one, weights, x, args)
            del blob, weights
            continue
        for threads in args.threads:
            torch.set_num_threads(threads)
            for w in weights[:2]:
                quant.gemv(x, w)
            per_call = []
            for _ in range(args.passes):
                c0 = time.process_time()
                for w in weights:
                    quant.gemv(x, w)
                per_call.append((time.process_time() - c0) / len(weights))
            med = statistics.median(per_call)
            print(f"{name} {n}x{k} ({what}) t={threads}: CPU {med * 1e3:.4f} ms/call, "
                  f"{one.numel() / med / 1e9:.2f} GB/s per CPU-second ({one.numel() / 2**20:.2f} MiB)", flush=True)
        del blob, weights


def _ab(name, n, k, what, one, weights, x, args) -> None:
    """Blocks vs packed panels: a second set of cold copies, packed; passes alternate."""
    from kvferry.model.quant import panels
    blob2 = torch.stack([w.data for w in weights]).clone()
    packed_ws = [quant.QuantizedWeight.from_blocks(f"p{i}", name, blob2[i], (n, k)) for i in range(len(weights))]
    keep = [panels.pack(w) for w in packed_ws]
    assert all(p is not None for p in keep)
    assert torch.equal(quant.gemv(x, weights[0]), quant.gemv(x, packed_ws[0]))
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = {"blocks": [], "packed": []}
        for _ in range(args.passes):
            for label, ws in (("blocks", weights), ("packed", packed_ws)):
                c0 = time.process_time()
                for w in ws:
                    quant.gemv(x, w)
                times[label].append((time.process_time() - c0) / len(ws))
        b, p = statistics.median(times["blocks"]), statistics.median(times["packed"])
        print(f"{name} {n}x{k} ({what}) t={threads}: CPU ms/call blocks {b * 1e3:.4f} packed {p * 1e3:.4f} "
              f"packed/blocks {p / b:.3f} ({one.numel() / 2**20:.2f} MiB)", flush=True)


if __name__ == "__main__":
    main()
