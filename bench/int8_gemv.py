"""int8 weights (W8A8) against bf16 on one linear weight, small batches, cold.

A [N, K] weight (default 8192 x 2048, a 1B model's FFN up-projection):

* ``int8``: kvferry.model.int8_gemm.gemm (x quantized per row, integer dot
  products: csrc/int8_gemm.cpp), what ``--quantization int8`` runs;
* ``bf16``: the same weight in bf16 through kvferry's own float path
  (model/linear.py: packed once, small_gemm's or oneDNN's kernel), what the
  unquantized model runs;
* ``_int_mm``: torch._int_mm on the same int8 operands (oneDNN's int8
  GEMM), for comparison;
* ``floor``: the int8 weight's bytes / memory bandwidth (bench/decode_roofline.py's
  copy bandwidth, read + write bytes counted).

Cold, as a decode step's weights are: each timing cycles through enough
copies of the weight that together outgrow the L3 cache (bench/quant_gemv.py's
method, best of ``--repeats`` passes; CPU time is printed too, which another
process's load inflates less). Not a test. Run:
``PYTHONPATH=src python bench/int8_gemv.py [--m 1 4 16 64]``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode_roofline import copy_bandwidth  # noqa: E402
from bench.quant_gemv import best_pass  # noqa: E402
from kvferry.model import int8_gemm  # noqa: E402
from kvferry.model.cpu_features import cpu_features  # noqa: E402
from kvferry.model.linear import linear, pack_weight  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--cold-mib", type=int, default=640, help="bytes the copies of each weight span")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--int-mm", action="store_true", help="also time torch._int_mm")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not int8_gemm.available():
        sys.exit("the C++ int8 matmul is unavailable here")
    copy_bw = copy_bandwidth()
    print(f"{cpu_features().describe()}; threads {torch.get_num_threads()}, kernel {int8_gemm.kernel_path()}, "
          f"copy bandwidth {copy_bw / 1e9:.1f} GB/s (read+write)")
    w = torch.randn(args.n, args.k) * 0.02
    iw = int8_gemm.quantize_weight(w)
    copies = max(2, (args.cold_mib << 20) // iw.qweight.numel())
    q8 = [(iw.qweight.clone(), iw.scale.clone(), int8_gemm.row_sums(iw.qweight)) for _ in range(copies)]
    wb = w.bfloat16()
    packed = [(wb, pack_weight(wb)) for _ in range(max(2, (args.cold_mib << 20) // (wb.numel() * 2)))]
    floor = iw.qweight.numel() / copy_bw
    print(f"{args.n}x{args.k}: int8 {iw.qweight.numel() / 2**20:.1f} MiB ({copies} copies cold), "
          f"bf16 {wb.numel() * 2 / 2**20:.1f} MiB ({len(packed)} copies); int8 floor {floor * 1e3:.3f} ms, "
          f"bf16 floor {2 * floor * 1e3:.3f} ms")
    for m in args.m:
        x = torch.randn(m, args.k).bfloat16()
        t8, c8 = best_pass(lambda c: int8_gemm.gemm(x, *c), q8, args.repeats)
        tb, cb = best_pass(lambda p: linear(x, p[0], None, p[1]), packed, args.repeats)
        line = (f"  M={m:3d}: int8 {t8 * 1e3:7.3f} ms = {t8 / floor:5.2f}x floor | bf16 {tb * 1e3:7.3f} ms "
                f"| int8 {tb / t8:4.2f}x faster | CPU ms/call int8 {c8 * 1e3:6.2f} bf16 {cb * 1e3:6.2f}")
        if args.int_mm:
            xq, _ = int8_gemm.quantize_rows(x)
            ti, ci = best_pass(lambda c: int8_gemm._int_mm(xq, c[0]), q8, 2)
            line += f" | _int_mm {ti * 1e3:7.3f} ms (CPU {ci * 1e3:6.2f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
