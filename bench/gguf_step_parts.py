"""Where a batch-1 decode step's CPU time goes outside the matmuls: a GGUF
file through the offline engine (one request, greedy, ``ignore_eos``, no
speculation), each part timed in the stepping thread's CPU time
(``time.thread_time``), which other processes' load inflates least.

Parts, nested as they run (median ms per decode step over the steps of
``--runs`` generations; the prefill step dropped):

    engine.step
      core.step
        scheduler.schedule
        runner.execute
          update_states / prepare (inputs) / forward / logits / sample
          forward: embedding + rotary rows, the C++ layers (run_layers)
        scheduler.update_from_output
      output_processor.process (detokenization, stop strings)

and, with ``--ops``, torch.profiler's table of one generation's ops inside
the C++ layers (matmuls, attention, norms, RoPE, SiLU), whose shares split
the layers' CPU time.

    python bench/gguf_step_parts.py [--model FILE.gguf] [--threads 1] [--output-len 64] [--runs 3] [--ops] [--llama-bench]

``--llama-bench`` alternates each kvferry generation with llama.cpp's
``llama-bench -p 0 -t THREADS`` on the same file, at ``-n 2 x output-len``
and ``-n output-len/2``: the difference of their CPU times (the child's
``getrusage``) over the difference of their tokens is llama.cpp's CPU per
token without its loading, beside kvferry's process CPU per token (prefill
and warm-up included, so slightly over).

With ``--threads 1`` the layers' figures are the whole step's CPU; with
more, the stepping thread's CPU time omits the OpenMP workers' (the
process's CPU time, all threads, is printed beside it).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

PROMPT = "The river carried old stories past the mill while the town slept"


def instrument(times: dict[str, list[float]]) -> None:
    """Wrap each part's function with a thread-CPU timer appending to ``times[name]``."""
    from kvferry.core.scheduler import Scheduler
    from kvferry.engine import engine, runner
    from kvferry.engine.core import EngineCore
    from kvferry.engine.output_processor import OutputProcessor
    from kvferry.model import layer_op, llama

    def wrap(owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **k):
            t0 = time.thread_time_ns()
            try:
                return fn(*a, **k)
            finally:
                times[name].append((time.thread_time_ns() - t0) / 1e6)
        setattr(owner, attr, timed)

    wrap(engine.LLMEngine, "step", "engine.step")
    wrap(EngineCore, "step", "core.step")
    wrap(Scheduler, "schedule", "schedule")
    wrap(Scheduler, "update_from_output", "update_from_output")
    wrap(OutputProcessor, "process", "output_processor")
    wrap(runner.ModelRunner, "execute", "execute")
    wrap(runner.ModelRunner, "_update_states", "update_states")
    wrap(runner.ModelRunner, "_prepare", "prepare")
    wrap(runner.ModelRunner, "_forward", "forward")
    wrap(llama.LlamaModel, "compute_logits", "logits")
    wrap(runner.ModelRunner, "_sample", "sample")
    wrap(layer_op, "run_layers", "layers (C++)")


def llama_bench_cpu_ms(binary: str, model: str, tokens: int, threads: int) -> float:
    """CPU ms (user + system) of one ``llama-bench`` run generating ``tokens`` tokens once."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([binary, "-m", model, "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "1"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/ggufmix/1b-q4km.gguf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ops", action="store_true")
    ap.add_argument("--llama-bench", action="store_true")
    args = ap.parse_args()
    llama_bench = None
    if args.llama_bench:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _llama_cpp import llama_cpp_bin

        llama_bench = llama_cpp_bin("llama-bench")
        if llama_bench is None:
            raise SystemExit("--llama-bench: llama.cpp's llama-bench not found (bench/llama_cpp_build.sh)")

    import torch

    from kvferry import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, quantization="gguf", dtype="bfloat16", max_num_seqs=4, kv_cache_memory_gb=0.25,
              speculative="off")
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    times: dict[str, list[float]] = defaultdict(list)
    instrument(times)
    per_run: dict[str, list[float]] = defaultdict(list)
    cpu_per_token, llama_per_token = [], []
    long_n, short_n = 2 * args.output_len, max(args.output_len // 2, 1)
    for _ in range(args.runs):
        if llama_bench is not None:
            extra = (llama_bench_cpu_ms(str(llama_bench), args.model, long_n, args.threads)
                     - llama_bench_cpu_ms(str(llama_bench), args.model, short_n, args.threads))
            llama_per_token.append(extra / (long_n - short_n))
        times.clear()
        c0 = time.process_time()
        out = llm.generate([PROMPT], params)[0]
        cpu_per_token.append((time.process_time() - c0) * 1e3 / len(out.token_ids))
        for name, v in times.items():
            per_run[name].extend(v[1:] if len(v) > 1 else v)  # the first of each is the prefill's
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    med = {k: statistics.median(v) for k, v in per_run.items()}
    total = med["engine.step"]
    print(f"{args.model}, {args.threads} threads, {args.runs} x {args.output_len} tokens, load {load}; "
          f"process CPU per token (all threads, generate() all in) {statistics.median(cpu_per_token):.2f} ms")
    if llama_per_token:
        print(f"llama-bench CPU per token (all threads, -n {long_n} minus -n {short_n}, alternating): "
              f"{statistics.median(llama_per_token):.2f} ms ({' '.join(f'{x:.1f}' for x in llama_per_token)}); "
              f"kvferry's per run: {' '.join(f'{x:.1f}' for x in cpu_per_token)}")
    print("median ms per decode step, stepping thread's CPU time (share of engine.step):")
    derived = {
        "  core.step - schedule - execute - update": med["core.step"] - med["schedule"] - med["execute"]
        - med["update_from_output"],
        "  execute - (update_states+prepare+forward+logits+sample)": med["execute"] - med["update_states"]
        - med["prepare"] - med["forward"] - med["logits"] - med["sample"],
        "  forward - layers (embedding, rotary rows, metadata)": med["forward"] - med["layers (C++)"],
        "  engine.step - core.step - output_processor": total - med["core.step"] - med["output_processor"],
    }
    for name, v in [*med.items(), *derived.items()]:
        print(f"  {name:58s} {v:8.3f}  {100 * v / total:5.1f}%")
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate([PROMPT], params)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
