"""A real size fits: kvferry serves an 8B-shaped Llama GGUF (random weights,
bench/make_random_gguf.py --preset 8b) within its memory bound, and its
batch-1 and c16 speeds beside llama.cpp's ``llama-server`` on the same file,
the same threads and the same client.

Memory: the engine core's VmRSS / RssAnon / RssFile once loaded and at the
peak while decoding (sampled every 0.2 s), and its VmHWM (the kernel's
high-water mark, the warm-up step included), against the bound of issue 46:
1.15x the file + the KV pool + a fixed overhead (``--overhead-mb``, default
1024: the interpreter, torch, oneDNN, the kernels and a step's scratch; the
bench prints what it measured). Exit status 1 when VmHWM is over it. The
weights are the file's pages (RssFile, shared through the page cache); what
the core copies (llama's permuted Q/K rows, stacked with V: 0.45 GiB at 8B in Q4_K_M)
is in RssAnon beside the KV pool.

Speed (streamed through the openai client, greedy, ``ignore_eos``):
batch 1, ``--requests`` requests one at a time (TTFT and TPOT p50); c16,
``--c16-requests`` requests 16 at a time (output tok/s over the wall time,
TTFT and TPOT p50). llama-server runs ``-np 16`` with 16 slots of 512
tokens (its KV, f16: 1 GiB at 8B), kvferry ``--kv-cache-memory-gb 1``.

    python bench/make_random_gguf.py /tmp/8b-q4km.gguf --preset 8b        # 4.6 GiB, ~1.5 min
    KVFERRY_LLAMA_CPP_BIN=/work/llama.cpp/bin python bench/gguf_fits_8b.py --model /tmp/8b-q4km.gguf

Prints markdown table rows (memory, then speed) and writes them with the
raw figures to ``--out``/summary.json. ``--skip-llama-cpp``: kvferry only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama_cpp import llama_server, missing_reason  # noqa: E402
from _servers import start_server, stop_server  # noqa: E402
from gguf_vs_llama_cpp import pid_on_port, prompt, run_batch1  # noqa: E402

SLOTS = 16
SLOT_CTX = 512


def status_mb(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon, RssFile and VmHWM (the peak VmRSS so far, the warm-up step's included) of ``pid``, MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def engine_core_pid(root: int) -> int:
    """The ``kvferry: engine ...`` process under ``root`` (the core holds the weights)."""
    todo = [root]
    while todo:
        p = todo.pop()
        try:
            if Path(f"/proc/{p}/cmdline").read_text().startswith("kvferry: engine"):
                return p
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    raise RuntimeError(f"no engine core under pid {root}")


class PeakRss:
    """Samples a process's status every 0.2 s in a thread; ``peak`` is the sample with the highest VmRSS."""

    def __init__(self, pid: int) -> None:
        self.pid, self._stop = pid, threading.Event()
        self.peak = self.last = status_mb(pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                s = self.last = status_mb(self.pid)
            except (FileNotFoundError, ProcessLookupError):
                return
            if s["VmRSS"] > self.peak["VmRSS"]:
                self.peak = s

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_concurrent(base_url: str, prompts: list[str], output_len: int, concurrency: int) -> dict[str, float]:
    """``prompts`` streamed ``concurrency`` at a time: output tok/s over the wall time, TTFT and TPOT p50."""
    ttft, tpot, tokens = [], [], []

    def one(client: openai.OpenAI, p: str) -> None:
        start, stamps, generated = time.perf_counter(), [], None
        # Tokens from the usage record: with speculation a chunk carries every token a step accepted.
        stream = client.completions.create(model="m", prompt=p, max_tokens=output_len, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                generated = chunk.usage.completion_tokens
        generated = generated or len(stamps)
        tokens.append(generated)
        ttft.append(stamps[0] - start)
        if generated > 1:  # the first chunk is the prefill's one token
            tpot.append((stamps[-1] - stamps[0]) / (generated - 1))

    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600) as c:
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda p: one(c, p), prompts))
        wall = time.perf_counter() - start
    return {"output_tok_s": sum(tokens) / wall, "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "tpot_p50_ms": 1e3 * statistics.median(tpot), "requests": len(prompts), "wall_s": wall}


def measure(base_url: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    b1 = [prompt(i, args.input_words) for i in range(args.requests)]
    c16 = [prompt(100 + i, args.input_words) for i in range(args.c16_requests)]
    out = {"batch1": run_batch1(base_url, "m", b1, args.output_len)}
    if args.c16_requests:
        out["c16"] = run_concurrent(base_url, c16, args.output_len, SLOTS)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="the .gguf file (bench/make_random_gguf.py --preset 8b)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=3, help="batch-1 requests (the median of these)")
    ap.add_argument("--c16-requests", type=int, default=16, help="requests at concurrency 16 (0: none)")
    ap.add_argument("--input-words", type=int, default=160, help="about 1.3 tokens a word")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    ap.add_argument("--overhead-mb", type=float, default=1024, help="the bound's fixed overhead for the core")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--memory-only", action="store_true", help="kvferry only, a few decode steps, no timing")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="serve with --no-warm-up (the 2048-token dummy prefill takes minutes at 8B on 2 loaded cores; "
                         "its scratch is then not in the peak)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gguf_fits_8b"))
    args = ap.parse_args()
    model = args.model.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    load = Path("/proc/loadavg").read_text().split()[:3]
    file_mb = model.stat().st_size / 2**20
    kv_mb = args.kv_cache_memory_gb * 1024
    bound = 1.15 * file_mb + kv_mb + args.overhead_mb
    flags = ["--model", str(model), "--quantization", "gguf", "--served-model-name", "m",
             "--kv-cache-memory-gb", str(args.kv_cache_memory_gb), "--max-num-seqs", str(SLOTS),
             "--max-model-len", "4096", "--engine-start-timeout", "3600",  # the 8B warm-up: minutes on 2 busy cores
             "--disable-uvicorn-access-log", "--log-level", "warning",
             *(["--no-warm-up"] if args.no_warm_up else [])]
    t0 = time.monotonic()
    proc, url = start_server(flags, args.out / "kvferry.log", timeout_s=1800)
    speeds: dict[str, dict[str, dict[str, float]]] = {}
    try:
        load_s = time.monotonic() - t0
        core = engine_core_pid(proc.pid)
        loaded = status_mb(core)
        sampler = PeakRss(core)
        if args.memory_only:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600) as c:
                c.completions.create(model="m", prompt=prompt(0, args.input_words), max_tokens=8, temperature=0.0)
        else:
            speeds["kvferry"] = measure(f"{url}/v1", args)
            print(json.dumps({"kvferry": speeds["kvferry"]}), flush=True)
        peak = sampler.stop()
    finally:
        stop_server(proc)
    peak["VmHWM"] = max(peak["VmHWM"], sampler.last["VmHWM"])
    over = peak["VmHWM"] - 1.15 * file_mb - kv_mb
    memory = {"file_mib": file_mb, "kv_pool_mib": kv_mb, "overhead_mib": args.overhead_mb, "bound_mib": bound,
              "load_s": load_s, "loaded": loaded, "peak": peak, "measured_overhead_mib": over,
              "within_bound": peak["VmHWM"] <= bound}
    print(json.dumps({"memory": memory}), flush=True)
    if not (args.memory_only or args.skip_llama_cpp):
        reason = missing_reason("llama-server")
        if reason is None:
            with llama_server(model, args.out / "llama_server.log", threads=args.threads, ctx=SLOTS * SLOT_CTX,
                              slots=SLOTS, timeout_s=1800) as lurl:
                speeds["llama.cpp"] = measure(f"{lurl}/v1", args)
                print(json.dumps({"llama.cpp": speeds["llama.cpp"]}), flush=True)
                pid = pid_on_port(lurl)
                speeds["llama.cpp"]["rss_mib"] = {"VmRSS": status_mb(pid)["VmRSS"] if pid else float("nan")}
        else:
            print(f"skipping llama.cpp: {reason}")
    (args.out / "summary.json").write_text(json.dumps(
        {"model": str(model), "threads": args.threads, "loadavg_before": load,
         "loadavg_after": Path("/proc/loadavg").read_text().split()[:3], "memory": memory, "speeds": speeds}, indent=2))
    print(f"\n{model.name}: {file_mb:,.0f} MiB, {args.threads} threads, load average before {' '.join(load)}, "
          f"after {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    print("\n| engine core, MiB | VmRSS | RssAnon | RssFile | VmHWM | bound (1.15x file + KV + overhead) |")
    print("|---|---|---|---|---|---|")
    for name, s in (("loaded", loaded), ("peak while decoding", peak)):
        print(f"| {name} | {s['VmRSS']:,.0f} | {s['RssAnon']:,.0f} | {s['RssFile']:,.0f} | {s['VmHWM']:,.0f} | "
              f"{1.15 * file_mb:,.0f} + {kv_mb:,.0f} + {args.overhead_mb:,.0f} = {bound:,.0f} |")
    print(f"\nmeasured overhead (VmHWM - 1.15x file - KV pool): {over:,.0f} MiB; "
          f"{'within' if memory['within_bound'] else 'OVER'} the bound; loaded in {load_s:.0f} s")
    if speeds:
        print(f"\n| server | batch 1 TTFT p50 ms | batch 1 TPOT p50 ms | c16 output tok/s | c16 TTFT p50 ms | "
              f"c16 TPOT p50 ms |\n|---|---|---|---|---|---|")
        for name, r in speeds.items():
            c = r.get("c16", {})
            print(f"| {name} | {r['batch1']['ttft_p50_ms']:,.0f} | {r['batch1']['tpot_p50_ms']:,.0f} | "
                  f"{c.get('output_tok_s', float('nan')):.2f} | {c.get('ttft_p50_ms', float('nan')):,.0f} | "
                  f"{c.get('tpot_p50_ms', float('nan')):,.0f} |")
        if len(speeds) == 2:
            k, ll = speeds["kvferry"], speeds["llama.cpp"]
            ratio = k["batch1"]["tpot_p50_ms"] / ll["batch1"]["tpot_p50_ms"]
            line = f"\nkvferry / llama.cpp: batch-1 TPOT {ratio:.2f}x"
            if "c16" in k:
                line += f", c16 output tok/s {k['c16']['output_tok_s'] / ll['c16']['output_tok_s']:.2f}x"
            print(line)
    sys.exit(0 if memory["within_bound"] else 1)


if __name__ == "__main__":
    main()
