"""What makes the default's slowest requests slow at c1: per-request TPOT
with speculation and without, in-process, in CPU and wall time.

``bench/spec_default.py`` reports TPOT p99 at c1 over a handful of
requests, so its p99 is the worst request's TPOT ((latency - TTFT) /
(tokens - 1)). This bench replays its c1 cases the way one of its servers
sees them: a fresh ``LLM`` per side and sitting (a cold controller, empty
suffix tries), the chat prompts one at a time, then the code prompts one at
a time, every side's engine in one process and the sides taking turns
request by request (so that both see the same load). Every engine step is
timed (wall and process CPU seconds; run it with one torch thread, where CPU
time is the step's own work) and classed by the drafts it verified, so that
per request it gives:

- TPOT in CPU and wall ms (decode steps only, as the served TPOT);
- its verify steps and plain steps, the drafts verified and accepted;

and per side and case, over all sittings: the median and the max of the
per-request TPOTs (the max is what a 6-request p99 reads), each over off's,
and the CPU ms of plain steps and of verify steps per number of drafts.

    python bench/spec_tpot_tail.py [--sittings 6] [--n 6] [--tokens 64] [--cases chat code]
        [--sides default off] [--threads 1] [--out FILE.json]
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


def instrument(llm, steps: list[dict]) -> None:  # noqa: ANN001
    """Times each engine step; notes its drafts and its accepted drafts."""
    core = llm.engine.core
    sched = core.scheduler
    step = core.step

    def timed_step():
        out_box = {}
        inner = sched.schedule

        def grab():
            out_box["s"] = inner()
            return out_box["s"]

        sched.schedule = grab
        before = core.stats()
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            out = step()
        finally:
            sched.schedule = inner
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        s = out_box.get("s")
        if s is not None and s.num_scheduled_tokens:
            after = core.stats()
            drafts = sum(len(d) for d in s.spec_token_ids.values())
            decode = all(n == 1 + len(s.spec_token_ids.get(r, ())) for r, n in s.num_scheduled_tokens.items())
            steps.append({"wall": wall, "cpu": cpu, "k": drafts, "decode": decode,
                          "accepted": after.num_accepted_tokens - before.num_accepted_tokens})
        return out

    core.step = timed_step


def request_row(side: str, case: str, i: int, n: int, steps: list[dict]) -> dict:
    dec = [s for s in steps if s["decode"]]
    return {"side": side, "case": case, "i": i, "tokens": n,
            "tpot_cpu_ms": 1e3 * sum(s["cpu"] for s in dec) / max(n - 1, 1),
            "tpot_wall_ms": 1e3 * sum(s["wall"] for s in dec) / max(n - 1, 1),
            "verify_steps": sum(1 for s in dec if s["k"]), "plain_steps": sum(1 for s in dec if not s["k"]),
            "failed_verify_steps": sum(1 for s in dec if s["k"] and not s["accepted"]),
            "drafted": sum(s["k"] for s in dec), "accepted": sum(s["accepted"] for s in dec),
            "ks": "".join(str(min(s["k"], 9)) for s in dec),
            "step_cpu_ms": [round(1e3 * s["cpu"], 2) for s in dec], "step_accepted": [s["accepted"] for s in dec]}


def one_sitting(sides: list[str], cases: dict[str, list[str]], args: argparse.Namespace) -> list[dict]:
    """Fresh engines for every side, the same prompts request by request,
    the sides' order alternating from one request to the next (both see
    the same load, within a request's time)."""
    from kvferry import LLM, SamplingParams

    llms = {side: LLM(speculative=None if side == "off" else side if side == "default" else json.loads(side),
                      kv_cache_memory_gb=0.5, max_num_seqs=4) for side in sides}
    steps: dict[str, list[dict]] = {side: [] for side in sides}
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    rows = []
    try:
        for side, llm in llms.items():
            # The served bench's client sends one test request before its cases.
            llm.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
            instrument(llm, steps[side])
        turn = 0
        for case, prompts in cases.items():
            for i, prompt in enumerate(prompts):
                for side in (sides if turn % 2 == 0 else list(reversed(sides))):
                    steps[side].clear()
                    out = llms[side].generate([prompt], sp)[0]
                    rows.append(request_row(side, case, i, len(out.outputs[0].token_ids), steps[side]))
                turn += 1
    finally:
        for llm in llms.values():
            llm.engine.core.close()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sittings", type=int, default=6, help="fresh engines per side, the sides alternating")
    p.add_argument("--n", type=int, default=6, help="prompts per case (spec_default.py's --c1-prompts)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--cases", nargs="+", default=["chat", "code"])
    p.add_argument("--sides", nargs="+", default=["default", "off"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--verbose", action="store_true", help="each request's row")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from kvferry.model.loader import load_model
    from spec_default import chat_prompts, code_prompts

    tok = load_model(None).tokenizer
    makers = {"chat": chat_prompts, "code": code_prompts}
    cases = {c: makers[c](tok, args.n) for c in args.cases}
    print(f"load average at start: {os.getloadavg()}", flush=True)
    rows: list[dict] = []
    for i in range(args.sittings):
        got = one_sitting(args.sides if i % 2 == 0 else list(reversed(args.sides)), cases, args)
        for r in got:
            r["sitting"] = i
            if args.verbose:
                print(json.dumps({k: v for k, v in r.items() if not k.startswith("step_")}), flush=True)
        rows += got
    print(f"load average at end: {os.getloadavg()}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows))
    off = args.sides[-1] if "off" not in args.sides else "off"
    for case in args.cases:
        for clock in ("cpu", "wall"):
            key = f"tpot_{clock}_ms"
            per = {s: [r for r in rows if r["side"] == s and r["case"] == case] for s in args.sides}
            # Each sitting's worst request (what a c1 run's p99 reads), median over sittings.
            worst = {s: statistics.median(max(r[key] for r in rs if r["sitting"] == j)
                                          for j in range(args.sittings)) for s, rs in per.items()}
            med = {s: statistics.median(r[key] for r in rs) for s, rs in per.items()}
            print(f"{case} {clock}: " + "; ".join(
                f"{s[:30]} median TPOT {med[s]:.2f} ms ({med[off] / med[s]:.2f}x off's rate), "
                f"worst per sitting {worst[s]:.2f} ms ({worst[s] / worst[off]:.2f}x off's)" for s in args.sides))
        for s in args.sides:
            if s == "off":
                continue
            rs = [r for r in rows if r["side"] == s and r["case"] == case]
            by_k: dict[int, list[float]] = defaultdict(list)
            for r in rs:
                for k, ms in zip(r["ks"], r["step_cpu_ms"]):
                    by_k[int(k)].append(ms)
            print(f"  {case} {s[:30]} step CPU ms by drafts: " + ", ".join(
                f"k={k}: {statistics.median(v):.2f} (n={len(v)})" for k, v in sorted(by_k.items())))
            print(f"  {case} {s[:30]} acceptance: {sum(r['accepted'] for r in rs)}/{sum(r['drafted'] for r in rs)}; "
                  f"verify steps {sum(r['verify_steps'] for r in rs)}, of which none held "
                  f"{sum(r['failed_verify_steps'] for r in rs)}")
            # Per request, its TPOT over off's for the same prompt in the same sitting (same load).
            offs = {(r["sitting"], r["i"]): r for r in rows if r["side"] == off and r["case"] == case}
            worst = sorted(((r["tpot_cpu_ms"] / offs[(r["sitting"], r["i"])]["tpot_cpu_ms"], r["i"], r["ks"])
                            for r in rs), reverse=True)[:3]
            print(f"  {case} {s[:30]} worst requests' CPU TPOT / off's same request: "
                  + "; ".join(f"{x:.3f} (prompt {i}, k {ks})" for x, i, ks in worst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
