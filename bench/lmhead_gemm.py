"""The quantized lm_head (``quant.linear``, as GGUFLinearMethod calls it) at
small row counts against torch.matmul of the same table expanded to bf16.

The embedded model's vocabulary shape (49152 x 576) by default, in the
given GGUF types, timed cold as bench/quant_gemv.py does: the run cycles
through enough copies of each weight (views of one buffer; clones for bf16)
that together outgrow the L3 cache, as a decode step's weights do. Per M it
reports the path ``quant.linear`` takes, its wall and CPU time per call, the
bf16 matmul's, and their ratio (above 1: the quantized head is slower).

Not a test; numbers on a shared machine are indicative (best of
``--repeats`` passes). Run:
``PYTHONPATH=src python bench/lmhead_gemm.py --threads 1 [--types Q4_1 Q8_0] [--m 1 4 16 32 64]``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.quant_gemv, tests.model.quant.blocks
from bench.quant_gemv import best_pass  # noqa: E402
from kvferry.model import quant  # noqa: E402
from kvferry.model.quant import kernels  # noqa: E402
from tests.model.quant.blocks import random_blocks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0"])
    parser.add_argument("--n", type=int, default=49152)
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--cold-mib", type=int, default=640, help="bytes the copies of each weight span")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not quant.available():
        sys.exit("the C++ quantized matmul is unavailable here")
    print(f"threads {torch.get_num_threads()}, kernel {quant.kernel_path()}")
    rng = np.random.default_rng(0)
    for name in args.types:
        one = torch.from_numpy(random_blocks(name, args.n, args.k, rng))
        copies = max(2, (args.cold_mib << 20) // one.numel())
        blob = one.repeat(copies, 1)
        weights = [quant.QuantizedWeight.from_blocks(f"w{i}", name, blob[i * args.n:(i + 1) * args.n],
                                                     (args.n, args.k)) for i in range(copies)]
        dense = quant.dequantize_rows(weights[0], dtype=torch.bfloat16)
        dense_copies = [dense.clone() for _ in range(max(2, (args.cold_mib << 20) // (dense.numel() * 2)))]
        print(f"{name} {args.n}x{args.k}: {one.numel() / 2**20:.1f} MiB x {copies} cold, "
              f"bf16 {dense.numel() * 2 / 2**20:.1f} MiB x {len(dense_copies)}")
        for m in args.m:
            x = torch.randn(m, args.k).bfloat16()
            t_q, c_q = best_pass(lambda w: quant.linear(x, w), weights, args.repeats)
            t_b, c_b = best_pass(lambda w: torch.matmul(x, w.t()), dense_copies, args.repeats)
            path = kernels.path_for(m, weights[0]) if hasattr(kernels, "path_for") else "?"  # older trees
            print(f"  M={m:3d} [{path:6s}]: quant {t_q * 1e3:7.2f} ms "
                  f"(CPU {c_q * 1e3:7.2f}) | bf16 {t_b * 1e3:7.2f} ms (CPU {c_b * 1e3:7.2f}) "
                  f"| quant/bf16 {t_q / t_b:4.2f}x (CPU {c_q / c_b:4.2f}x)")
        del blob, weights, dense_copies


if __name__ == "__main__":
    main()
