"""``kvferry scale``: grow or shrink a running server's pools of engine cores.

    kvferry scale --url http://127.0.0.1:8000 --decode 3          # disagg: one pool on its own
    kvferry scale --url http://127.0.0.1:8000 --prefill 1 --decode 2
    kvferry scale --url http://127.0.0.1:8000 --engines 2         # colocated
    kvferry scale --url http://127.0.0.1:8000 --attention 2       # --mode afd: its attention cores
    kvferry scale --url http://127.0.0.1:8000 --ffn 2             # --mode afd: its FFN workers (first, with both)
    kvferry scale --url http://127.0.0.1:8000                     # show the pools, the last scales, the autoscaler

It calls ``POST /v1/admin/scale`` (an admin key, when the server has keys)
and waits until the new cores serve and the removed ones have drained; it
prints one line per core added or removed, with the seconds it took. When
the cluster cannot place the new cores (``kvferry serve --ray`` with
``--scale-timeout-s``), it prints why, naming the resources missing.
Exit code 0 when every step succeeded, 1 when one failed or there was no
room (the pools are unchanged then), 2 on a usage error or a refusal (4xx,
or the server shutting down).

Standard library only: the command runs wherever the server's package is
installed, without the test or bench extras.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

from kvferry.router.scaling import DEFAULT_DRAIN_TIMEOUT_S


def add_scale_parser(sub) -> None:
    scale = sub.add_parser("scale", help="grow or shrink a running server's pools of engine cores",
                           description="Add engine cores to a pool, or drain and remove them, while requests run "
                                       "(POST /v1/admin/scale). Without counts: show the pools.")
    scale.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    scale.add_argument("--engines", type=int, default=None, help="colocated mode: engine cores to run")
    scale.add_argument("--attention", type=int, default=None,
                       help="afd mode: attention cores to run (they share the server's FFN workers; as --engines)")
    scale.add_argument("--ffn", type=int, default=None,
                       help="afd mode (or disagg with FFN workers): FFN workers to run; the experts or MLP columns "
                            "are split over the new count, requests keep streaming (resized before --attention)")
    scale.add_argument("--prefill", type=int, default=None, help="disagg mode: prefill cores to run")
    scale.add_argument("--decode", type=int, default=None, help="disagg mode: decode cores to run")
    scale.add_argument("--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                       help="how long a removed core's requests may run before they end with an error")
    scale.add_argument("--api-key", default=None,
                       help="an admin API key, when the server has keys (default: $OPENAI_API_KEY)")
    scale.add_argument("--timeout-s", type=float, default=1800.0,
                       help="how long to wait for the scale to end (new cores load their model first)")
    scale.set_defaults(func=run_scale)


def run_scale(args: argparse.Namespace) -> int:
    if args.attention is not None:  # an AFD server's attention cores are its colocated engine cores
        if args.engines is not None:
            print("kvferry scale: error: give --attention or --engines (the same cores), not both", file=sys.stderr)
            return 2
        args.engines = args.attention
    # "engines" as the flag (the server takes it for "engine"): an error names the flag given.
    counts = {"engines": args.engines, "prefill": args.prefill, "decode": args.decode, "ffn": args.ffn}
    counts = {k: v for k, v in counts.items() if v is not None}
    if counts and args.engines is not None and (args.prefill is not None or args.decode is not None):
        print("kvferry scale: error: give --engines (colocated) or --prefill/--decode (disagg), not both",
              file=sys.stderr)
        return 2
    url = args.url.rstrip("/") + "/v1/admin/scale"
    body = json.dumps(counts | {"drain_timeout_s": args.drain_timeout_s}).encode() if counts else None
    request = urllib.request.Request(url, data=body, method="POST" if counts else "GET",
                                     headers={"Content-Type": "application/json"})
    # Read here, not as the flag's default: --help would print the key.
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        answer = _error_body(exc)
        if exc.code in (502, 503) and ("steps" in answer or "ffn" in answer):  # it ran; a core (or FFN worker) failed
            _print_event(answer)
            if answer.get("error"):
                print(f"kvferry scale: error: {answer['error'].get('message')}", file=sys.stderr)
            return 1
        message = answer.get("error", {}).get("message") or f"HTTP {exc.code}"
        print(f"kvferry scale: error: {message}", file=sys.stderr)
        return 2
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"kvferry scale: error: cannot reach {url}: {reason}", file=sys.stderr)
        return 2
    if counts:
        _print_event(answer)
        return 0 if answer.get("ok") else 1
    _print_state(answer)
    return 0


def _error_body(exc: urllib.error.HTTPError) -> dict:
    try:
        value = json.loads(exc.read())
    except (ValueError, OSError):
        return {}
    return value if isinstance(value, dict) else {}


def _print_event(event: dict) -> None:
    ffn = event.get("ffn")
    if ffn and "before" in ffn:
        print(f"ffn workers: {ffn['before']} -> {ffn['after']} in {ffn['seconds']:.1f} s")
    for step in event.get("steps", []):
        # A placement failure's one reason is printed once, after the steps.
        shown = step.get("error") and step["error"] != (event.get("error") or {}).get("message")
        why = f": {step['error']}" if shown else ""
        print(f"{step['action']:>8} {step['name']} ({step['role']}) after {step['seconds']:.1f} s{why}")
    print(f"pools: {_counts(event.get('before', {}))} -> {_counts(event.get('after', {}))} "
          f"in {event.get('seconds', 0.0):.1f} s")


def _print_state(state: dict) -> None:
    ffn = f", ffn workers {state['ffn_workers']}" if state.get("ffn_workers") else ""
    print(f"mode {state.get('mode')}, pools: {_counts(state.get('counts', {}))}{ffn}"
          + (f" (scaling to {_counts(state['target'])})" if state.get("target") else ""))
    for event in state.get("history", [])[-5:]:
        print(f"  {event['source']}: {_counts(event['before'])} -> {_counts(event['after'])} "
              f"in {event['seconds']:.1f} s{'' if event.get('ok') else ' (a step failed)'}")
    autoscale = state.get("autoscale")
    if autoscale:
        print(f"autoscale: {json.dumps(autoscale)}")


def _counts(counts: dict) -> str:
    return ", ".join(f"{role} {n}" for role, n in counts.items()) or "-"
