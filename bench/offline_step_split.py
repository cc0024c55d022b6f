"""Where the offline workload's time goes: prefill-only, mixed and decode-only
steps, the forward pass inside them, and the engine outside the runner.

The workload is bench/offline_throughput.py's (32 requests, prompts of
128-512 seeded random tokens, 128 output tokens, greedy, ignore_eos). With
``--threads 1`` every figure is the main thread's CPU time
(``time.thread_time`` of the stepping thread; the total is process CPU
time), which another process taking the core does not inflate: use it to A/B two trees on a shared machine (run each tree with its
own PYTHONPATH, alternating). With more threads the figures are wall time.

    python bench/offline_step_split.py [--threads 1] [--dtype bfloat16] [--max-num-batched-tokens 2048]
"""
from __future__ import annotations

import argparse
import collections
import random
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M)")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    # LLM steps on a thread of its own (engine/cpu_threads.py): the per-step
    # figures are that thread's; the total is the whole process's.
    total_clock = time.process_time if args.threads == 1 else time.perf_counter

    from kvferry import LLM, SamplingParams
    from kvferry.engine import runner
    from kvferry.model import llama
    from kvferry.model.loader import load_model

    loaded = load_model(args.model)
    rng = random.Random(args.seed)
    vocab = loaded.config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(128, 512))] for _ in range(args.num_requests)]
    llm = LLM(model=loaded.model_path, dtype=args.dtype, max_num_seqs=args.num_requests,
              max_num_batched_tokens=args.max_num_batched_tokens)

    # kind -> [steps, runner seconds, forward seconds, tokens]
    stats: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
    forward_s = [0.0]
    execute, forward = runner.ModelRunner.execute, llama.LlamaModel.forward

    def timed_execute(self, sched):
        counts = sched.num_scheduled_tokens.values()
        multi, single = sum(n > 1 for n in counts), sum(n == 1 for n in counts)
        kind = "empty" if not counts else "prefill" if not single else "decode" if not multi else "mixed"
        forward_s[0] = 0.0
        t0 = clock()
        out = execute(self, sched)
        row = stats[kind]
        row[0] += 1
        row[1] += clock() - t0
        row[2] += forward_s[0]
        row[3] += sum(counts)
        return out

    def timed_forward(self, *a, **k):
        t0 = clock()
        hidden = forward(self, *a, **k)
        forward_s[0] += clock() - t0
        return hidden

    runner.ModelRunner.execute, llama.LlamaModel.forward = timed_execute, timed_forward
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up (kernel build)
    stats.clear()
    t0 = total_clock()
    outs = llm.generate(prompts, params)
    total = total_clock() - t0
    produced = sum(len(o.token_ids) for o in outs)
    unit = "thread CPU s" if args.threads == 1 else "wall s"
    print(f"total {total:.2f} {unit}, {produced / total:.1f} output tok/s, threads {args.threads}")
    in_runner = 0.0
    for kind, (steps, run_s, fwd_s, tokens) in stats.items():
        in_runner += run_s
        print(f"  {kind:8s} steps {int(steps):4d}  runner {run_s:7.2f}  forward {fwd_s:7.2f}  tokens {int(tokens):6d}"
              f"  per step {run_s / steps * 1e3:8.1f} ms")
    print(f"  outside the runner (scheduler, outputs): {total - in_runner:.2f}")


if __name__ == "__main__":
    main()
