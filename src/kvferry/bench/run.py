"""One benchmark run from parsed arguments: build the workload, find the
model, scrape the server's counters, run the load, summarize."""
from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from kvferry.bench import workloads as w
from kvferry.bench.corpus import CHARS_PER_TOKEN, load_documents, long_doc_workload
from kvferry.bench.metrics import summarize, summarize_by_tenant
from kvferry.bench.prom import scrape, server_delta
from kvferry.bench.runner import RunConfig, run_load
from kvferry.bench.trace import count_clipped, load_trace, trace_workload
from kvferry.bench.workloads import BenchError, LengthDist, Session


def make_workload(args: argparse.Namespace, context_len: int | None = None) -> tuple[Iterator[Session], int | None]:
    """The session stream for ``args.workload`` and its natural length (a
    trace's number of entries; None for endless generators). ``context_len``:
    the served context, to which a trace's prompts are clipped."""
    out_len = LengthDist.parse(args.output_len, "--output-len")
    if args.workload == "random":
        return w.random_workload(LengthDist.parse(args.input_len, "--input-len"), out_len, args.seed), None
    if args.workload == "shared-prefix":
        return w.shared_prefix_workload(args.num_groups, args.prompts_per_group, args.system_prompt_len,
                                        args.question_len, out_len, args.seed), None
    if args.workload == "multi-turn":
        return w.multi_turn_workload(args.max_turns, args.think_time, out_len, args.seed), None
    if args.workload == "multi-tenant":
        keys = _tenant_keys(args.tenant_keys)
        return w.multi_tenant_workload(keys, args.flood_factor, args.public_prefix_len, args.private_prefix_len,
                                       args.question_len, out_len, args.seed), None
    if args.workload == "long-doc":
        docs = load_documents(args.corpus, args.num_docs, args.doc_len * CHARS_PER_TOKEN, args.seed)
        return long_doc_workload(docs, args.doc_len, args.questions_per_doc, out_len.sample, args.seed), None
    if args.workload == "trace":
        entries = load_trace(args.trace)
        return trace_workload(entries, args.trace_block_size, args.time_scale, args.max_input_len,
                              args.max_output_len, context_len), len(entries)
    raise BenchError(f"--workload: unknown {args.workload!r}")


def _tenant_keys(text: str | None) -> list[str]:
    if text is None:
        return ["tenant-0", "tenant-1", "tenant-2", "flood"]
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if len(keys) < 2:
        raise BenchError("--tenant-keys: need at least two keys (the last one floods)")
    return keys


def clipped_trace_requests(args: argparse.Namespace, context_len: int | None) -> int:
    """How many of the trace's requests (those the run sends) get their
    prompts clipped, to --max-input-len or to the served context."""
    if args.workload != "trace":
        return 0
    entries = load_trace(args.trace)[:args.num_requests]
    return count_clipped(entries, args.max_input_len, args.max_output_len, context_len)


@dataclass(frozen=True, slots=True)
class Target:
    base_url: str  # without /v1
    model: str
    # The served context (GET /v1/models' max_model_len: kvferry and vLLM
    # give it); None when the server does not say.
    max_model_len: int | None = None


def resolve_target(args: argparse.Namespace) -> tuple[str, str]:
    """(base URL without /v1, model name); see ``resolve_served``."""
    target = resolve_served(args)
    return target.base_url, target.model


def resolve_served(args: argparse.Namespace) -> Target:
    """The server, the model (--model, which must be one the server lists,
    or the server's first) and its context. An unreachable server or a
    model it does not serve is a BenchError (one line)."""
    base = args.url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        resp = httpx.get(f"{base}/v1/models", headers=headers, timeout=10, trust_env=False)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {base}: {e or type(e).__name__}") from None
    if resp.status_code != 200:
        raise BenchError(f"{base}/v1/models answered HTTP {resp.status_code}: {resp.text[:200]}")
    try:
        entries = {m["id"]: m for m in resp.json()["data"]}
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{base}/v1/models did not answer an OpenAI model list") from None
    if not entries:
        raise BenchError(f"{base} serves no model (GET /v1/models is empty)")
    if args.model and args.model not in entries:
        raise BenchError(f"--model {args.model!r} is not served by {base}; it serves: {', '.join(entries)}")
    model = args.model or next(iter(entries))
    context = entries[model].get("max_model_len")
    return Target(base, model, context if isinstance(context, int) and context > 0 else None)


def run_once(args: argparse.Namespace, base_url: str, model: str, rate: float | None,
             slo: dict[str, float], context_len: int | None = None) -> dict:
    """One run at ``rate`` (None: the default arrivals); the result JSON object.
    ``context_len``: the served context (trace prompts are clipped to it)."""
    sessions, natural_len = make_workload(args, context_len)
    use_timestamps = args.workload == "trace" and rate is None and args.concurrency is None
    if args.num_requests is not None:
        num_requests = args.num_requests
    elif args.duration is not None:
        num_requests = UNBOUNDED
    else:
        num_requests = natural_len or DEFAULT_NUM_REQUESTS
    hard = args.max_time if args.duration is None else min(args.max_time, args.duration + args.drain_timeout)
    cfg = RunConfig(base_url=base_url, endpoint=args.endpoint, model=model, api_key=args.api_key,
                    num_requests=num_requests, duration_s=args.duration,
                    rate=math.inf if rate is None else rate, burstiness=args.burstiness,
                    concurrency=args.concurrency, use_timestamps=use_timestamps, ignore_eos=args.ignore_eos,
                    temperature=args.temperature, request_timeout_s=args.request_timeout,
                    hard_deadline_s=hard, seed=args.seed)
    before = scrape(base_url, api_key=args.api_key)
    records, duration = run_load(cfg, sessions, show_progress=not args.no_progress,
                                 progress_total=None if num_requests == UNBOUNDED else num_requests)
    after = scrape(base_url, api_key=args.api_key)
    return {
        "config": {"url": base_url, "model": model, "endpoint": args.endpoint, "workload": args.workload,
                   "rate": rate, "concurrency": args.concurrency, "burstiness": args.burstiness,
                   "use_timestamps": use_timestamps, "num_requests": args.num_requests,
                   "duration": args.duration, "seed": args.seed, "ignore_eos": args.ignore_eos,
                   "max_model_len": context_len, "clipped_requests": clipped_trace_requests(args, context_len),
                   "workload_args": _workload_args(args)},
        "summary": summarize(records, duration, slo),
        "per_tenant": summarize_by_tenant(records, duration, slo),
        "server": server_delta(before, after),
        "records": [r.to_json() for r in records],
    }


DEFAULT_NUM_REQUESTS = 100
UNBOUNDED = 10**9  # with --duration only: bounded in time, not in count

_WORKLOAD_ARGS = {
    "random": ("input_len", "output_len"),
    "shared-prefix": ("num_groups", "prompts_per_group", "system_prompt_len", "question_len", "output_len"),
    "multi-turn": ("max_turns", "think_time", "output_len"),
    "long-doc": ("corpus", "doc_len", "num_docs", "questions_per_doc", "output_len"),
    "trace": ("trace", "trace_block_size", "time_scale", "max_input_len", "max_output_len"),
    "multi-tenant": ("tenant_keys", "flood_factor", "public_prefix_len", "private_prefix_len", "question_len",
                     "output_len"),
}


def _workload_args(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in _WORKLOAD_ARGS[args.workload]}
