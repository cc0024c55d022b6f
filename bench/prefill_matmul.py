"""A prefill step's matmuls through each kernel this CPU offers, interleaved
in one process: kvferry's own call (linear.py's ``linear`` on its packed
copy), ``F.linear`` on the plain bf16 weight, and oneDNN with a prepacked
weight (``mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, what
vLLM's CPU backend calls; packed without a batch size as linear.py packs,
and packed for this M), plus a large square matmul through oneDNN as
the machine's practical roofline and, where gcc builds it, one core's
vdpbf16ps peak (bench/vdpbf16ps_peak.c: the instruction's throughput x
clock, no memory traffic).

Shapes: the 1B-shaped Llama's (hidden 2048, 32 heads / 8 KV heads of 64,
MLP 8192) at M rows: qkv 2048 -> 3072, o 2048 -> 2048, gate_up 2048 ->
16384, down 8192 -> 2048. Each timing is CPU time (time.process_time:
robust to other processes on a shared host) and wall time, median over
``--reps`` rounds in which the kernels alternate.

    python bench/prefill_matmul.py [--rows 512 2048] [--threads 1 2] [--reps 7]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvferry.model import linear as kv_linear

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def timed(fn, inner: int) -> tuple[float, float]:
    fn()
    c, w = time.process_time(), time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.process_time() - c) / inner, (time.perf_counter() - w) / inner


def run(rows: list[int], threads: int, reps: int, square: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    out: dict = {"threads": threads, "load": os.getloadavg(), "shapes": {}}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        packed = kv_linear.pack_weight(w)
        onednn = torch.ops.mkldnn._reorder_linear_weight(w)
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            onednn_m = torch.ops.mkldnn._reorder_linear_weight(w, m)  # packed for this batch size
            kernels = {
                "kvferry": lambda: kv_linear.linear(x, w, None, packed),
                "F.linear": lambda: F.linear(x, w),
                "onednn_packed": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
                "onednn_packed_for_m": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn_m, None, "none", [],
                                                                                  ""),
            }
            ref = F.linear(x.float(), w.float())
            errs = {kname: float((fn().float() - ref).abs().max()) for kname, fn in kernels.items()}
            samples: dict[str, list[tuple[float, float]]] = {kname: [] for kname in kernels}
            flops = 2 * m * n * k
            inner = max(1, int(2e9 / flops))
            for _ in range(reps):
                for kname, fn in kernels.items():
                    samples[kname].append(timed(fn, inner))
            res = {}
            for kname, s in samples.items():
                cpu = statistics.median(c for c, _ in s)
                wall = statistics.median(w_ for _, w_ in s)
                res[kname] = {"cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3,
                              "tflops_per_cpu_s": flops / cpu / 1e12, "tflops_wall": flops / wall / 1e12,
                              "max_err": errs[kname]}
            out["shapes"][f"{name} M={m}"] = res
            print(name, m, json.dumps({k_: {kk: round(v, 3) for kk, v in r.items()} for k_, r in res.items()}),
                  flush=True)
        del packed, onednn
    a = torch.randn(square, square, dtype=torch.bfloat16)
    wsq = torch.randn(square, square, dtype=torch.bfloat16)
    wsq_p = torch.ops.mkldnn._reorder_linear_weight(wsq)
    sq = [timed(lambda: torch.ops.mkldnn._linear_pointwise(a, wsq_p, None, "none", [], ""), 2) for _ in range(reps)]
    flops = 2 * square ** 3
    cpu = statistics.median(c for c, _ in sq)
    wall = statistics.median(w_ for _, w_ in sq)
    out["roofline"] = {"n": square, "cpu_ms": cpu * 1e3, "tflops_per_cpu_s": flops / cpu / 1e12,
                       "tflops_wall": flops / wall / 1e12}
    print("roofline", json.dumps(out["roofline"]), flush=True)
    out["load_end"] = os.getloadavg()
    return out


def vdpbf16ps_peak() -> dict | None:
    """One core's vdpbf16ps-only rate (bench/vdpbf16ps_peak.c), or None without gcc / AVX512-BF16."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    src = Path(__file__).with_name("vdpbf16ps_peak.c")
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "peak"
        built = subprocess.run([gcc, "-O3", "-funroll-loops", "-march=native", str(src), "-o", str(exe)],
                               capture_output=True)
        if built.returncode != 0:
            return None
        runs = [json.loads(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)
                for _ in range(3)]
    return max(runs, key=lambda r: r["gflops_per_cpu_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--square", type=int, default=4096)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    peak = vdpbf16ps_peak()
    print("vdpbf16ps peak, one core:", json.dumps(peak), flush=True)
    results = [run(args.rows, t, args.reps, args.square) for t in args.threads]
    results.append({"vdpbf16ps_peak_one_core": peak})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
