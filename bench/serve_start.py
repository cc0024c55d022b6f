"""``kvferry serve`` start-up: wall time to the first ``/health`` 200 and the
CPU its process tree spent by then, for one or more source trees started in
turn (A, B, A, B, ...), so that a busy machine's drift falls on both alike.

    python bench/serve_start.py --src /path/to/old/src --src src -n 9
    python bench/serve_start.py --src src -n 5 -- --dtype bfloat16   # other flags

Each start is ``python -m kvferry.cli serve --port 0`` with the test servers'
flags (``tests/serve/server_process.py``'s SERVE_ARGS: embedded model,
float32, ``--no-warm-up``) unless flags follow ``--``; ``PYTHONPATH`` names
the tree. Wall: from the spawn to the first ``/health`` 200 (polled every
10 ms once the ready line is out). CPU: ``/proc`` utime + stime (and the
reaped children's) of the server and every process under it, read at that
200, split into the API server and the rest (the engine core); and when the
core was spawned (the server's first child process). Prints each
start and the medians per tree, with the load average before and after.

Bytecode goes to ``--pycache`` (``PYTHONPYCACHEPREFIX``), outside the trees,
and one untimed start per tree fills it first: an installed package starts
from its .pyc files, and compiling every module from source would add
seconds of API-server CPU that no user pays.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _servers import stop_server  # noqa: E402
from tests.serve.server_process import READY_PREFIX, SERVE_ARGS  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds including reaped children) of a live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), sum(int(x) for x in fields[11:15]) / TICK


def tree_cpu(root: int) -> tuple[float, float]:
    """(root's CPU s, its descendants' CPU s)."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p))) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    below, todo = 0.0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        below += stats[pid][1]
        todo.extend(children.get(pid, []))
    return stats.get(root, (0, 0.0))[1], below


def _first_child_at(pid: int, t0: float, out: list[float], stop: threading.Event) -> None:
    """When ``pid``'s first child appeared (its engine core's spawn), polled every 2 ms."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    while not stop.is_set():
        try:
            if path.read_text().strip():
                out.append(time.perf_counter() - t0)
                return
        except OSError:
            return
        time.sleep(0.002)


def one_start(src: str, flags: list[str], timeout_s: float, pycache: str,
              extra_env: dict[str, str]) -> tuple[float, float, float, float]:
    """(wall s to the first /health 200, API server CPU s, the rest's CPU s,
    wall s to the core's spawn)."""
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), PYTHONUNBUFFERED="1", PYTHONPYCACHEPREFIX=pycache,
               **extra_env)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url: list[str] = []
    lines: list[str] = []
    ready = threading.Event()
    spawned_at: list[float] = []
    stop = threading.Event()
    threading.Thread(target=_first_child_at, args=(proc.pid, t0, spawned_at, stop), daemon=True).start()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(READY_PREFIX) and not url:
                url.append(line[len(READY_PREFIX):].split()[0])
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(timeout_s) or not url:
            raise RuntimeError(f"{src}: no ready line:\n{''.join(lines)[-3000:]}")
        with httpx.Client(timeout=5) as client:
            while client.get(f"{url[0]}/health").status_code != 200:
                time.sleep(0.01)
        wall = time.perf_counter() - t0
        api, rest = tree_cpu(proc.pid)
        return wall, api, rest, (spawned_at or [float("nan")])[0]
    finally:
        stop.set()
        stop_server(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", action="append", required=True, help="a tree's src folder (repeat: A, B, ...)")
    parser.add_argument("-n", type=int, default=5, help="starts per tree")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in the servers' environment, e.g. KVFERRY_GRAMMAR_IMPORT=first-use (as the "
                             "tests' servers run: tests/conftest.py)")
    parser.add_argument("--pycache", default="/tmp/kvferry-bench-pycache", help="PYTHONPYCACHEPREFIX of the starts")
    parser.add_argument("flags", nargs="*", help="after --: serve flags in place of the test servers'")
    args = parser.parse_args()
    flags = args.flags or SERVE_ARGS
    extra_env = dict(e.split("=", 1) for e in args.env)
    results: dict[str, list[tuple[float, float, float, float]]] = {s: [] for s in args.src}
    for src in args.src:
        one_start(src, flags, args.timeout, args.pycache, extra_env)  # untimed: fills the bytecode cache
    print(f"load average before: {os.getloadavg()}", flush=True)
    for i in range(args.n):
        for src in args.src:
            wall, api, rest, spawn = one_start(src, flags, args.timeout, args.pycache, extra_env)
            results[src].append((wall, api, rest, spawn))
            print(f"{i} {src}: wall {wall:.2f} s, CPU {api + rest:.2f} s (API server {api:.2f}, core {rest:.2f}), "
                  f"core spawned at {spawn:.2f} s", flush=True)
    print(f"load average after: {os.getloadavg()}")
    base = None
    for src, rows in results.items():
        wall, api, rest, spawn = (statistics.median(c) for c in zip(*rows))
        cpu = statistics.median(a + r for _, a, r, _ in rows)
        ratio = "" if base is None else f"  (x{wall / base[0]:.2f} wall, x{cpu / base[1]:.2f} CPU of the first)"
        base = base or (wall, cpu)
        print(f"{src}: median wall {wall:.2f} s, CPU {cpu:.2f} s (API server {api:.2f}, core {rest:.2f}), "
              f"core spawned at {spawn:.2f} s{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
