"""Speculation settings side by side in one process, on a machine others load.

Each ``--specs`` entry is an ``LLM(speculative=...)`` engine (``default``:
the serving default, ``off``, or a JSON config), all on the same model with
one compute thread; every request (or batch of ``--batch`` requests) runs on
each engine in turn, the order alternating, and the rates are output tokens
per CPU second of this process: with one thread that is the engine's own
work, which other processes' load does not change (wall seconds, printed
too, do change with it). Prints per engine the CPU and wall ms per token,
drafts, drafted and accepted tokens and the rate against the first entry;
``--dump`` adds the controller's per-bucket figures (ms per level, tokens
per step, steps seen).

Workloads: ``cycle`` (bench/gguf_vs_llama_cpp.py's prompts: a 24-word list
cycled), ``chat`` (held-out chitchat conversations), ``code`` (bench/
spec_default.py's "add type hints" prompts), ``agentic`` (bench/
suffix_agentic.py's multi-turn edits of one file). ``--repetition-penalty
10`` keeps the target off every token it has seen: drafts copied from
earlier text then fail (the workload whose drafts are rejected).

    python bench/spec_cost_ab.py chat [--specs off default] [--n 6] [--tokens 64] [--gguf] [--batch 1]
"""
import sys, os, time, json, argparse
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
ap = argparse.ArgumentParser()
ap.add_argument("workload", choices=["cycle", "chat", "code", "agentic"]); ap.add_argument("--n", type=int, default=6); ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--temp", type=float, default=0.0); ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--specs", nargs="+", default=["off", "default"]); ap.add_argument("--gguf", action="store_true")
ap.add_argument("--batch", type=int, default=1); ap.add_argument("--dump", action="store_true")
ap.add_argument("--repetition-penalty", type=float, default=1.0)
a = ap.parse_args()
torch.set_num_threads(a.threads)
from kvferry import LLM, SamplingParams
from kvferry.model.resolve import embedded_gguf_path
common = dict(kv_cache_memory_gb=0.5, max_num_seqs=64)
if a.gguf:
    common.update(model=str(embedded_gguf_path()), quantization="gguf")
engines = {s: LLM(speculative=None if s == "off" else s if s == "default" else json.loads(s), **common)
           for s in a.specs}
tok = engines[a.specs[0]].tokenizer
if a.workload == "cycle":
    from gguf_vs_llama_cpp import prompt
    prompts = [prompt(i, 160) for i in range(a.n)]
elif a.workload == "chat":
    from spec_default import chat_prompts
    prompts = chat_prompts(tok, a.n)
elif a.workload == "code":
    from spec_default import code_prompts
    prompts = code_prompts(tok, a.n)
elif a.workload == "agentic":
    from suffix_agentic import EDITS
    prompts = None
sp = SamplingParams(max_tokens=a.tokens, temperature=a.temp, ignore_eos=True, seed=1 if a.temp else None,
                    repetition_penalty=a.repetition_penalty)
for e in engines.values():
    e.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
cpu = {s: 0.0 for s in engines}; wall = {s: 0.0 for s in engines}; toks = {s: 0 for s in engines}
before = {s: e.engine.core.stats() for s, e in engines.items()}
messages = []
for i in range(a.n):
    if prompts is None:
        messages.append({"role": "user", "content": EDITS[i % len(EDITS)]})
        ps = [tok.apply_chat_template(messages, add_generation_prompt=True)]
    else:
        ps = prompts[i * a.batch % len(prompts):][: a.batch] if a.batch > 1 else [prompts[i]]
        while len(ps) < a.batch: ps = ps + prompts[: a.batch - len(ps)]
    order = list(engines) if i % 2 == 0 else list(reversed(engines))
    line = {}
    for s in order:
        c0, w0 = time.process_time(), time.perf_counter()
        outs = engines[s].generate(ps, sp)
        c, w = time.process_time() - c0, time.perf_counter() - w0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        cpu[s] += c; wall[s] += w; toks[s] += n
        line[s] = round(c * 1e3 / n, 2)
        last = outs
    if prompts is None:
        messages.append({"role": "assistant", "content": last[0].outputs[0].text})
    print(i, "cpu ms/tok", line, flush=True)
res = {}
for s, e in engines.items():
    st = e.engine.core.stats(); b = before[s]
    res[s] = dict(cpu_ms_tok=round(cpu[s] * 1e3 / toks[s], 2), wall_ms_tok=round(wall[s] * 1e3 / toks[s], 2),
                  drafts=st.num_drafts - b.num_drafts, drafted=st.num_draft_tokens - b.num_draft_tokens,
                  accepted=st.num_accepted_tokens - b.num_accepted_tokens, steps=st.num_steps - b.num_steps)
base = res[a.specs[0]]["cpu_ms_tok"]
for s, r in res.items():
    r["vs_first"] = round(base / r["cpu_ms_tok"], 3)
    print(s, json.dumps(r))
    bud = engines[s].engine.core.scheduler.draft_budget
    if a.dump and bud is not None and hasattr(bud, "_costs"):
        for k, c in sorted(bud._costs.items()):
            print("  bucket", k, [None if x is None else round(x*1e3, 2) for x in c.seconds], [None if x is None else round(x, 2) for x in c.gain], c.seen, c.steps)
print("load average", os.getloadavg())
