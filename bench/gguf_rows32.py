"""The 32-block types' small-batch paths, one matmul at a time: the integer
dots against the dequantized bf16 tiles (and against an older build of the
dots, ``--baseline REV``), at each batch size.

For each shape and type, random blocks (tests/model/quant/blocks.py), cold:
each timed pass calls every one of enough copies of the weight to outgrow
the L3 cache (``--cold-mib``), as a decode step streams its weights. bf16 x
of M rows, as the model passes it; the C++ ``linear`` with the path forced:

* ``dots``: the integer dot products of this tree's library;
* ``base``: the same from ``git show REV:src/kvferry/model/csrc/quant_gemm.cpp``,
  built beside it under another op namespace (``--baseline REV``);
* ``tiles``: the dequantized bf16 tiles and oneDNN (quant/kernels.py's sizes).

The methods alternate pass by pass (A B C A B C ...), so each sees about the
same load; reported are medians over ``--repeats`` passes of the CPU time per
call of all threads (``time.process_time``), which other processes on a
shared machine inflate least. Not a test.

    PYTHONPATH=src python bench/gguf_rows32.py [--shapes q41 1b] [--types Q8_0 Q4_1]
        [--rows 1 4 8 12 16 20 24 32] [--threads 1 2] [--only 49152x576 8192x2048] [--baseline HEAD~1]

``q41``: the embedded SmolLM2-135M's shapes in its file's types (Q4_1 layers,
the Q8_0 lm_head); ``1b``: 1B shapes in each of ``--types``.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.model.quant.blocks
from kvferry.model import paged_kernel, quant  # noqa: E402
from kvferry.model.quant import kernels  # noqa: E402
from tests.model.quant.blocks import random_blocks  # noqa: E402

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8}
# (N, K) of each model's matmuls: the embedded SmolLM2-135M (hidden 576, FFN
# 1536), in its file's types (Q4_1, the lm_head Q8_0), and a 1B model's, in --types.
SHAPES = {"q41": [(576, 576), (1536, 576), (576, 1536), (49152, 576)],
          "1b": [(2048, 2048), (8192, 2048), (2048, 8192)]}
NEVER = 1 << 62


def load_baseline(rev: str) -> object:
    """The library as it was at ``rev``, as torch.ops.kvferry_quant_base."""
    repo = Path(__file__).resolve().parent.parent
    src = subprocess.run(["git", "show", f"{rev}:src/kvferry/model/csrc/quant_gemm.cpp"], cwd=repo, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="kvferry_quant_base_")) / "quant_gemm_base.cpp"
    path.write_text(src.replace("TORCH_LIBRARY(kvferry_quant,", "TORCH_LIBRARY(kvferry_quant_base,"))
    if not paged_kernel.try_load_library("kvferry_quant_base", path, kernels._cflags(), "the baseline", "nothing"):
        sys.exit(f"the baseline at {rev} did not build")
    return torch.ops.kvferry_quant_base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["q41", "1b"], choices=list(SHAPES))
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_1"], choices=list(TYPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 16, 20, 24, 32])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cold-mib", type=int, default=96, help="bytes the copies of each weight span (past L3)")
    ap.add_argument("--only", nargs="+", default=None, metavar="NxK", help="only these shapes, e.g. 49152x576")
    ap.add_argument("--baseline", default=None, metavar="REV", help="also time the dots of the library at REV")
    args = ap.parse_args()
    if not quant.available():
        sys.exit("the C++ quantized matmul is unavailable here")
    ops = {"dots": torch.ops.kvferry_quant}
    if args.baseline:
        ops["base"] = load_baseline(args.baseline)
    tile_args = (kernels.PREFILL_TILE_BYTES, kernels.SMALL_TILE_BYTES, kernels.SMALL_TILE_MAX_ROWS,
                 kernels.TRANSPOSED_MAX_ROWS)
    rng = np.random.default_rng(0)
    print(f"kernel path {quant.kernel_path()}; CPU ms per call, medians of {args.repeats} interleaved passes")
    for shape_set in args.shapes:
        for n, k in SHAPES[shape_set]:
            if args.only and f"{n}x{k}" not in args.only:
                continue
            # The embedded model's types as its file has them (Q4_1 layers, a Q8_0 lm_head).
            types = args.types if shape_set == "1b" else ["Q8_0"] if n == 49152 else ["Q4_1"]
            for name in types:
                t = TYPES[name]
                one = torch.from_numpy(random_blocks(name, n, k, rng))
                copies = [one] + [one.clone() for _ in range(max(1, (args.cold_mib << 20) // one.numel()))]
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    for m in args.rows:
                        x = torch.randn(m, k).bfloat16()
                        calls = {label: (lambda w, op=op: op.linear(x, w, t, n, NEVER, *tile_args))
                                 for label, op in ops.items()}
                        calls["tiles"] = lambda w: torch.ops.kvferry_quant.linear(x, w, t, n, 0, *tile_args)
                        got: dict[str, list[float]] = {label: [] for label in calls}
                        for fn in calls.values():
                            fn(copies[0])  # warm the code, the pool, the tile buffer
                        for _ in range(args.repeats):
                            for label, fn in calls.items():
                                c0 = time.process_time()
                                for w in copies:
                                    fn(w)
                                got[label].append((time.process_time() - c0) / len(copies) * 1e3)
                        med = {label: statistics.median(v) for label, v in got.items()}
                        cells = "  ".join(f"{label} {v:6.2f}" for label, v in med.items())
                        ratio = med["dots"] / med["tiles"]
                        base = f"  dots/base {med['dots'] / med['base']:.2f}" if "base" in med else ""
                        print(f"{name} {n}x{k} threads {threads} rows {m:2d}: {cells}  dots/tiles {ratio:.2f}{base}",
                              flush=True)


if __name__ == "__main__":
    main()
