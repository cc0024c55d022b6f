"""CPU seconds a server spends declaring N public prefixes, then deleting
them one by one (DELETE /v1/kv/public_prefixes/{id}).

The prefixes share a leading header (as the probe's candidates in
tests/tenants/test_public_prefix_writes.py do). CPU time is the server's
process tree (front end and engine core: utime + stime from /proc), read
before and after each phase, so other processes' load does not count.

    python bench/public_prefix_delete.py --num 10 [--repeats 2]

Run it under the PYTHONPATH of the code to measure (the server inherits it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from _servers import start_server, stop_server

FLAGS = ["--max-model-len", "1024", "--dtype", "float32", "--kv-cache-memory-gb", "0.5", "--no-warm-up",
         "--disable-uvicorn-access-log", "--log-level", "warning", "--block-size", "16"]
KEYS = {"sk-pub": {"tenant": "pub", "publish": True}}
_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """utime + stime of ``root`` and its descendants, in seconds."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / _TICK
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo.extend(p for p, parent in parents.items() if parent == pid)
    return total


def text(tag: str, i: int) -> str:
    body = " ".join(f"Account {tag} note {k}: transfer approved by the desk." for k in range(10))
    return f"{body} The PIN of account {tag} is {1000 + i:04d}"


def one_run(num: int, log: Path, keys: Path) -> tuple[float, float, float]:
    """(declare CPU-s, delete CPU-s, delete wall-s) of one fresh server."""
    proc, url = start_server([*FLAGS, "--api-keys", str(keys)], log)
    try:
        auth = {"Authorization": "Bearer sk-pub"}
        tag = os.urandom(4).hex()
        with httpx.Client(base_url=url, headers=auth, timeout=600) as client:
            start = tree_cpu_s(proc.pid)
            ids = [client.post("/v1/kv/public_prefixes", json={"prefix": text(tag, i)}).json()["id"]
                   for i in range(num)]
            declared = tree_cpu_s(proc.pid)
            wall = time.perf_counter()
            for pid in ids:
                r = client.delete(f"/v1/kv/public_prefixes/{pid}")
                assert r.status_code == 200, r.text
            wall = time.perf_counter() - wall
            deleted = tree_cpu_s(proc.pid)
    finally:
        stop_server(proc)
    return declared - start, deleted - declared, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        keys = Path(d) / "keys.json"
        keys.write_text(json.dumps(KEYS))
        runs = [one_run(args.num, Path(d) / f"server{i}.log", keys) for i in range(args.repeats)]
    declare, delete, wall = (statistics.median(x) for x in zip(*runs))
    print(json.dumps({"num": args.num, "repeats": args.repeats, "declare_cpu_s": round(declare, 2),
                      "delete_cpu_s": round(delete, 2), "delete_wall_s": round(wall, 2),
                      "loadavg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
