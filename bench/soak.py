"""Soak: a real server under mixed load while its processes are killed.

    python bench/soak.py [--duration-s 1200] [--core-kill-every-s 300] [--store-kill-at-s 600]

Several client threads send a mix for the whole run: two tenants' completions
and chats (some streamed, some cancelled after the first chunk), a public
prefix declared by a publisher and read by both tenants, and bad requests
(sampling values past float32, integers past int64, deep nesting, broken
JSON). Every ``--core-kill-every-s`` the engine core is SIGKILLed (the server
restarts it, holding new requests meanwhile); once, at ``--store-kill-at-s``,
the KV store is SIGKILLed.

It reports requests answered by status, the 5xx split into the killed core's
own streams (in flight at a kill), 503s while a core restarts, and any other
5xx (the target is 0), the restarts seen, and the memory of the server's
process tree at the start and the end. Bounded: it stops at the duration.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _servers import start_server, stop_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"sk-a": {"tenant": "a"}, "sk-b": {"tenant": "b"}, "sk-pub": {"tenant": "pub", "publish": True},
        "sk-admin": {"tenant": "ops", "admin": True}}
PUBLIC = ("You are the assistant of a harbour office. Answer briefly and only about tides, berths, "
          "fees and opening hours; point to the notice board for anything else.\n")
BAD_BODIES = [
    b'{"prompt": "Hello", "max_tokens": 4, "temperature": 1, "top_p": 1e-46}',
    b'{"prompt": "Hello", "max_tokens": 4, "temperature": 1, "repetition_penalty": 1e-46}',
    b'{"prompt": "Hello", "max_tokens": 4, "top_k": 1180591620717411303424}',
    b'{"prompt": "Hello", "max_tokens": 4, "min_tokens": 1180591620717411303424}',
    b'{"prompt": "Hello", "max_tokens": 4, "stop_token_ids": [1180591620717411303424]}',
    b'{"prompt": "Hello", "max_tokens": 4, "temperature": NaN}',
    b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"prompt": "\\ud800abc", "max_tokens": 2}',
    b'{"prompt": "Hello", "max_tokens": 4',
]


def process_tree(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        children.setdefault(pp, []).append(p)
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def rss_mb(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def find_process(root: int, title: str) -> int | None:
    for p in process_tree(root):
        try:
            if Path(f"/proc/{p}/cmdline").read_bytes().startswith(title.encode()):
                return p
        except OSError:
            pass
    return None


class Soak:
    def __init__(self, url: str, deadline: float) -> None:
        self.url, self.deadline = url, deadline
        self.status: Counter[str] = Counter()
        self.five_xx: Counter[str] = Counter()
        self.kill_times: list[float] = []
        self.store_kill_time: float | None = None
        self.start = time.monotonic()
        self.timeouts: list[tuple[str, float]] = []  # kind, seconds into the run it was sent
        self.lock = threading.Lock()
        self.request_timeout_s = 120.0

    def count(self, kind: str, status: int, code: str = "", started: float = 0.0) -> None:
        with self.lock:
            self.status[f"{kind} {status}"] += 1
            if status >= 500:
                # A request in flight at a kill, or one routed to the dead
                # core in the moment before its death was noticed (it ends
                # with engine_unavailable), went down with that core's
                # streams; engine_restarting is a request that waited out
                # --engine-restart-wait.
                in_flight_at_kill = any(started <= k <= time.monotonic() for k in self.kill_times)
                cause = ("killed core's own stream" if in_flight_at_kill else
                         "routed to the dead core before its death was noticed" if code == "engine_unavailable" else
                         "503 after waiting for a restart" if code == "engine_restarting" else
                         f"other ({code})")
                self.five_xx[cause] += 1

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=self.request_timeout_s) as http:
            while time.monotonic() < self.deadline:
                kind = rng.choices(["completion", "chat", "stream_cancel", "public", "bad"], [4, 3, 2, 2, 2])[0]
                key = rng.choice(["sk-a", "sk-b"])
                started = time.monotonic()
                try:
                    self.one(http, rng, kind, key, started)
                except httpx.HTTPError as exc:
                    if isinstance(exc, httpx.TimeoutException):
                        self.timeouts.append((kind, round(started - self.start, 1)))
                    self.count(kind, 599, type(exc).__name__, started)

    def one(self, http: httpx.Client, rng: random.Random, kind: str, key: str, started: float) -> None:
        headers = {"Authorization": f"Bearer {key}"}
        words = " ".join(rng.choice(["tide", "berth", "fee", "boat", "crane", "quay"]) for _ in range(rng.randint(5, 120)))
        if kind == "bad":
            r = http.post("/v1/completions", content=rng.choice(BAD_BODIES),
                          headers={**headers, "Content-Type": "application/json"})
            self.count(kind, r.status_code, _code(r), started)
            return
        if kind == "stream_cancel":
            body = {"model": MODEL, "prompt": words, "max_tokens": 64, "stream": True}
            with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    r.read()
                    self.count(kind, r.status_code, _code(r), started)
                    return
                for _ in r.iter_lines():
                    break  # the client leaves after the first chunk
                self.count(kind, r.status_code, "", started)
            return
        if kind in ("chat", "public"):
            system = PUBLIC if kind == "public" else f"Session {uuid.uuid4().hex[:6]}."
            body = {"model": MODEL, "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.7, 1]),
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": words}]}
            r = http.post("/v1/chat/completions", json=body, headers=headers)
        else:
            body = {"model": MODEL, "prompt": words, "max_tokens": rng.randint(4, 24),
                    "temperature": rng.choice([0, 0.7, 1]), "top_p": rng.choice([1, 0.9, 0.5])}
            r = http.post("/v1/completions", json=body, headers=headers)
        self.count(kind, r.status_code, _code(r), started)


def _code(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["code"] or ""
    except Exception:  # noqa: BLE001 - a 2xx body or a non-JSON error
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=1200)
    ap.add_argument("--core-kill-every-s", type=float, default=300)
    ap.add_argument("--store-kill-at-s", type=float, default=600)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--request-timeout-s", type=float, default=120.0, help="a request slower than this counts as hung")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvferry-soak-"))
    (work / "keys.json").write_text(json.dumps(KEYS))
    flags = ["--api-keys", str(work / "keys.json"), "--kv-dram-gb", "0.5", "--kv-disk", str(work / "disk"), "--kv-disk-gb", "1",
             "--kv-cache-memory-gb", "0.5", "--max-model-len", "1024",
             "--engine-restarts", str(int(args.duration_s // args.core_kill_every_s) + 2),
             "--disable-uvicorn-access-log", "--log-level", "warning"]
    proc, url = start_server(flags, work / "server.log")
    try:
        r = httpx.post(f"{url}/v1/kv/public_prefixes", json={"prefix": [{"role": "system", "content": PUBLIC}]},
                       headers={"Authorization": "Bearer sk-pub"}, timeout=120)
        assert r.status_code == 200, r.text
        time.sleep(2)
        rss_start = rss_mb(process_tree(proc.pid))
        start = time.monotonic()
        soak = Soak(url, start + args.duration_s)
        soak.request_timeout_s = args.request_timeout_s
        threads = [threading.Thread(target=soak.worker, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        next_kill, store_killed, kills = start + args.core_kill_every_s, False, Counter()
        while time.monotonic() < soak.deadline:
            time.sleep(1)
            now = time.monotonic()
            # No kill in the last minute: the run ends with the server settled.
            if now >= next_kill and soak.deadline - now > 60:
                pid = find_process(proc.pid, "kvferry: engine")
                if pid is not None:
                    soak.kill_times.append(now)
                    os.kill(pid, signal.SIGKILL)
                    kills["core"] += 1
                next_kill += args.core_kill_every_s
            if not store_killed and now - start >= args.store_kill_at_s:
                pid = find_process(proc.pid, "kvferry: kvstore")
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    kills["store"] += 1
                store_killed = True
            if proc.poll() is not None:
                break
        for t in threads:
            t.join(150)
        health = None
        for _ in range(120):  # settled: a core restarted near the end is back
            if proc.poll() is not None:
                break
            health = httpx.get(f"{url}/health", timeout=30)
            if health.status_code == 200:
                break
            time.sleep(1)
        rss_end = rss_mb(process_tree(proc.pid))
        log = (work / "server.log").read_text(errors="replace")
        summary = {
            "duration_s": round(time.monotonic() - start), "clients": args.clients,
            "requests": sum(soak.status.values()), "by_kind_and_status": dict(sorted(soak.status.items())),
            "5xx": dict(soak.five_xx), "hung (seconds into the run)": soak.timeouts, "kills": dict(kills),
            "restarts_logged": log.lower().count("restarting engine core"),
            "server_alive_at_end": proc.poll() is None,
            "health_at_end": health.status_code if health is not None else None,
            "rss_mb_start": round(rss_start), "rss_mb_end": round(rss_end),
        }
        print(json.dumps(summary, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=2))
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
