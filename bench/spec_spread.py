"""Where the default's run-to-run spread at c16 comes from: the controller's
drafting decisions, or the machine.

In-process and interleaved: each run is a fresh ``LLM`` (a cold controller,
as ``bench/spec_default.py``'s fresh server) serving ``--prompts`` chat
prompts at most ``--concurrency`` at a time (``max_num_seqs``: a finished
request's slot goes to the next one at once, as ``vllm bench serve
--max-concurrency`` does, without the HTTP round trip), the sides
alternating run by run. Per run: the process's CPU seconds and wall
seconds per output token, the drafts verified and accepted, and the decode
steps at each number of running requests with and without drafts, so that
a slow run can be told apart: more CPU time with the same drafts is the
machine (CPU time grows with other processes' load too, less than wall
time); different drafts is the controller.

    python bench/spec_spread.py [--runs 4] [--prompts 32] [--concurrency 16]
        [--task chat|code] [--sides default off '{"method": "auto", ...}'] [--threads 1]

At ``--concurrency 1`` it is ``bench/spec_default.py``'s c1 case in CPU
time: the tokens per CPU second of each side over off's, for a machine too
loaded for served wall-clock figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter

from pathlib import Path

from kvferry import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_default import chat_prompts, code_prompts  # noqa: E402 (the served bench's prompts)


def one_run(side: str, prompts: list[str], args: argparse.Namespace) -> dict:
    llm = LLM(speculative=side, max_num_seqs=args.concurrency, dtype=args.dtype, quantization=args.quantization)
    core = llm.engine.core
    steps: Counter = Counter()  # (running, drafted) -> decode steps
    schedule = core.scheduler.schedule

    def noting(*a, **kw):  # noqa: ANN002, ANN003
        out = schedule(*a, **kw)
        if out.num_scheduled_tokens:
            steps[(len(out.num_scheduled_tokens), bool(out.spec_token_ids))] += 1
        return out

    core.scheduler.schedule = noting
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # first-call costs, both sides
        steps.clear()
        before = llm.engine.stats()
        cpu, wall = time.process_time(), time.perf_counter()
        outputs = llm.generate(prompts, params)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        stats = llm.engine.stats()
    finally:
        core.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    drafted = {n: c for (n, d), c in steps.items() if d}
    return {"side": side, "cpu_s": cpu, "wall_s": wall, "tokens": tokens,
            "cpu_ms_per_token": 1e3 * cpu / tokens, "wall_ms_per_token": 1e3 * wall / tokens,
            "draft_tokens": stats.num_draft_tokens - before.num_draft_tokens,
            "accepted_tokens": stats.num_accepted_tokens - before.num_accepted_tokens,
            "steps": sum(steps.values()), "steps_with_drafts": sum(drafted.values()),
            "drafted_at_running": dict(sorted(drafted.items())), "load": os.getloadavg()[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=4, help="runs per side, alternating")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="e.g. gguf: the embedded Q4_1 file's blocks (no head)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is the work's own)")
    p.add_argument("--task", choices=("chat", "code"), default="chat")
    p.add_argument("--sides", nargs="+", default=["default", "off"])
    p.add_argument("--out", default=None, help="a JSON file for every run's figures")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    llm = LLM()
    tokenizer = llm.engine.tokenizer
    llm.engine.core.close()
    prompts = (chat_prompts if args.task == "chat" else code_prompts)(tokenizer, args.prompts)
    runs = []
    print(f"load average at start: {os.getloadavg()}", flush=True)
    for i in range(args.runs):
        for side in (args.sides if i % 2 == 0 else list(reversed(args.sides))):
            r = one_run(side, prompts, args)
            runs.append(r)
            print(json.dumps(r), flush=True)
    print(f"load average at end: {os.getloadavg()}")
    off = [r["cpu_ms_per_token"] for r in runs if r["side"] == "off"]
    for side in args.sides:
        rs = [r for r in runs if r["side"] == side]
        if off and side != "off":
            ratio = statistics.median(off) / statistics.median([r["cpu_ms_per_token"] for r in rs])
            print(f"{side[:40]}: {ratio:.2f}x off's tokens per CPU second (medians)")
        cpu = [r["cpu_ms_per_token"] for r in rs]
        wall = [r["wall_ms_per_token"] for r in rs]
        print(f"{side[:40]}: CPU ms/token median {statistics.median(cpu):.2f} (min {min(cpu):.2f}, max {max(cpu):.2f}); "
              f"wall ms/token median {statistics.median(wall):.2f} (min {min(wall):.2f}, max {max(wall):.2f}); "
              f"draft tokens {[r['draft_tokens'] for r in rs]}, accepted {[r['accepted_tokens'] for r in rs]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
