"""What a step with a prompt in it costs at TP 2 (1 thread a rank) against
TP 1, in CPU time as well as wall time (a shared host's wall clock is
noise; a rank's CPU time is what it did): the cost of the all-reduce and of
the work every rank repeats (norms, residual adds, the step's inputs).

Three steps, each after 15 running decodes (32-token prompts):

- ``decode``: the 15 decodes alone;
- ``mixed``: the 15 decodes and one ``--prompt``-token prompt (one chunk);
- ``big``: the 15 decodes and 8 prompts of 256 (the 2048-token budget
  full: what a c16 burst of 256-token prompts runs first).

Per step: wall ms, rank 0's CPU ms (this process), the other ranks' CPU ms
(from /proc), and rank 0's time inside the all-reduces (wall, and CPU: the
copy and the sum without the wait). Modes: ``tp1`` (one process, 2
threads), ``tp1x1`` (one thread: the work of both ranks done once, the
floor a TP 2 rank's CPU is measured against), ``tp2`` (2 ranks, 1 thread
each, the shared-memory all-reduce).

    python bench/tp_mixed_step.py --model /tmp/kvferry-peer-models/llama-1b-... [--modes tp1x1 tp2]
        [--reps 3] [--prompt 256] [--dtype bfloat16] [--steps decode mixed big]

(a model folder as bench/tp_vs_vllm.py makes: bench/_peer_models.py; the
2-layer one costs what 2 of the 1B's 16 layers cost). Each mode runs in a
process of its own.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"tp1": (1, 2), "tp1x1": (1, 1), "tp2": (2, 1)}  # (tensor_parallel_size, threads a rank)


class TimedGroup:
    """A shard's collectives, with rank 0's wall and CPU time in all_reduce."""

    def __init__(self, group) -> None:  # noqa: ANN001
        self.group, self.wall, self.cpu, self.calls = group, 0.0, 0.0, 0

    def all_reduce(self, tensor, op: str = "sum"):  # noqa: ANN001, ANN201
        w, c = time.perf_counter(), time.thread_time()
        out = self.group.all_reduce(tensor, op)
        self.wall += time.perf_counter() - w
        self.cpu += time.thread_time() - c
        self.calls += 1
        return out

    def __getattr__(self, name: str):  # noqa: ANN204 - all_gather, barrier, close: the group's
        return getattr(self.group, name)


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(mode: str, model: str, prompt_len: int, reps: int, dtype: str, steps: list[str]) -> dict:
    import torch

    from kvferry import LLM, SamplingParams

    tp, threads = MODES[mode]
    if tp == 1:
        torch.set_num_threads(threads)
    llm = LLM(model=model, dtype=dtype, tensor_parallel_size=tp, cpu_threads_per_rank=threads, num_kv_blocks=1024,
              block_size=16, enable_prefix_caching=False, max_num_seqs=32, max_num_batched_tokens=2048)
    core, engine = llm.engine.core, llm.engine
    shard = core.runner.model.shard
    timed = None
    if shard.group is not None:
        timed = shard.group = TimedGroup(shard.group)
    pids = [p.pid for p in core.tp._procs] if core.tp is not None else []
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 30000) for _ in range(n)]

    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("warm", prompt(prompt_len), once)
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(15):
        engine.add_request(f"d{i}", prompt(32), SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    rows: dict[str, list[dict]] = {s: [] for s in steps}
    for r in range(reps):
        for step in steps:
            if step == "mixed":
                engine.add_request(f"p{r}", prompt(prompt_len), once)
            elif step == "big":
                for j in range(8):
                    engine.add_request(f"b{r}-{j}", prompt(256), once)
            if timed is not None:
                timed.wall = timed.cpu = 0.0
                timed.calls = 0
            others = [_proc_cpu_s(p) for p in pids]
            w, c = time.perf_counter(), time.process_time()
            engine.step()
            rows[step].append({"wall_ms": 1000 * (time.perf_counter() - w), "cpu0_ms": 1000 * (time.process_time() - c),
                               "cpu_others_ms": [1000 * (_proc_cpu_s(p) - o) for p, o in zip(pids, others)],
                               "ar_wall_ms": 1000 * timed.wall if timed else 0.0,
                               "ar_cpu_ms": 1000 * timed.cpu if timed else 0.0, "ar_calls": timed.calls if timed else 0})
    core.close()
    return {"mode": mode, **{s: {k: statistics.median(x[k] for x in v) for k in v[0] if k != "cpu_others_ms"}
                             | {"cpu_others_ms": [statistics.median(x["cpu_others_ms"][i] for x in v)
                                                  for i in range(len(pids))]} for s, v in rows.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--modes", nargs="+", default=["tp1x1", "tp2"], choices=list(MODES))
    p.add_argument("--steps", nargs="+", default=["decode", "mixed", "big"], choices=["decode", "mixed", "big"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--child", default="")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.prompt, args.reps, args.dtype, args.steps)), flush=True)
        return
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    for mode in args.modes:
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--model", args.model, "--reps", str(args.reps),
                               "--prompt", str(args.prompt), "--dtype", args.dtype, "--steps", *args.steps],
                              env=env, capture_output=True, text=True, check=True)
        out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
        for step in args.steps:
            r = out[step]
            total = r["cpu0_ms"] + sum(r["cpu_others_ms"])
            share = f", all-reduce {r['ar_cpu_ms']:.1f} CPU-ms ({100 * r['ar_cpu_ms'] / r['cpu0_ms']:.1f}% of rank 0's), " \
                    f"{r['ar_wall_ms']:.1f} ms wall in {r['ar_calls']:.0f} calls" if r["ar_calls"] else ""
            print(f"{mode:6} {step:6} wall {r['wall_ms']:8.1f} ms  CPU rank 0 {r['cpu0_ms']:7.1f} ms, others "
                  f"{[round(x, 1) for x in r['cpu_others_ms']]}, all ranks {total:7.1f} ms{share}  (load {load})",
                  flush=True)


if __name__ == "__main__":
    main()
