"""Seconds from ``kvferry scale --decode 2`` to the new decode core serving,
and back down, on the disagg layout (1 prefill + 1 decode core) with local
processes and with Ray actors on a two-node cluster on this host.

    python bench/fleet_scale.py [--rounds 3] [--models embedded 1b]

Each round scales the decode pool 1 -> 2 (the command returns once the new
core has loaded its model, warmed up and answered its handshake, and the
router routes to it), sends one request, then scales 2 -> 1 (the idle core
drains at once and stops). Printed: the medians over rounds of the
command's wall time and of the step the server reports, per model and
placement.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _fleet import RayCluster, disagg_flags, machine_line, make_1b
from _servers import served


def scale(url: str, decode: int) -> tuple[float, float]:
    """(the command's wall seconds, the server's step seconds)."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvferry.cli", "scale", "--url", url, "--decode", str(decode)],
                          capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(f"kvferry scale failed: {done.stdout}{done.stderr}")
    event = httpx.get(f"{url}/v1/admin/scale", timeout=10).json()["history"][-1]
    return wall, event["steps"][0]["seconds"]


def run(model: str | None, cluster: RayCluster | None, rounds: int, log_dir: Path) -> dict[str, float]:
    flags = ([model] if model else []) + ["--max-model-len", "1024", "--kv-cache-memory-gb", "1",
                                          "--served-model-name", "m"] + disagg_flags(cluster)
    up, up_step, down = [], [], []
    with served(flags, log_dir / f"server-{'ray' if cluster else 'local'}.log") as url:
        for _ in range(rounds):
            wall, step = scale(url, 2)
            up.append(wall)
            up_step.append(step)
            r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 4},
                           timeout=120)
            r.raise_for_status()
            down.append(scale(url, 1)[0])
    return {"up": statistics.median(up), "up_step": statistics.median(up_step), "down": statistics.median(down)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["embedded", "1b"], choices=["embedded", "1b"])
    args = parser.parse_args()
    print(f"# {machine_line()}; {time.strftime('%Y-%m-%d %H:%M %Z')}; rounds {args.rounds}")
    work = Path(tempfile.mkdtemp(prefix="fleet-scale-"))
    rows = []
    with RayCluster(work, {"pnode": 1}, {"dnode": 2}) as cluster:
        for name in args.models:
            model = None if name == "embedded" else make_1b(work)
            for placement in ("local", "ray"):
                figures = run(model, cluster if placement == "ray" else None, args.rounds, work)
                rows.append((name, placement, figures))
                print(f"{name:>8} {placement:>5}: scale up {figures['up']:.1f} s (server step "
                      f"{figures['up_step']:.1f} s), down {figures['down']:.1f} s", flush=True)
    print("\n| model | cores | `kvferry scale --decode 2` to serving, s | of which the server's step, s | "
          "`--decode 1` (idle core drained and stopped), s |\n|---|---|---|---|---|")
    for name, placement, f in rows:
        print(f"| {name} | {placement} | {f['up']:.1f} | {f['up_step']:.1f} | {f['down']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
