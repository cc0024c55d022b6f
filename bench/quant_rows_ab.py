"""Decode-sized batches (1-32 rows) of GGUF block matmuls: where each path sits
between the weight-read floor and the arithmetic ceiling.

For each type and shape, at each row count and thread count, three paths
alternated call by call in this process (medians of ``--repeats`` rounds,
CPU time of all threads, ``time.process_time``):

* ``decode``: quant.gemv with the prefill dots moved out of reach
  (PREFILL_DOTS_FROM_ROWS huge): rowsK_512 / rows32_512 / the one-row dots;
* ``panel``: quant.gemv with the prefill dots forced from one row
  (quant_prefill_dots.h's panels of 16 weight rows);
* ``packed``: ``panel`` on the panels packed at load (quant/panels.py;
  Q4_K and Q6_K only, other types skip it): the same bits as ``panel``,
  without its per-call decoding;
* ``bf16``: the dequantized weight in bf16 through small_gemm (the
  ``--quantization none`` path on a CPU with AVX512-BF16 and no AMX), else
  torch.matmul (oneDNN).

The weights are cold: each call takes the next of enough copies to span
``--cold-mib`` (a decode step's weights do not stay in cache between steps).
Reported per path: CPU ms, the effective GB/s of weight bytes read (the
blocks; bf16's own 2 bytes a value) and GFLOP/s (2 M N K per call).

Not a test. Run:
``PYTHONPATH=src python bench/quant_rows_ab.py --sets smol 8b --rows 1 4 8 16 32``.
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
from kvferry.model import quant, small_gemm  # noqa: E402
from kvferry.model.quant import kernels, panels  # noqa: E402
from tests.model.quant.blocks import random_blocks  # noqa: E402

SETS = {"smol": [("Q4_1", 576, 576), ("Q4_1", 1536, 576), ("Q4_1", 576, 1536)],
        "lm_head": [("Q8_0", 49152, 576)],
        "8b": [(t, n, k) for t in ("Q4_K", "Q6_K") for n, k in ((4096, 4096), (14336, 4096), (4096, 14336))]}


def prefill_from(rows: int):
    """Routes the dots to the prefill kernels from ``rows`` rows (outside the timed call)."""
    def setup():
        kernels.PREFILL_DOTS_FROM_ROWS = {32: rows, 256: rows}
        kernels.configure()
    return setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", choices=sorted(SETS), default=["smol", "8b"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cold-mib", type=int, default=96)
    parser.add_argument("--paths", nargs="+", default=["decode", "panel", "bf16"])
    args = parser.parse_args()
    if not quant.available():
        sys.exit("the C++ quantized matmul is unavailable here")
    saved = dict(kernels.PREFILL_DOTS_FROM_ROWS)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    use_small = small_gemm.available(torch.bfloat16)
    print(f"kernel {quant.kernel_path()}, bf16 by {'small_gemm' if use_small else 'oneDNN'}, load {load}; "
          f"median CPU ms per call (all threads) of {args.repeats} rounds, cold weights")
    rng = np.random.default_rng(0)
    for name, n, k in [s for key in args.sets for s in SETS[key]]:
        one = torch.from_numpy(random_blocks(name, n, k, rng))
        copies = max(2, (args.cold_mib << 20) // one.numel())
        blob = one.repeat(copies, 1)
        ws = [quant.QuantizedWeight.from_blocks(f"w{i}", name, blob[i * n:(i + 1) * n], (n, k)) for i in range(copies)]
        dense = quant.dequantize_rows(ws[0], dtype=torch.bfloat16)
        dcopies = max(2, (args.cold_mib << 20) // (dense.numel() * 2))
        dense_ws = ([small_gemm.pack(dense) for _ in range(dcopies)] if use_small
                    else [dense.clone() for _ in range(dcopies)])
        bf16 = (lambda x, w: small_gemm.linear(x, w, n)) if use_small else (lambda x, w: torch.matmul(x, w.t()))
        # Copies of their own for ``packed`` (a weight's panels are found by its blocks' address).
        pblob = one.repeat(copies, 1) if "packed" in args.paths else None
        pws = [quant.QuantizedWeight.from_blocks(f"p{i}", name, pblob[i * n:(i + 1) * n], (n, k))
               for i in range(copies)] if pblob is not None else []
        packs = [panels.pack(w) for w in pws]
        fns = {"decode": (quant.gemv, ws, one.numel()), "panel": (quant.gemv, ws, one.numel()),
               "packed": (quant.gemv, pws, packs[0].numel() if packs and packs[0] is not None else one.numel()),
               "bf16": (bf16, dense_ws, dense.numel() * 2)}
        setups = {"decode": prefill_from(1 << 40), "panel": prefill_from(1), "packed": prefill_from(1),
                  "bf16": lambda: None}
        paths = [p for p in args.paths if p != "packed" or (packs and packs[0] is not None)]
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            for threads in args.thread_counts:
                torch.set_num_threads(threads)
                times: dict[str, list[float]] = {p: [] for p in paths}
                at = {p: 0 for p in paths}
                for p in paths:  # warm code and thread pool
                    fn, items, _ = fns[p]
                    setups[p]()
                    fn(x, items[0])
                for _ in range(args.repeats):
                    for p in paths:
                        fn, items, _ = fns[p]
                        w = items[at[p] % len(items)]
                        at[p] += 1
                        setups[p]()
                        c0 = time.process_time()
                        fn(x, w)
                        times[p].append(time.process_time() - c0)
                parts = []
                for p in paths:
                    t = statistics.median(times[p])
                    parts.append(f"{p} {t * 1e3:7.3f} ms {fns[p][2] / t / 1e9:5.1f} GB/s "
                                 f"{2 * m * n * k / t / 1e9:6.1f} GF/s")
                print(f"{name} {n:5d}x{k:5d} M={m:2d} t{threads}: " + " | ".join(parts), flush=True)
        del blob, ws, dense_ws, pblob, pws, packs
    kernels.PREFILL_DOTS_FROM_ROWS = saved
    kernels.configure()
    with open("/proc/loadavg") as f:
        print(f"load at the end {' '.join(f.read().split()[:3])}")


if __name__ == "__main__":
    main()
