"""Where the default speculation's time goes, per decode step, at batch 1.

Two engines in one process (``off`` and the serving default, ``auto`` under
the cost-aware controller), one compute thread, requests interleaved (the
order alternating), each step timed in wall and CPU seconds (with one
thread the process's CPU time is the step's own work, which other
processes' load changes little). Steps are classed:

- ``plain``: the off engine's decode steps;
- ``spec k=0``: the default's decode steps that verified no drafts (the
  cost of having speculation configured while not drafting);
- ``spec k=N``: its steps that verified N drafts (and of those, the
  scheduler's share: proposers and the controller; the runner's drafting
  share: the head's forward);

and per class the median wall and CPU ms, with the drafts' acceptance and
the proposer auto chose. Each request's sequence of k (``--ks``) shows the
controller's learning phase and its probes.

With ``--batch B`` each round is one ``generate`` of B prompts (decode
steps at batch B, all prompts finishing together): at a batch where the
default drafts nothing (16 and up), its steps should cost what plain
decoding's do, and its scheduler share (``propose_ms``: the controller's
O(1) decision per request; no proposer is asked) should stay in the noise.

A spec may name environment variables set while its engine is built,
``SPEC@VAR=VALUE[,VAR=VALUE]``: ``default@KVFERRY_DRAFT_HEAD_INT8=0`` is
the default with the float draft head, beside ``default`` (int8) in the
same process, rounds interleaved.

    python bench/spec_default_steps.py chat [--n 6] [--tokens 64] [--specs off default] [--batch 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def instrument(llm, records: list[dict], a_parts: bool = False) -> None:  # noqa: ANN001
    core = llm.engine.core
    sched = core.scheduler
    parts: dict[str, float] = defaultdict(float)

    def wrap(obj, attr: str, name: str) -> None:  # noqa: ANN001
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            t0 = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                parts[name] += time.process_time() - t0

        setattr(obj, attr, timed)

    if sched.proposer is not None:
        wrap(sched, "propose", "propose")
    runner = core.runner
    if runner.drafter is not None:
        wrap(runner.drafter, "propose", "head")
    wrap(runner, "_sample", "sample")
    if a_parts:
        # The rest of a step, part by part (each wrapped where the runner
        # calls it: the module attribute for the tree compaction).
        import kvferry.engine.runner as runner_module

        wrap(sched, "schedule", "schedule")  # the proposer's share is also in propose
        wrap(sched, "update_from_output", "update")
        wrap(runner, "_prepare", "prepare")
        wrap(runner, "_forward", "forward")
        wrap(runner.model, "compute_logits", "logits")
        wrap(runner_module, "compact", "compact")
    step = core.step

    def timed_step():
        w0, c0 = time.perf_counter(), time.process_time()
        sched_out = None
        inner_schedule = sched.schedule

        def grab():
            nonlocal sched_out
            sched_out = inner_schedule()
            return sched_out

        sched.schedule = grab
        try:
            out = step()
        finally:
            sched.schedule = inner_schedule
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        rec = {"wall": wall, "cpu": cpu, **parts}
        if a_parts:  # the top-level parts (propose is in schedule, compact in sample)
            rec["other"] = cpu - sum(parts.get(k, 0.0) for k in
                                     ("schedule", "update", "head", "prepare", "forward", "logits", "sample"))
        parts.clear()
        if sched_out is not None and sched_out.num_scheduled_tokens:
            drafts = {rid: len(d) for rid, d in sched_out.spec_token_ids.items()}
            decode = all(n == 1 + drafts.get(rid, 0) for rid, n in sched_out.num_scheduled_tokens.items())
            rec.update(decode=decode, k=sum(drafts.values()), n=len(sched_out.num_scheduled_tokens))
            records.append(rec)
        return out

    core.step = timed_step


def build(LLM, spec: str, a: argparse.Namespace):  # noqa: ANN001, ANN201, N803
    """The engine of ``spec`` ("off", "default", a JSON config), built with
    the environment variables after an "@" set (and restored after)."""
    spec, _, env = spec.partition("@")
    changes = dict(item.split("=", 1) for item in env.split(",") if item)
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        return LLM(speculative=None if spec == "off" else spec if spec == "default" else json.loads(spec),
                   kv_cache_memory_gb=a.kv_gb, max_num_seqs=max(64, a.batch))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=["chat", "code"])
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--specs", nargs="+", default=["off", "default"])
    ap.add_argument("--ks", action="store_true", help="print each request's k per step")
    ap.add_argument("--skip", type=int, default=0, help="rounds run before timing (a warm controller)")
    ap.add_argument("--batch", type=int, default=1, help="prompts per round, decoded together")
    ap.add_argument("--kv-gb", type=float, default=0.5, help="KV cache per engine (more for large batches)")
    ap.add_argument("--parts", action="store_true",
                    help="also time the scheduler, the runner's input preparation, the forward pass, the LM head "
                         "and a tree's KV compaction (the step's other parts: other_ms)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    from kvferry import LLM, SamplingParams
    from spec_default import chat_prompts, code_prompts

    engines = {s: build(LLM, s, a) for s in a.specs}
    tok = engines[a.specs[0]].tokenizer
    prompts = (chat_prompts if a.workload == "chat" else code_prompts)(tok, (a.n + a.skip) * a.batch)
    rounds = [prompts[i * a.batch : (i + 1) * a.batch] for i in range(len(prompts) // a.batch)]
    sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    for e in engines.values():
        e.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
        for group in rounds[: a.skip]:
            e.generate(group, sp)
    records = {s: [] for s in engines}
    for s, e in engines.items():
        instrument(e, records[s], a.parts)
    before = {s: e.engine.core.stats() for s, e in engines.items()}
    cpu = defaultdict(float)
    toks = defaultdict(int)
    for i, group in enumerate(rounds[a.skip:]):
        for s in (a.specs if i % 2 == 0 else list(reversed(a.specs))):
            start = len(records[s])
            c0 = time.process_time()
            outs = engines[s].generate(group, sp)
            cpu[s] += time.process_time() - c0
            toks[s] += sum(len(out.outputs[0].token_ids) for out in outs)
            if a.ks and s != "off":
                print(f"  req {i} {s} k:", "".join(str(r["k"]) for r in records[s][start:] if r["decode"]))
    for s, recs in records.items():
        st, b = engines[s].engine.core.stats(), before[s]
        classes: dict[str, list[dict]] = defaultdict(list)
        for r in recs:
            if r["decode"]:
                classes["plain" if s == "off" else f"k={r['k']}"].append(r)
        summary = {}
        for name, rows in sorted(classes.items()):
            keys = sorted({k for r in rows for k in r if k not in ("decode", "k", "n")})
            summary[name] = {"steps": len(rows), "batch": statistics.median(r["n"] for r in rows),
                             **{f"{k}_ms": round(statistics.median(r.get(k, 0.0) for r in rows) * 1e3, 2)
                                                    for k in keys}}
        proposer = engines[s].engine.core.scheduler.proposer
        chosen = getattr(proposer, "num_chosen", None)
        print(s, json.dumps({"cpu_ms_per_token": round(cpu[s] * 1e3 / toks[s], 2),
                             "drafted": st.num_draft_tokens - b.num_draft_tokens,
                             "accepted": st.num_accepted_tokens - b.num_accepted_tokens,
                             "chosen": chosen, "steps": summary}))
    if len(a.specs) > 1:
        base = cpu[a.specs[0]] / toks[a.specs[0]]
        print("rate vs", a.specs[0], {s: round(base / (cpu[s] / toks[s]), 3) for s in a.specs[1:]})
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
