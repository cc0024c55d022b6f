"""Where a served step's time goes: run ``kvferry serve`` with a recorder on
the front end's side of the core socket, then summarize.

Every EngineCoreOutputs the front end receives carries the core's step
duration, its end time (``timestamp``, CLOCK_MONOTONIC, which every process
on the host shares) and the tokens it scheduled. From those, per step:

* step time, by batch mix (decode-only, or with a prefill chunk);
* the gap before it: the core's idle or bookkeeping time between one step's
  end and the next one's start (inputs, scheduling outside ``step``, stats);
* delivery: how long the message took from the core's send to the front
  end's handling (socket, decode, event loop backlog).

And per request (rows with ``"request"``): its HTTP arrival, when the front
end had sent it to the core, when the core first scheduled it and when its
first token reached the front end. ``--waves`` prints them grouped by the
client's waves (arrivals closer than 50 ms to the previous one), which shows
how the arrivals of a wave are split into the core's steps.

Usage (drive it with any client, e.g. ``vllm bench serve``; stop it with
SIGTERM or Ctrl-C, then the summary prints and the trace is saved):

    python bench/serve_step_trace.py --trace /tmp/steps.jsonl -- --port 8100 --dtype bfloat16
    python bench/serve_step_trace.py --summarize /tmp/steps.jsonl
"""
from __future__ import annotations

import argparse
import atexit
import bisect
import json
import statistics
import time
from pathlib import Path


def record(trace: Path) -> None:
    """Hook the front end's message handler (this process only)."""
    from kvferry.serve.engine_client import AsyncEngineClient

    rows: list[dict] = []
    handle = AsyncEngineClient._on_message

    def on_message(self, worker, message):  # noqa: ANN001 - the client's own types
        received = time.monotonic()
        if message.num_scheduled_tokens:
            decodes = sum(1 for o in message.outputs if o.new_token_ids)
            rows.append(dict(end=message.timestamp, dur=message.step_duration_s, tokens=message.num_scheduled_tokens,
                             outputs=decodes, recv=received))
        handle(self, worker, message)
        if message.num_scheduled_tokens:
            rows[-1]["handled"] = time.monotonic() - received

    AsyncEngineClient._on_message = on_message

    add_request = AsyncEngineClient.add_request

    async def add_request_traced(self, request_id, *args, **kwargs):  # noqa: ANN001
        stream = await add_request(self, request_id, *args, **kwargs)
        requests[request_id] = dict(request=request_id, arrival=stream.arrival_time, sent=time.monotonic())
        return stream

    observe = getattr(AsyncEngineClient, "_observe", None)  # per-request rows only where the hook exists

    def observe_traced(self, stream, out, now):  # noqa: ANN001
        row = requests.get(stream.request_id)
        if row is not None and out.new_token_ids and "first_token" not in row:
            row["first_token"] = now
        if row is not None and out.finished and out.metrics is not None:
            row["first_scheduled"] = out.metrics.first_scheduled_time
            row["prompt_tokens"] = out.metrics.num_prompt_tokens
            rows.append(requests.pop(stream.request_id))
        observe(self, stream, out, now)

    requests: dict[str, dict] = {}
    if observe is not None:
        AsyncEngineClient.add_request = add_request_traced
        AsyncEngineClient._observe = observe_traced
    atexit.register(lambda: (trace.write_text("\n".join(json.dumps(r) for r in rows)), summarize(trace)))


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(trace: Path, waves: bool = False) -> None:
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line]
    reqs = [r for r in rows if "request" in r]
    rows = [r for r in rows if "request" not in r]
    if reqs:
        summarize_requests(reqs, rows, waves)
    if not rows:
        print("no steps recorded")
        return
    gaps = [b["end"] - b["dur"] - a["end"] for a, b in zip(rows, rows[1:])]
    busy = sum(r["dur"] for r in rows)
    span = rows[-1]["end"] - rows[0]["end"] + rows[0]["dur"]
    print(f"{len(rows)} steps over {span:.1f} s: in step {busy / span:.0%}, between steps {sum(g for g in gaps if g < 0.5):.2f} s "
          f"(gaps under 0.5 s; p50 {_pct(gaps, .5) * 1e3:.2f} ms, p99 {_pct(gaps, .99) * 1e3:.2f} ms)")
    delivery = [r["recv"] - r["end"] for r in rows]
    handled = [r.get("handled", 0.0) for r in rows]
    print(f"delivery core->front end p50 {_pct(delivery, .5) * 1e3:.2f} ms p99 {_pct(delivery, .99) * 1e3:.2f} ms; "
          f"front end handling p50 {_pct(handled, .5) * 1e3:.2f} ms p99 {_pct(handled, .99) * 1e3:.2f} ms")
    print("kind          steps  tokens p50  outputs p50  step p50 ms  p90 ms  p99 ms  time s")
    kinds: dict[str, list[dict]] = {}
    for r in rows:
        kind = "decode" if r["tokens"] == r["outputs"] else "with prefill"
        kinds.setdefault(kind, []).append(r)
    for kind, rs in kinds.items():
        durs = [r["dur"] * 1e3 for r in rs]
        print(f"{kind:12s} {len(rs):6d} {statistics.median(r['tokens'] for r in rs):11.0f} "
              f"{statistics.median(r['outputs'] for r in rs):12.0f} {_pct(durs, .5):12.1f} {_pct(durs, .9):7.1f} "
              f"{_pct(durs, .99):7.1f} {sum(durs) / 1e3:7.1f}")
    # Decode-only step time by batch size: what TPOT is made of.
    by_batch: dict[int, list[float]] = {}
    for r in kinds.get("decode", []):
        by_batch.setdefault(r["outputs"], []).append(r["dur"] * 1e3)
    print("decode batch: " + ", ".join(f"{b}: {statistics.median(d):.1f} ms (n={len(d)})"
                                       for b, d in sorted(by_batch.items()) if len(d) >= 5))


