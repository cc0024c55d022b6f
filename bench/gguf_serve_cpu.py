"""CPU time per output token of each process and thread of a ``kvferry
serve`` at batch 1 (one streamed request at a time through the openai
client), and of the client: on a machine with as many cores as the engine
has threads, every CPU second outside the engine's stepping team is taken
from it, and each parallel region waits for the thread that lost its core.

CPU time (``/proc/PID/task/TID/stat`` utime + stime, clock ticks), not
wall time, so that the figures mean something on a shared machine. Also
the server's processes' RSS and peak RSS (VmHWM), summed, after the requests.

    python bench/gguf_serve_cpu.py [--model FILE.gguf] [--requests 4] [--output-len 64] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import served  # noqa: E402

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return out


def thread_cpu(pids: list[int]) -> dict[tuple[str, str], float]:
    """{(process name, thread name): CPU ms}, threads of one name summed."""
    cpu: dict[tuple[str, str], float] = defaultdict(float)
    for pid in pids:
        try:
            pname = Path(f"/proc/{pid}/comm").read_text().strip()
            for task in Path(f"/proc/{pid}/task").iterdir():
                stat = (task / "stat").read_text()
                tname = stat[stat.index("(") + 1 : stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2 :].split()
                cpu[(f"{pname}[{pid}]", tname)] += (int(fields[11]) + int(fields[12])) * TICK_MS
        except (FileNotFoundError, ProcessLookupError):
            continue
    return cpu


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, MiB (empty where it is gone)."""
    try:
        return {k: int(v.split()[0]) / 1024 for k, _, v in (line.partition(":") for line in
                                                           Path(f"/proc/{pid}/status").read_text().splitlines())
                if k in ("VmRSS", "VmHWM")}
    except (FileNotFoundError, ProcessLookupError):
        return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/ggufmix/1b-q4km.gguf")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/gguf_serve_cpu"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    flags = ["--model", args.model, "--quantization", "gguf", "--served-model-name", "m",
             "--kv-cache-memory-gb", "0.5", "--max-num-seqs", "16", "--speculative-config", "off",
             "--disable-uvicorn-access-log", "--log-level", "warning"]
    with served(flags, args.out / "server.log") as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        pid = next(int(p.split()[-1]) for p in os.popen(f"ss -ltnpH 'sport = :{port}'").read().splitlines()
                   for p in [p.split("pid=")[1].split(",")[0]] if p)
        pids = tree(pid)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as c:
            c.completions.create(model="m", prompt="warm up", max_tokens=4, temperature=0.0)
            before, client0, wall0 = thread_cpu(pids), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            tokens = 0
            for i in range(args.requests):
                stream = c.completions.create(model="m", prompt=f"Story {i}: the river carried old stories", stream=True,
                                              max_tokens=args.output_len, temperature=0.0,
                                              extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
                for chunk in stream:
                    if chunk.usage is not None:
                        tokens += chunk.usage.completion_tokens
            after, client1, wall = thread_cpu(pids), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall0
            memory = {k: sum(memory_mib(p).get(k, 0.0) for p in pids) for k in ("VmRSS", "VmHWM")}
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    client_ms = (client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime) * 1e3
    print(f"{args.model}, {args.threads} threads, {args.requests} x {args.output_len} tokens ({tokens} counted), "
          f"load {load}, wall {wall * 1e3 / tokens:.2f} ms per token (prefill included)")
    print(f"served memory, the server's processes summed: RSS {memory['VmRSS']:.0f} MiB, "
          f"peak (VmHWM) {memory['VmHWM']:.0f} MiB")
    print("CPU ms per output token (prefill included):")
    per_proc: dict[str, float] = defaultdict(float)
    for key in sorted(after, key=lambda k: -(after[k] - before.get(k, 0.0))):
        d = (after[key] - before.get(key, 0.0)) / tokens
        per_proc[key[0]] += d
        if d >= 0.05:
            print(f"  {key[0]:28s} {key[1]:20s} {d:7.2f}")
    for p, d in per_proc.items():
        print(f"  process {p:28s} {d:7.2f}")
    print(f"  client (this process)               {client_ms / tokens:7.2f}")


if __name__ == "__main__":
    main()
