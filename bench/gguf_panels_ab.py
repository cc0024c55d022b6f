"""A GGUF file's Q4_K / Q6_K weights as their blocks against packed into
panels that replace them (``KVFERRY_GGUF_PANELS=1``, quant/panels.py).

Default: the file is loaded both ways into this one process, and a batch-1
decode step's matmuls (every layer's qkv, o, gate/up and down calls as the
one-call decoder layer makes them, then the lm_head; ``--rows`` rows of
bf16 x) run over each model's weights, alternating blocks and panels
``--pairs`` times (each first half the time): both halves of a pair see
about the same load. Every call's outputs are checked equal both ways.
Reported: medians of the CPU time of all threads (``time.process_time``)
and each pair's ratio (panels / blocks), with the load average.

``--load N``: N fresh processes each way, alternating, that only load the
model (load_model + pack_weights): the process's peak RSS (VmHWM) and its
RSS after, in MB.

    PYTHONPATH=src python bench/gguf_panels_ab.py FILE.gguf [--threads 1 2] [--rows 1 4] [--pairs 21] [--load 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from gguf_blocks_memory import fresh_process_loads, step_calls

WAYS = ("blocks", "panels")


def load(path: str, way: str):  # -> LlamaModel
    from kvferry.model.loader import load_model

    os.environ["KVFERRY_GGUF_PANELS"] = "1" if way == "panels" else "0"
    m = load_model(path, dtype="bfloat16", quantization="gguf").model
    m.pack_weights()
    return m


def ab(path: str, threads: list[int], rows: list[int], pairs: int) -> None:
    import torch

    models = {way: load(path, way) for way in WAYS}
    calls = {way: step_calls(m) for way, m in models.items()}
    op = torch.ops.kvferry_quant.layer_linear_parts
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in {c[2] for c in calls["blocks"]}}
        for a, b in zip(*calls.values(), strict=True):  # the same bits both ways
            assert torch.equal(op(xs[a[2]], a[0], a[1]), op(xs[b[2]], b[0], b[1]))

        def one(sel) -> float:
            c0 = time.process_time()
            for ws, ts, k in sel:
                op(xs[k], ws, ts)
            return (time.process_time() - c0) * 1e3

        for n in threads:
            torch.set_num_threads(n)
            got: dict[str, list] = {way: [] for way in WAYS}
            for i in range(pairs):
                for way in (WAYS if i % 2 == 0 else WAYS[::-1]):
                    got[way].append(one(calls[way]))
            with open("/proc/loadavg") as f:
                loadavg = " ".join(f.read().split()[:3])
            ratio = statistics.median(p / b for b, p in zip(got["blocks"], got["panels"]))
            print(f"rows {m}, {n} thread(s), all matmuls of a step, median CPU ms of {pairs} pairs: "
                  + " | ".join(f"{way} {statistics.median(got[way]):.2f}" for way in WAYS)
                  + f" | panels / blocks, pairs' median {ratio:.3f}x | load {loadavg}", flush=True)


def load_once(path: str, way: str) -> dict:
    def status() -> dict:
        out = {}
        for line in open("/proc/self/status"):
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) / 1024
        return out

    import torch  # noqa: F401 - its import is not the load's
    from kvferry.model import loader  # noqa: F401

    before = status()
    c0 = time.process_time()
    model = load(path, way)
    cpu = time.process_time() - c0
    after = status()
    del model
    return {"cpu": cpu, "peak": after["VmHWM"], "rss": after["VmRSS"], "rss_before": before["VmRSS"]}


def loads(path: str, n: int) -> None:
    medians = fresh_process_loads(__file__, path, WAYS, n)
    print(f"file {os.path.getsize(path) / 1e6:.0f} MB; medians of {n} loads each (MB, s):")
    for way, med in medians.items():
        print(f"  {way:7s} load CPU {med['cpu']:.2f} s | RSS before {med['rss_before']:.0f}, peak (VmHWM) "
              f"{med['peak']:.0f}, after {med['rss']:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--pairs", type=int, default=21)
    ap.add_argument("--load", type=int, default=0, metavar="N")
    ap.add_argument("--load-once", choices=WAYS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_once:
        print(json.dumps(load_once(args.model, args.load_once)))
    elif args.load:
        loads(args.model, args.load)
    else:
        ab(args.model, args.threads, args.rows, args.pairs)


if __name__ == "__main__":
    main()
