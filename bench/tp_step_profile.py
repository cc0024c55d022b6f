"""Where a tensor-parallel decode step's time goes, per rank (issue 47):
TP 2 at 1 thread per rank on the Llama-3.2-1B-shaped checkpoint (random
bf16 weights, bench/_peer_models.py), batch 1 (or ``--batch``), offline.

Every rank runs with bench/_tp_profile/sitecustomize.py, which times per
step (wall and the step thread's CPU): the C++ layer halves
(``cpp_attention``, ``cpp_mlp``), the residual add after the second
all-reduce, the all-reduce (``ar_total``: copy in, wait, add;
``ar_wait`` of it: waiting for the other rank), the logits' all-gather,
the step's message (rank 0's ``publish``; a worker's ``receive``: waiting
on its socket, then the unpickle) and the whole ``execute``; rank 0 also
the engine's step around it. Prints medians per step over the timed steps.

    python bench/tp_step_profile.py [--tokens 64] [--batch 1] [--layers 16] [--tp 2] [--threads 1]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _peer_models import LLAMA_1B, random_checkpoint  # noqa: E402


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=LLAMA_1B["num_hidden_layers"])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warm", type=int, default=8, help="decode steps left out at the start")
    args = p.parse_args()
    model = str(random_checkpoint("llama-1b", LLAMA_1B, num_hidden_layers=args.layers))
    out_dir = tempfile.mkdtemp(prefix="tp-step-profile-")
    os.environ["TP_STEP_PROFILE"] = out_dir
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE / "_tp_profile"), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(HERE / "_tp_profile"))
    import sitecustomize  # noqa: F401 - this process's timers (rank 0)

    import torch

    from kvferry import LLM, SamplingParams

    if args.tp == 1:
        torch.set_num_threads(args.threads)
    llm = LLM(model=model, tensor_parallel_size=args.tp, cpu_threads_per_rank=args.threads,
              num_kv_blocks=256, block_size=16, enable_prefix_caching=False, max_num_seqs=max(16, args.batch))
    load_before = loadavg()
    engine = llm.engine
    params = SamplingParams(max_tokens=args.tokens + 1, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [3 + (7 * i + j) % 300 for j in range(64)], params)
    engine.step()  # the prefill
    steps, t_cpu0 = [], time.process_time()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    cpu_total = time.process_time() - t_cpu0
    sitecustomize.atexit_dump = None
    llm.engine.core.close()
    sitecustomize_records = sitecustomize._records  # rank 0's, in this process
    time.sleep(1.0)  # the workers' records land at their exit
    ranks = {0: sitecustomize_records}
    for path in glob.glob(os.path.join(out_dir, "rank*.json")):
        r = int(os.path.basename(path)[4:].split("-")[0])
        if r != 0:
            with open(path) as f:
                ranks[r] = json.load(f)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load {load_before} "
          f"before, {loadavg()} after; TP {args.tp} x {args.threads} thread(s), batch {args.batch}, "
          f"{args.layers} layers")
    timed = steps[args.warm:]
    step_ms = 1000 * statistics.median(timed)
    print(f"engine step (rank 0): median {step_ms:.2f} ms wall over {len(timed)} steps; "
          f"rank 0 process CPU {1000 * cpu_total / len(steps):.2f} ms/step")
    for r in sorted(ranks):
        recs = [x for x in ranks[r] if x.get("tokens", [0])[0] == args.batch][args.warm:]
        names = sorted({k for x in recs for k in x if k != "tokens"})
        print(f"rank {r}: {len(recs)} decode steps")
        for name in names:
            wall = statistics.median(x.get(name, [0, 0, 0])[0] for x in recs) * 1000
            cpu = statistics.median(x.get(name, [0, 0, 0])[1] for x in recs) * 1000
            calls = statistics.median(x.get(name, [0, 0, 0])[2] for x in recs)
            print(f"  {name:16s} wall {wall:7.2f} ms ({100 * wall / step_ms:5.1f}%)  cpu {cpu:7.2f} ms  calls {calls:g}")


if __name__ == "__main__":
    main()
