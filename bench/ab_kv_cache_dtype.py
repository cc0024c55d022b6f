"""Decode steps over a cache in the model's dtype against fp8 ones (each
``--kv-cache-dtypes`` entry), alternated in one process (the same model,
weights and threads; the machine's noise then hits all alike): medians of
per-round step times, ms, and each fp8 cache's ratio to the exact one.

    python bench/ab_kv_cache_dtype.py --batch 32 --context 384 --rounds 8
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
import sys

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_roofline import Steps, cpu_description  # noqa: E402

from kvferry.engine.host_memory import tune_malloc  # noqa: E402
from kvferry.model.kv_cache_dtype import resolve_kv_cache_dtype  # noqa: E402
from kvferry.model.loader import load_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="decode steps per round and cache")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["fp8_e4m3", "fp8_e5m2"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tune_malloc()
    model = load_model(args.model, dtype=args.dtype).model
    runs = {"exact": Steps(model, args.batch, args.context)}
    for name in args.kv_cache_dtypes:
        runs[name] = Steps(model, args.batch, args.context,
                           cache_dtype=resolve_kv_cache_dtype(name, model.dtype, torch.device("cpu"), False))
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for steps in runs.values():
            for i in range(3):
                steps.decode(i)
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                t0 = time.perf_counter()
                for i in range(args.steps):
                    runs[name].decode(i)
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({"cpu": cpu_description(), "dtype": args.dtype, "threads": args.threads, "batch": args.batch,
                      "context": args.context, "rounds": args.rounds,
                      "ms": {name: round(m, 2) for name, m in med.items()},
                      "over_exact": {name: round(med[name] / med["exact"], 3) for name in args.kv_cache_dtypes},
                      "per_round_ratio": {name: [round(f / e, 3) for e, f in zip(times["exact"], times[name])]
                                          for name in args.kv_cache_dtypes}}))


if __name__ == "__main__":
    main()
