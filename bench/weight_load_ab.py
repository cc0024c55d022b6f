"""A model's weight load (``kvferry.model.loader.load_model``) in fresh
processes: CPU (getrusage) and wall, per source tree and thread count, the
trees alternated so that a busy machine's drift falls on both alike.

    python bench/weight_load_ab.py --src /path/to/old/src --src src --threads 1 2 -n 3 \\
        --model default:float32 --model /tmp/kvferry-peer-models/llama-1b-...:bfloat16

``default`` is the embedded model. Each process sets its thread count and
runs one parallel op first, so the OpenMP team exists before the load, as
on the engine core's step thread. Prints each load and the medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import resource, sys, time, torch
threads, model, dtype = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(threads)
torch.ones(1 << 20).add_(1)
from kvferry.model.loader import load_model
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
load_model(None if model == "default" else model, dtype=dtype)
r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
print(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, t1 - t0)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", action="append", required=True, help="a tree's src folder (repeat: A, B, ...)")
    parser.add_argument("--model", action="append", required=True, metavar="PATH:DTYPE")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("-n", type=int, default=3)
    args = parser.parse_args()
    results: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    print(f"load average before: {os.getloadavg()}", flush=True)
    for i in range(args.n):
        for model in args.model:
            path, dtype = model.rsplit(":", 1)
            for threads in args.threads:
                for src in args.src:
                    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
                    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), path, dtype], env=env,
                                         capture_output=True, text=True, check=True).stdout.split()
                    cpu, wall = float(out[-2]), float(out[-1])
                    results.setdefault((model, threads, src), []).append((cpu, wall))
                    print(f"{i} {Path(path).name} threads={threads} {src}: CPU {cpu:.2f} s, wall {wall:.2f} s",
                          flush=True)
    print(f"load average after: {os.getloadavg()}")
    for (model, threads, src), rows in results.items():
        cpu, wall = (statistics.median(c) for c in zip(*rows))
        print(f"{Path(model).name} threads={threads} {src}: median CPU {cpu:.2f} s, wall {wall:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
