"""A 30B-A3B-shaped mixture of experts in 4 bits, served from its GGUF blocks
(--quantization gguf, model/moe_quant.py): memory and decode step time
against the weight-read floor.

Writes a random-weight Qwen3-30B-A3B-shaped GGUF (48 layers, 128 experts,
top-8, hidden 2048, expert width 768, 32 query / 4 KV heads of 128, vocab
151936; every matrix in ``--qtype``, Q4_0 by default: about 17 GB) into
``--dir``, loads it as the engine does, and reports:

- RSS after loading and after the timed steps (VmRSS, RssAnon, RssFile):
  the experts are views of the mapped file, so the anonymous memory holds
  no weights and the file's pages count only once read;
- decode step time (median and min of ``--iters``) at batch 1 and 16, and
  the floor: the bytes the step must read (the active experts' blocks,
  counted from the step's own routing, plus attention, routers and the
  lm_head) over the read bandwidth of a large in-memory reduction measured
  in the same run. The ratio is the figure (issue 46's target: <= 1.3x).

The weights are mapped page cache: where the machine cannot hold the file
in its page cache, a step reads experts from disk and the ratio measures
the disk. The run checks ``MemAvailable`` first (``--min-available-gb``)
and reports how much of the file stayed resident. The file is deleted at
the end (``--keep`` keeps it).

    python bench/moe_quant.py [--dir /work/bench-cache] [--qtype Q4_0] [--threads 1] [--iters 8]
    python bench/moe_quant.py --layers 2 --experts 16   # a quick smoke run of the same code
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.moe_gguf_writer

import torch  # noqa: E402
from decode_roofline import Steps, read_bandwidth  # noqa: E402

from kvferry.model.loader import load_model  # noqa: E402
from kvferry.model.moe import SparseMoeBlock, route  # noqa: E402
from kvferry.model.moe_quant import QuantizedExperts  # noqa: E402
from tests.moe_gguf_writer import MoeShape, write_random_moe_gguf  # noqa: E402

GB = 1 << 30


def meminfo() -> dict[str, float]:
    """/proc/meminfo's MemAvailable and Cached, GiB."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("MemAvailable", "Cached", "MemTotal"):
            out[key] = int(value.split()[0]) * 1024 / GB
    return out


def rss() -> dict[str, float]:
    """This process's VmRSS, RssAnon, RssFile, GiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = round(int(value.split()[0]) * 1024 / GB, 3)
    return out


class ActiveExperts:
    """Counts the distinct experts each MoE layer routes a step's tokens to
    (a forward pre-hook, on for the counting pass only)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.counts: list[int] = []
        self.handles = []

    def __enter__(self) -> "ActiveExperts":
        for b in self.blocks:
            self.handles.append(b.register_forward_pre_hook(self._hook))
        return self

    def _hook(self, block: SparseMoeBlock, args: tuple) -> None:
        _, ids = route(block.gate(args[0]), block.top_k, block.renormalize)
        self.counts.append(int(ids.unique().numel()))

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()


class MoeTime:
    """Wall and CPU seconds spent inside the MoE blocks (forward hooks), summed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.wall = self.cpu = 0.0
        self.handles = []
        self._t = (0.0, 0.0)

    def __enter__(self) -> "MoeTime":
        for b in self.blocks:
            self.handles.append(b.register_forward_pre_hook(self._start))
            self.handles.append(b.register_forward_hook(self._stop))
        return self

    def _start(self, *_: object) -> None:
        self._t = (time.perf_counter(), time.process_time())

    def _stop(self, *_: object) -> None:
        self.wall += time.perf_counter() - self._t[0]
        self.cpu += time.process_time() - self._t[1]

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()


def read_bandwidth_cpu(num_bytes: int = 1 << 29, repeats: int = 7) -> float:
    """Bytes per CPU-second of a large reduction (read only), best of ``repeats``:
    the floor's bandwidth by the same clock as the steps' CPU time."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    src.sum()
    best = float("inf")
    for _ in range(repeats):
        c0 = time.process_time()
        src.sum()
        best = min(best, time.process_time() - c0)
    return num_bytes / best


