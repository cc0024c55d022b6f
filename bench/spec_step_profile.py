"""Where a speculative decode step's time goes at batch 1.

Runs one request of ``bench/spec_decode.py``'s copy (or chat) task through a
plain engine and a speculative one, interleaved, and times each part of every
decode step with wall-clock wrappers around the real components (nothing is
replaced): the scheduler (``schedule`` + ``update_from_output``, proposer
included for ngram), the runner's drafting (head / draft model), the target's
forward pass, the LM head, the sampler / verifier, and what is left of the
step. It then reports, per number of tokens in the step (1 = plain,
1 + k = verify), the median time of each part, and the speculative run's
acceptance and mean accepted length, and the bound they give::

    speedup <= mean accepted length * plain step / speculative step

Also: the forward pass alone at 1 .. 1 + k tokens at the same context, so
the verify window's own cost is separated from the step's overhead.

    python bench/spec_step_profile.py [--method ngram] [--task copy] [--k 4] [--output-len 96]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


class StepTimer:
    """Wraps named callables on live objects; sums their seconds per step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, obj, attr: str, name: str) -> None:  # noqa: ANN001
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - t0

        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        out, self.current = dict(self.current), defaultdict(float)
        return out


def instrument(llm) -> tuple[StepTimer, list[tuple[int, dict[str, float]]]]:  # noqa: ANN001
    """Per-step records (tokens in the step, seconds per part)."""
    core = llm.engine.core
    timer = StepTimer()
    runner = core.runner
    timer.wrap(core.scheduler, "schedule", "scheduler")
    timer.wrap(core.scheduler, "update_from_output", "scheduler")
    timer.wrap(runner.model, "compute_logits", "lm_head")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner, "_sample", "sample+verify")
    if runner.drafter is not None:
        timer.wrap(runner.drafter, "propose", "draft")
    records: list[tuple[int, dict[str, float]]] = []
    step = core.step

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        parts = timer.take()
        parts["step"] = time.perf_counter() - t0
        parts["lm_head"] = parts.get("lm_head", 0.0)
        records.append((out.num_scheduled_tokens, parts))
        return out

    core.step = timed_step
    return timer, records


def forward_costs(llm, prompt: list[int], max_tokens: int, reps: int) -> dict[int, float]:  # noqa: ANN001
    """Median seconds of the target's forward pass over T = 1 .. max_tokens
    new tokens at the prompt's context (KV written to scratch slots)."""
    import numpy as np
    import torch

    from kvferry import SamplingParams
    from kvferry.core.outputs import NewRequestData
    from kvferry.model.input_batch import flatten

    runner = llm.engine.core.runner
    # A throwaway row over the first blocks of the pool: the timing only
    # needs real shapes, and this engine is not used for output afterwards.
    bs = runner.block_size
    n = len(prompt) + max_tokens
    blocks = list(range(1, -(-n // bs) + 1))
    data = NewRequestData("profile", prompt + [0] * max_tokens, SamplingParams(), [], blocks, 0)
    batch = runner.batch
    batch.add(data)
    row = batch.index["profile"]
    costs = {}
    with torch.inference_mode():
        for t in range(1, max_tokens + 1):
            samples = []
            for _ in range(reps):
                flat = flatten(batch, np.array([row]), np.array([len(prompt)]), np.array([t]), bs)
                meta = flat.metadata(bs, runner.device, runner.kv_cache.dtype)
                ids, pos = torch.from_numpy(flat.input_ids), torch.from_numpy(flat.positions)
                t0 = time.perf_counter()
                runner.model(ids, pos, runner.kv_cache, meta)
                samples.append(time.perf_counter() - t0)
            costs[t] = statistics.median(samples)
    batch.remove("profile")
    return costs


def summarize(records: list[tuple[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    by_tokens: dict[int, list[dict[str, float]]] = defaultdict(list)
    for tokens, parts in records:
        by_tokens[tokens].append(parts)
    table = {}
    for tokens, rows in sorted(by_tokens.items()):
        names = sorted({k for r in rows for k in r})
        med = {k: statistics.median(r.get(k, 0.0) for r in rows) * 1e3 for k in names}
        known = sum(v for k, v in med.items() if k not in ("step", "forward"))
        med["other"] = med["step"] - known - med.get("forward", 0.0) + med.get("lm_head", 0.0) * 0
        med["steps"] = len(rows)
        table[tokens] = {k: round(v, 2) for k, v in med.items()}
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="ngram", choices=["ngram", "head", "draft"])
    ap.add_argument("--task", default="copy", choices=["copy", "chat"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--head", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--spec-json", default=None, help="extra speculative config keys (JSON)")
    ap.add_argument("--model", default=None, help="target (default: the embedded model; a .gguf file too)")
    ap.add_argument("--quantization", default=None, help="e.g. gguf: run a .gguf file's blocks")
    ap.add_argument("--adaptive", action="store_true",
                    help="let the controller choose k (default: k drafts every step, the verify window's cost)")
    args = ap.parse_args()

    import torch

    from kvferry import LLM, SamplingParams
    from spec_decode import method_config, prompts_for

    torch.set_num_threads(args.threads)
    common = dict(model=args.model, dtype=args.dtype, max_num_seqs=1, kv_cache_memory_gb=0.25)
    if args.quantization:
        common["quantization"] = args.quantization
    spec_args = argparse.Namespace(k=args.k, draft_model=args.draft_model, head=args.head, fixed_k=not args.adaptive)
    spec = method_config(args.method, spec_args)
    if args.spec_json:
        spec.update(json.loads(args.spec_json))
    plain, specd = LLM(**common), LLM(speculative=spec, **common)
    prompts = prompts_for(plain, args.task, 1)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for llm in (plain, specd):
        llm.generate(prompts, params)  # warm-up, fills the prefix cache
    _, plain_records = instrument(plain)
    _, spec_records = instrument(specd)
    before = specd.engine.stats()
    wall = {"plain": [], "spec": []}
    for _ in range(args.runs):
        for name, llm in (("plain", plain), ("spec", specd)):
            t0 = time.perf_counter()
            out = llm.generate(prompts, params)
            wall[name].append(len(out[0].outputs[0].token_ids) / (time.perf_counter() - t0))
    after = specd.engine.stats()
    drafts = after.num_drafts - before.num_drafts
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    decode_plain = [r for r in plain_records if r[0] == 1]
    plain_step = statistics.median(p["step"] for _, p in decode_plain)
    decode_spec = [r for r in spec_records if r[0] <= 1 + args.k]
    spec_step = statistics.median(p["step"] for _, p in decode_spec)
    mal = 1 + accepted / max(drafts, 1)
    report = {
        "tok_s": {k: round(statistics.median(v), 1) for k, v in wall.items()},
        "speedup": round(statistics.median(wall["spec"]) / statistics.median(wall["plain"]), 2),
        "acceptance": round(accepted / max(drafted, 1), 3),
        "mean_accepted_length": round(mal, 2),
        "draft_steps_share": round(drafts / max(len(decode_spec), 1), 2),
        "plain_step_ms": round(plain_step * 1e3, 2),
        "spec_step_ms": round(spec_step * 1e3, 2),
        "plain_by_tokens_ms": summarize(decode_plain),
        "spec_by_tokens_ms": summarize(decode_spec),
        "forward_only_ms": {t: round(s * 1e3, 2) for t, s in
                            forward_costs(plain, prompts[0], 1 + args.k, 15).items()},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
