"""Ray's overhead: the disagg layout (1 prefill + 1 decode core, each on its
own CPU) as local processes and as Ray actors on a two-node cluster on this
host, under vLLM's own client (``vllm bench serve``), interleaved run by run
so that both see the same machine.

    python bench/ray_overhead.py [--runs 3] [--model embedded|1b] [--concurrency 16]

Prints each run, then the medians of TTFT and TPOT p50/p99 and output
throughput, with the ratio Ray / local (target <= 1.05x for the latencies).
The client comes from the vLLM venv (bench/vllm_bench_serve.sh installs it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _fleet import RayCluster, disagg_flags, machine_line, make_1b
from _servers import served

METRICS = [("p50_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"), ("p50_tpot_ms", "TPOT p50 ms"),
           ("p99_tpot_ms", "TPOT p99 ms"), ("output_throughput", "output tok/s")]


def bench_serve(args: argparse.Namespace, url: str, tokenizer: str, out: Path, seed: int) -> dict:
    cmd = [str(Path(args.vllm_venv) / "bin" / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", "m", "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", choices=["embedded", "1b"], default="embedded")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vllm-venv", default="/work/vllm-venv")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ray-overhead-"))
    if args.model == "embedded":
        from kvferry.model.loader import load_model

        model = load_model(None).model_path
    else:
        model = make_1b(work)
    print(f"# {machine_line()}; {time.strftime('%Y-%m-%d %H:%M %Z')}; model {args.model}; "
          f"c{args.concurrency}, {args.num_prompts} prompts of {args.input_len} -> {args.output_len} tokens")
    results: dict[str, list[dict]] = {"local": [], "ray": []}
    with RayCluster(work, {"pnode": 1}, {"dnode": 1}) as cluster:
        for run in range(1, args.runs + 1):
            for placement in ("local", "ray"):
                flags = [str(model), "--served-model-name", "m", "--max-model-len", "2048",
                         *disagg_flags(cluster if placement == "ray" else None)]
                with served(flags, work / f"{placement}-{run}.log") as url:
                    r = bench_serve(args, url, str(model), work / f"{placement}-{run}.json", seed=run)
                results[placement].append(r)
                print(f"run {run} {placement:>5}: " + ", ".join(f"{label} {r[key]:.1f}" for key, label in METRICS),
                      flush=True)
    print(f"\n| figure (median of {args.runs}) | local processes | Ray actors | Ray / local |\n|---|---|---|---|")
    for key, label in METRICS:
        local = statistics.median(r[key] for r in results["local"])
        ray = statistics.median(r[key] for r in results["ray"])
        print(f"| {label} | {local:.1f} | {ray:.1f} | {ray / local:.2f}x |")
    print(f"\nresults in {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
