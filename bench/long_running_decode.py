"""Decode in a long-running engine, whose free queue has wrapped around.

A fresh engine hands out its blocks in id order, so benchmarks that start a
server and send a few hundred requests read K/V from long forward runs of
memory. An engine that has served for a while hands out blocks that
finished requests returned to the free queue, and decode attention then
reads whatever order those blocks come back in. This bench keeps
``--concurrency`` requests with long random prompts running, first until
the pool has been reused ``--wrap`` times over, then for ``--requests`` more,
and reports over that second window:

* the median time of decode-only steps (every running request decoding);
* output tokens per second, prefill included;
* how the running requests' block tables are laid out: the share of
  neighbouring entries that are the next block id (+1), the previous (-1),
  or anything else.

A/B against another tree: ``PYTHONPATH=/path/to/tree/src python bench/long_running_decode.py``.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvferry import LLMEngine, SamplingParams
from kvferry.config import EngineArgs
from kvferry.model.cpu_features import cpu_features


def table_layout(tables: list[list[int]]) -> dict[str, float]:
    pairs = [(a, b) for ids in tables for a, b in zip(ids, ids[1:])]
    if not pairs:
        return {"next": 0.0, "previous": 0.0, "other": 0.0}
    up = sum(1 for a, b in pairs if b == a + 1)
    down = sum(1 for a, b in pairs if b == a - 1)
    return {"next": round(up / len(pairs), 3), "previous": round(down / len(pairs), 3),
            "other": round((len(pairs) - up - down) / len(pairs), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(1024, 3072), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(64, 192), metavar=("MIN", "MAX"))
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--wrap", type=float, default=1.5, help="warm up until this many pools' worth of blocks were taken")
    p.add_argument("--requests", type=int, default=24, help="requests to finish in the measured window")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    engine = LLMEngine.from_engine_args(EngineArgs(dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_memory_gb))
    kv = engine.core.scheduler.kv
    pool_tokens = kv.pool.num_blocks * kv.block_size
    vocab = min(engine.core.loaded.model.config.vocab_size, 40000)

    steps: list[tuple[int, float]] = []  # (tokens scheduled, seconds) of every step
    core_step = engine.core.step

    def timed_step():
        out = core_step()
        steps.append((out.num_scheduled_tokens, out.step_duration_s))
        return out

    engine.core.step = timed_step
    submitted = 0
    allocated_tokens = 0

    def submit() -> None:
        nonlocal submitted, allocated_tokens
        prompt_len = rng.randint(*args.prompt_len)
        output_len = rng.randint(*args.output_len)
        engine.add_request(f"r{submitted}", [rng.randint(100, vocab) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0))
        submitted += 1
        allocated_tokens += prompt_len + output_len

    for _ in range(args.concurrency):
        submit()
    finished, window_start, tables = 0, None, []
    out_tokens, t0 = 0, 0.0
    while finished < args.requests:
        outputs = engine.step()
        if window_start is not None:
            out_tokens += sum(1 for o in outputs)  # one new token per changed sequence
            if len(steps) % 16 == 0:
                tables.extend([b.block_id for b in blocks] for blocks in kv.req_blocks.values() if len(blocks) > 1)
        for o in outputs:
            if not o.finished:
                continue
            if window_start is not None:
                finished += 1
            submit()
        if window_start is None and allocated_tokens >= args.wrap * pool_tokens:
            window_start, t0 = len(steps), time.perf_counter()
    seconds = time.perf_counter() - t0
    window = steps[window_start:]
    decode = [s for n, s in window if n == args.concurrency]
    print(json.dumps({
        "cpu": cpu_features().describe(), "threads": torch.get_num_threads(), "dtype": str(engine.core.loaded.dtype),
        "concurrency": args.concurrency, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "pool_tokens": pool_tokens, "block_size": kv.block_size, "requests": args.requests,
        "decode_steps": len(decode), "decode_step_ms": round(statistics.median(decode) * 1e3, 2) if decode else None,
        "output_tok_s": round(out_tokens / seconds, 1), "tables": table_layout(tables),
    }))


if __name__ == "__main__":
    main()