def other_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight a decode step reads besides the experts: the
    quantized layers' blocks, the float layers' parameters (routers, norms);
    the token embedding is left out (a step reads only its rows)."""
    total = 0
    for lin in model.linears():
        if isinstance(lin, QuantizedExperts):
            continue
        nbytes = getattr(lin.method, "nbytes", None)
        if nbytes is not None:
            total += nbytes(lin)
        elif lin.weight is not None:
            total += lin.weight.numel() * lin.weight.element_size()
    return total


def time_steps(steps: Steps, iters: int) -> tuple[float, float, float]:
    """(wall median, wall min, CPU-time median) seconds of a decode step. On a
    machine other jobs share, the wall clock counts them too; with one
    thread this process's CPU time is the step's own."""
    steps.decode(0)  # warm: primitives built, pages read
    wall, cpu = [], []
    for i in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        steps.decode(i + 1)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), min(wall), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/work/bench-cache"))
    ap.add_argument("--qtype", default="Q4_0", choices=["Q4_0", "Q4_K", "Q8_0"])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: CPU time is the step's own on a shared machine)")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=64, help="tokens of context per request")
    ap.add_argument("--min-available-gb", type=float, default=8.0)
    ap.add_argument("--keep", action="store_true", help="keep the GGUF file")
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = ap.parse_args()

    shape = MoeShape(layers=args.layers, experts=args.experts, top_k=8, hidden=2048, moe_inter=768, heads=32,
                     kv_heads=4, head_dim=128, vocab=151936)
    need = shape.expert_bytes(args.qtype) / GB * 1.07 + 0.5  # experts, attention, vocabulary
    args.dir.mkdir(parents=True, exist_ok=True)
    free_disk = shutil.disk_usage(args.dir).free / GB
    mem = meminfo()
    print(f"disk free {free_disk:.1f} GiB, file ~{need:.1f} GiB; memory {mem}")
    if free_disk < need + 2:
        sys.exit(f"not enough disk under {args.dir}: {free_disk:.1f} GiB free, ~{need + 2:.1f} needed")
    if mem["MemAvailable"] < args.min_available_gb:
        sys.exit(f"MemAvailable {mem['MemAvailable']:.1f} GiB < {args.min_available_gb}: not run")
    torch.set_num_threads(args.threads)
    path = args.dir / f"moe-{args.layers}x{args.experts}-{args.qtype}.gguf"
    results: dict[str, object] = {"args": {k: str(v) for k, v in vars(args).items()}, "file": str(path)}
    try:
        t0 = time.perf_counter()
        write_random_moe_gguf(path, shape, args.qtype)
        size = path.stat().st_size / GB
        results["file_gib"], results["write_s"] = round(size, 2), round(time.perf_counter() - t0, 1)
        print(f"wrote {path} ({size:.2f} GiB) in {results['write_s']} s")
        results["rss_start"] = rss()
        t0 = time.perf_counter()
        model = load_model(str(path), dtype="bfloat16", quantization="gguf").model
        results["load_s"] = round(time.perf_counter() - t0, 1)
        results["rss_loaded"] = rss()
        print(f"loaded in {results['load_s']} s, rss {results['rss_loaded']}")
        bw, bw_cpu = read_bandwidth(), read_bandwidth_cpu()
        results["read_bw_gbs"], results["read_bw_cpu_gbs"] = round(bw / 1e9, 2), round(bw_cpu / 1e9, 2)
        expert_bytes = shape.expert_bytes(args.qtype) / (args.layers * args.experts)  # one expert, one layer
        other = other_weight_bytes(model)
        for batch in args.batches:
            steps = Steps(model, batch, args.context)
            with ActiveExperts(model) as active:
                steps.decode(0)
            experts_read = sum(active.counts) * expert_bytes
            with MoeTime(model) as moe:
                med, best, cpu = time_steps(steps, args.iters)
            floor = (experts_read + other) / bw
            floor_cpu, experts_floor_cpu = (experts_read + other) / bw_cpu, experts_read / bw_cpu
            moe_wall, moe_cpu = moe.wall / (args.iters + 1), moe.cpu / (args.iters + 1)  # the warm step too
            row = {"median_ms": round(med * 1e3, 1), "min_ms": round(best * 1e3, 1), "cpu_ms": round(cpu * 1e3, 1),
                   "cpu_over_cpu_floor": round(cpu / floor_cpu, 2),
                   "moe_wall_ms": round(moe_wall * 1e3, 1), "moe_cpu_ms": round(moe_cpu * 1e3, 1),
                   "experts_floor_cpu_ms": round(experts_floor_cpu * 1e3, 1),
                   "moe_cpu_over_experts_floor": round(moe_cpu / experts_floor_cpu, 2),
                   "active_experts_per_layer": round(sum(active.counts) / len(active.counts), 1),
                   "experts_read_gb": round(experts_read / 1e9, 3), "other_read_gb": round(other / 1e9, 3),
                   "floor_ms": round(floor * 1e3, 1), "experts_floor_ms": round(experts_read / bw * 1e3, 1),
                   "median_over_floor": round(med / floor, 2), "min_over_floor": round(best / floor, 2)}
            results[f"batch{batch}"] = row
            print(f"batch {batch}: {row}", flush=True)
            del steps
        results["rss_after"] = rss()
        results["meminfo_after"] = meminfo()
        results["load_average"] = os.getloadavg()
    finally:
        if not args.keep and path.exists():
            path.unlink()
            print(f"deleted {path}")
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
