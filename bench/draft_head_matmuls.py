"""The draft head's matmuls per drafting depth, in each weight format.

A tree step drafts up to k depths of 1-4 rows (spec/head_tree.py), each
depth four matmuls: fc [H, 2H], up [2I, H], down [H, I] and the draft
vocabulary's lm_head [D, H], at SmolLM2-135M's head 576 / 1536 / 8192.
Between depths the target's forward pass has evicted them from the caches,
so each call here starts cold (a buffer larger than the L3 cache is read
between calls). Per format, one call per depth's four matmuls, interleaved
with the other formats, one thread, CPU ms, medians:

- ``bf16``: the float head in bf16 through small_gemm's packed copies (the
  drafting dtype on a CPU with AVX512-BF16: spec/head.py's before);
- ``int8``: int8 rows with per-row scales (int8_gemm.gemm, W8A8);
- ``head``: what spec/head.py drafts with by default, fc in bf16 and the
  other three int8 (``drafts_in_int8`` says why);
- ``q8_0``: GGUF Q8_0 blocks (32 values, an fp16 scale each) through the
  quant kernels' integer dots.

    python bench/draft_head_matmuls.py [--rows 1 2 4 8] [--iters 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def q8_0_blocks(w: torch.Tensor):  # noqa: ANN201
    """w [N, K] float -> a QuantizedWeight in Q8_0 (d = max|block| / 127 as fp16, q = round(w / d))."""
    from kvferry.model.quant import QuantizedWeight

    n, k = w.shape
    b = w.float().reshape(n, k // 32, 32)
    d = (b.abs().amax(dim=-1) / 127.0).to(torch.float16)  # [N, K/32]
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d.float()))
    q = torch.round(b * inv[..., None]).clamp_(-127, 127).to(torch.int8)  # [N, K/32, 32]
    raw = torch.cat([d.view(torch.uint8).reshape(n, k // 32, 2), q.view(torch.uint8)], dim=-1)  # [N, K/32, 34]
    return QuantizedWeight.from_blocks("w", "Q8_0", raw.reshape(n, -1).contiguous(), (n, k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--evict-mb", type=int, default=64, help="bytes read between calls (0: warm weights)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from kvferry.model import int8_gemm, quant
    from kvferry.model.linear import linear, pack_weight

    torch.manual_seed(0)
    h, i, d = 576, 1536, 8192
    shapes = {"fc": (h, 2 * h), "up": (2 * i, h), "down": (h, i), "lm_head": (d, h)}
    weights = {name: torch.randn(shape) * 0.05 for name, shape in shapes.items()}
    bf16 = {n: (w.to(torch.bfloat16).contiguous(), pack_weight(w.to(torch.bfloat16).contiguous()))
            for n, w in weights.items()}
    i8 = {}
    for n, w in weights.items():
        q = int8_gemm.quantize_weight(w, n)
        i8[n] = (q.qweight, q.scale, int8_gemm.row_sums(q.qweight))
    q8 = {n: q8_0_blocks(w) for n, w in weights.items()}
    evict = torch.ones(a.evict_mb << 18) if a.evict_mb else None  # float32: evict_mb MiB

    def run_bf16(xs):  # noqa: ANN001, ANN202
        return [linear(xs[n].to(torch.bfloat16), bf16[n][0], None, bf16[n][1]) for n in shapes]

    def run_int8(xs):  # noqa: ANN001, ANN202
        return [int8_gemm.gemm(xs[n], *i8[n]) for n in shapes]

    def run_q8(xs):  # noqa: ANN001, ANN202
        return [quant.gemv(xs[n], q8[n]) for n in shapes]

    def run_head(xs):  # noqa: ANN001, ANN202
        return [linear(xs["fc"].to(torch.bfloat16), *bf16["fc"][:1], None, bf16["fc"][1])] + \
               [int8_gemm.gemm(xs[n], *i8[n]) for n in ("up", "down", "lm_head")]

    runs = {"bf16": run_bf16, "int8": run_int8, "head": run_head, "q8_0": run_q8}
    print(f"int8 kernel {int8_gemm.kernel_path()}, quant kernel {quant.kernel_path()}, "
          f"evict {a.evict_mb} MiB between calls; CPU ms per depth (fc + up + down + lm_head), medians")
    for rows in a.rows:
        xs = {n: torch.randn(rows, shape[1]) for n, shape in shapes.items()}
        ref = [x.double() @ weights[n].double().t() for n, x in xs.items()]
        times = {k: [] for k in runs}
        for it in range(a.iters):
            order = list(runs) if it % 2 == 0 else list(reversed(runs))
            for k in order:
                if evict is not None:
                    evict.sum()
                t0 = time.process_time()
                runs[k](xs)
                times[k].append(time.process_time() - t0)
        err = {k: max(float(((y.double() - r).norm() / r.norm())) for y, r in zip(runs[k](xs), ref)) for k in runs}
        print(f"rows {rows}: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.3f} ms (rel err {err[k]:.1e})"
                                           for k, v in times.items()))


if __name__ == "__main__":
    main()