def summarize_requests(reqs: list[dict], steps: list[dict], waves: bool) -> None:
    """Where a request's TTFT goes: front end (arrival -> sent), queue in the
    core (sent -> first scheduled), its prefill step(s) and the delivery."""
    reqs.sort(key=lambda r: r["arrival"])
    front = [(r["sent"] - r["arrival"]) * 1e3 for r in reqs]
    queue = [(r["first_scheduled"] - r["sent"]) * 1e3 for r in reqs if r.get("first_scheduled")]
    ttft = [(r["first_token"] - r["arrival"]) * 1e3 for r in reqs if r.get("first_token")]
    print(f"{len(reqs)} requests: front end (arrival -> sent) p50 {_pct(front, .5):.1f} ms p99 {_pct(front, .99):.1f}; "
          f"sent -> first scheduled p50 {_pct(queue, .5):.1f} ms p99 {_pct(queue, .99):.1f}; "
          f"TTFT p50 {_pct(ttft, .5):.0f} ms p99 {_pct(ttft, .99):.0f}")
    if not waves:
        return
    starts = sorted(st["end"] - st["dur"] for st in steps)
    groups: list[list[dict]] = []
    for r in reqs:
        if groups and r["arrival"] - groups[-1][-1]["arrival"] < 0.05:
            groups[-1].append(r)
        else:
            groups.append([r])
    for g in groups:
        t0 = g[0]["arrival"]
        print(f"wave of {len(g)} at {t0:.3f}: arrivals over {(g[-1]['arrival'] - t0) * 1e3:.0f} ms, sent over "
              f"{(max(r['sent'] for r in g) - t0) * 1e3:.0f} ms")
        # The step a request was first scheduled in: the last step that
        # started at or before that time (the scheduler stamps it as it plans).
        by_step: dict[float, list[dict]] = {}
        for r in g:
            i = bisect.bisect_right(starts, r.get("first_scheduled") or 0.0) - 1
            by_step.setdefault(starts[i] if i >= 0 else t0, []).append(r)
        for start, rs in sorted(by_step.items()):
            firsts = sorted(r.get("first_token", float("nan")) - t0 for r in rs)
            print(f"  scheduled +{(start - t0) * 1e3:6.0f} ms: {len(rs):3d} requests "
                  f"(last sent +{(max(r['sent'] for r in rs) - t0) * 1e3:.0f} ms), first tokens "
                  f"+{firsts[0] * 1e3:.0f}..{firsts[-1] * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, help="record steps while serving; write them here")
    parser.add_argument("--summarize", type=Path, help="summarize a recorded trace and exit")
    parser.add_argument("--waves", action="store_true", help="with --summarize: per-request timeline by wave")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `kvferry serve` flags")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize, args.waves)
        return
    if not args.trace:
        parser.error("give --trace PATH (or --summarize PATH)")
    record(args.trace)
    from kvferry.cli import main as kvferry_main

    flags = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    raise SystemExit(kvferry_main(["serve", *flags]))


if __name__ == "__main__":
    main()
