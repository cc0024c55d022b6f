"""Decode steps of one model under two (or more) environment settings,
alternated inside one process: the A/B for a switch the engine reads per
step (``KVFERRY_DISABLE_LAYER_OP``, ``KVFERRY_DISABLE_FUSED_OPS``, ...).

On a shared, noisy machine separate runs of the same code differ by 10% or
more; alternating rounds of steps in one process, on the same weights and
the same KV cache, lets both arms see the same machine. Each round runs
every arm for ``--steps`` timed steps (after one untimed step), rounds
repeat ``--rounds`` times; the medians are printed per batch shape.

    python bench/ab_env_steps.py KVFERRY_DISABLE_LAYER_OP=1 KVFERRY_DISABLE_LAYER_OP=0
    python bench/ab_env_steps.py --dtype float32 --shapes 32x384 A=1 A=0

A switch read once (at load or at pack time) is not switched by this.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_roofline import Steps, cpu_description  # noqa: E402

from kvferry.model.loader import load_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("arms", nargs="+", help="NAME=VALUE settings, one per arm")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shapes", default="1x16,8x256,32x384", help="BATCHxCONTEXT, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    arms = [a.split("=", 1) for a in args.arms]
    if any(len(a) != 2 for a in arms):
        p.error("each arm is NAME=VALUE")
    torch.set_num_threads(args.threads)
    from kvferry.engine.host_memory import tune_malloc
    tune_malloc()
    model = load_model(args.model, dtype=args.dtype).model
    print(json.dumps({"cpu": cpu_description(), "dtype": args.dtype, "threads": args.threads,
                      "rounds": args.rounds, "steps": args.steps}))
    for shape in args.shapes.split(","):
        batch, context = (int(v) for v in shape.split("x"))
        steps = Steps(model, batch, context)
        with torch.inference_mode():
            for _ in range(3):
                steps.decode()
            times: dict[str, list[float]] = {"=".join(a): [] for a in arms}
            for _ in range(args.rounds):
                for name, value in arms:
                    os.environ[name] = value
                    steps.decode()
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        steps.decode()
                        times[f"{name}={value}"].append((time.perf_counter() - t0) * 1e3)
        medians = {arm: round(statistics.median(t), 2) for arm, t in times.items()}
        first = next(iter(medians.values()))
        print(json.dumps({"batch": batch, "context": context, "median_ms": medians,
                          "min_ms": {arm: round(min(t), 2) for arm, t in times.items()},
                          "over_first": {arm: round(m / first, 3) for arm, m in medians.items()}}))


if __name__ == "__main__":
    main()
