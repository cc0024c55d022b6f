"""Serving one GGUF file, side by side in one run: kvferry (``--quantization
gguf``: the file's blocks; and ``--quantization none``: its bf16/float
expansion) against llama.cpp's ``llama-server`` (continuous batching, ``-np``
slots), the same threads, the same client: vLLM's ``vllm bench serve``
(which we do not write; it lives in its own venv, see bench/vllm_bench_serve.sh).

Phases, each with the same prompts for every server (random dataset, fixed
seed per run and phase; a new seed per phase so kvferry's prefix cache and
llama.cpp's slot cache never see a prompt twice):

- ``c16``, ``c64`` (``--concurrency``): ``--num-prompts`` random prompts of
  ``--input-len`` tokens, ``--output-len`` tokens each (``--ignore-eos``), at
  most C in flight. Output tok/s, TTFT and TPOT p50/p99 (issue 46: kvferry's
  gguf >= 4x llama.cpp's output tok/s, TTFT and TPOT p99 no worse).
- ``prefill512`` (``--prefill-len``, 0: none): ``--prefill-prompts`` prompts of
  that many tokens, one at a time, max_tokens 1; per request prompt tokens /
  TTFT, the median (issue 46: kvferry >= 1.0x llama.cpp). llama.cpp's own
  ``llama-bench`` pp``--prefill-len`` is reported beside it as a second view.

Servers: kvferry is started once per run and system with ``--max-num-seqs``
= the largest concurrency and a fixed ``--kv-cache-memory-gb``; llama-server
is started per phase with ``-np C`` and ``-c C x (prompt + output + 64)``
(without ``--kv-unified``, each slot gets ``-c / -np``: every slot holds its
request). Each server gets one short warm-up request before each phase. The
order of the systems alternates from run to run (a loaded machine drifts);
the table shows medians over ``--runs``.

    KVFERRY_LLAMA_CPP_BIN=/work/llama.cpp/bin python bench/gguf_serve_vs_llama_cpp.py \\
        [--model FILE.gguf] [--concurrency 16 64] [--num-prompts 64] [--input-len 256] [--output-len 64] \\
        [--prefill-len 512] [--runs 2] [--skip-none]

Time on a quiet 2-core machine, per run (estimated from issue 46's rates:
llama.cpp is prefill-bound, ~110 prompt tok/s on the embedded file): the
embedded Q4_1 file ~9 min (llama.cpp ~6, each kvferry ~1.5, server starts
included); the 1B-shaped Q4_K_M file ~35 min (llama.cpp ~20). The first
``--quantization none`` start on a file converts it to float once (~2 min
and ~5 GB under ~/.cache/kvferry for the 1B file).

Records the CPU (model, family, flags that matter), threads, date, versions
and the load average before and after each phase; prints a markdown table
with ratios and writes ``summary.json`` under ``--out`` (default
bench/results/gguf_serve_vs_llama_cpp/<file stem>). Compare ratios only from
a quiet machine. Bounded: every ``vllm bench serve`` call and server start
has a timeout; a phase that fails or times out is recorded and the run goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama_cpp import llama_cpp_bin, llama_server, missing_reason  # noqa: E402
from _servers import served  # noqa: E402

MODEL_NAME = "m"
SLOT_MARGIN = 64  # tokens per llama.cpp slot beyond prompt + output: BOS, tokenizer differences
ISA_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
             "amx_int8")
METRICS = [("output_throughput", "output tok/s"), ("p50_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
           ("p50_tpot_ms", "TPOT p50 ms"), ("p99_tpot_ms", "TPOT p99 ms")]


def cpu_record() -> dict[str, object]:
    """The CPU as /proc/cpuinfo lists it, and the flags kvferry may use (AMX only where the kernel grants it)."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() and key.strip() not in info:
            info[key.strip()] = value.strip()
        if not line.strip() and info:
            break  # the first CPU is enough
    flags = set(info.get("flags", "").split())
    try:
        from kvferry.model.cpu_features import cpu_features

        usable = cpu_features().flags
    except Exception:  # noqa: BLE001 - a record, not a requirement
        usable = frozenset(flags)
    return {"model_name": info.get("model name", ""), "family": info.get("cpu family", ""),
            "model": info.get("model", ""), "stepping": info.get("stepping", ""), "cores": os.cpu_count(),
            "flags": [f for f in ISA_FLAGS if f in flags],
            "flags_usable_by_kvferry": [f for f in ISA_FLAGS if f in usable]}


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def versions() -> dict[str, str]:
    out = {}
    try:
        out["kvferry_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                               cwd=Path(__file__).parent, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    tool = llama_cpp_bin("llama-server")
    if tool is not None:
        r = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=60)
        out["llama_server"] = " ".join((r.stdout + r.stderr).split())[-200:]
    return out


def phases(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(phase name, concurrency): the prefill phase (batch 1) first, then each concurrency."""
    out = [(f"prefill{args.prefill_len}", 1)] if args.prefill_len else []
    return out + [(f"c{c}", c) for c in args.concurrency]


def warm_up(url: str, prompt: str) -> None:
    """One short request, a prompt the benchmark never sends (no prefix-cache help)."""
    r = httpx.post(f"{url}/v1/completions", timeout=600,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0.0})
    r.raise_for_status()


def run_client(args: argparse.Namespace, url: str, tokenizer: Path, phase: str, c: int, seed: int,
               result: Path) -> dict[str, object]:
    """One ``vllm bench serve`` call; its result JSON plus load averages and wall time (an ``error`` on failure)."""
    prefill = phase.startswith("prefill")
    n, in_len, out_len = ((args.prefill_prompts, args.prefill_len, 1) if prefill
                          else (args.num_prompts, args.input_len, args.output_len))
    cmd = [args.vllm, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", MODEL_NAME, "--tokenizer", str(tokenizer), "--dataset-name", "random",
           "--random-input-len", str(in_len), "--random-output-len", str(out_len), "--random-range-ratio", "0",
           "--ignore-eos", "--num-prompts", str(n), "--max-concurrency", str(c), "--seed", str(seed),
           "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(result.parent),
           "--result-filename", result.name]
    rec: dict[str, object] = {"load_before": loadavg()}
    start = time.monotonic()
    # Its own session: a timeout kills the client and anything it started.
    with open(result.with_suffix(".txt"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(args.phase_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    rec.update(wall_s=round(time.monotonic() - start, 1), load_after=loadavg())
    if rc != 0 or not result.is_file():
        tail = result.with_suffix(".txt").read_text(errors="replace")[-1500:]
        rec["error"] = (f"timed out after {args.phase_timeout} s" if rc is None else f"exit {rc}") + f": {tail}"
        return rec
    raw = json.loads(result.read_text())
    rec.update({k: raw.get(k) for k in ("completed", "failed", "duration", "total_input_tokens",
                                        "total_output_tokens", "p50_ttft_ms", "p99_ttft_ms")})
    rec["vllm_reported"] = {k: raw.get(k) for k in ("output_throughput", "p50_tpot_ms", "p99_tpot_ms")}
    rec.update(per_request_metrics(raw, out_len))
    errors = [e for e in raw.get("errors") or [] if e]
    if errors:
        rec["errors"] = errors[:3]
    if prefill:
        # The requested length (the random dataset makes each prompt exactly
        # that many tokens): kvferry's usage record would replace the client's
        # count with its own, llama-server's (usage inside the last choices
        # chunk) is not read; the same numerator for both.
        rates = [in_len / t for t in raw.get("ttfts") or [] if t and t > 0]
        rec["prefill_tok_s"] = statistics.median(rates) if rates else None
    return rec


def per_request_metrics(raw: dict, out_len: int) -> dict[str, object]:
    """Output tok/s and TPOT from the tokens requested, not the client's count.

    With ``--ignore-eos`` every request generates exactly ``out_len`` tokens.
    ``vllm bench serve`` takes the count from a streamed usage chunk *without*
    choices (kvferry sends one); llama-server puts usage in its last choices
    chunk, which the client skips, so it re-tokenizes the generated text, and
    random text re-tokenizes into fewer tokens: llama.cpp's tok/s would read
    low and its TPOT high. Recomputed here the same way for both, vLLM's
    definitions (TPOT = (latency - TTFT) / (tokens - 1)); the client's own
    figures stay in ``vllm_reported``.
    """
    ok = [i for i, e in enumerate(raw.get("errors") or []) if not e]
    lat, ttft, counted = raw.get("latencies") or [], raw.get("ttfts") or [], raw.get("output_lens") or []
    tpot = [(lat[i] - ttft[i]) / (out_len - 1) * 1e3 for i in ok if out_len > 1 and i < len(lat) and i < len(ttft)]
    duration = raw.get("duration") or 0
    out: dict[str, object] = {
        "output_throughput": len(ok) * out_len / duration if duration else None,
        "p50_tpot_ms": float(np.percentile(tpot, 50)) if tpot else None,
        "p99_tpot_ms": float(np.percentile(tpot, 99)) if tpot else None,
        "client_counted_output_tokens": sum(counted[i] for i in ok if i < len(counted)),
    }
    # A request that succeeded with no text at all is a broken stream (an SSE
    # comment used to do that to the client: see ``--sse-ping-interval`` below).
    empty = sum(1 for i in ok if i < len(counted) and counted[i] == 0 and out_len > 0)
    if empty:
        out["empty_outputs"] = empty
    return out


@contextmanager
def kvferry_server(args: argparse.Namespace, quantization: str, log: Path) -> Iterator[str]:
    flags = ["--model", str(args.model), "--quantization", quantization, "--served-model-name", MODEL_NAME,
             "--kv-cache-memory-gb", str(args.kv_cache_memory_gb),
             "--max-num-seqs", str(max([1, *args.concurrency])), "--disable-uvicorn-access-log",
             "--log-level", "warning", *args.kvferry_args.split()]
    with served(flags, log, timeout_s=args.start_timeout) as url:
        yield url


def slot_ctx(args: argparse.Namespace, phase: str) -> int:
    tokens = args.prefill_len + 1 if phase.startswith("prefill") else args.input_len + args.output_len
    return tokens + SLOT_MARGIN


def run_system(args: argparse.Namespace, system: str, run: int, tokenizer: Path) -> dict[str, dict]:
    """Every phase against one system; llama-server is started per phase (``-np`` = its concurrency)."""
    out: dict[str, dict] = {}

    def one(url: str, phase: str, c: int) -> None:
        warm_up(url, f"Warm-up {run} {phase}: say hello.")
        seed = run * 1000 + c + (500 if phase.startswith("prefill") else 0)
        rec = run_client(args, url, tokenizer, phase, c, seed, args.out / f"{system}_{phase}_run{run}.json")
        out[phase] = rec
        shown = {k: rec.get(k) for k in ("wall_s", "completed", "failed", "output_throughput", "p99_ttft_ms",
                                         "p99_tpot_ms", "prefill_tok_s", "load_after") if rec.get(k) is not None}
        print(f"run {run} {system} {phase}: {json.dumps(shown)}" + (f"\n  ERROR {rec['error']}" if "error" in rec
                                                                     else ""), flush=True)

    if system == "llama.cpp":
        for phase, c in phases(args):
            t0 = time.monotonic()
            log = args.out / f"llama_server_{phase}_run{run}.log"
            # No SSE pings: llama-server sends ":" after 30 s without a token
            # (a request queued behind others' prefills), and `vllm bench
            # serve`'s parser then drops the rest of that stream.
            with llama_server(args.model, log, threads=args.threads, ctx=c * slot_ctx(args, phase), slots=c,
                              extra=["--alias", MODEL_NAME, "--sse-ping-interval", "-1"],
                              timeout_s=args.start_timeout) as url:
                out.setdefault("_start_s", {})[phase] = round(time.monotonic() - t0, 1)
                one(url, phase, c)
            rec = out[phase]
            rec["server_token_counts"] = counts = llama_server_counts(log)
            expected = 1 if phase.startswith("prefill") else args.output_len
            if phase.startswith("prefill"):
                # llama-server's own view of the same prefills (no HTTP, no sampling).
                rates = llama_server_prompt_rates(log, args.prefill_len)
                rec["server_prompt_tok_s"] = statistics.median(rates) if rates else None
            if rec.get("completed") and counts.get(expected, 0) < rec["completed"]:
                rec["short_outputs"] = rec["completed"] - counts.get(expected, 0)
                print(f"  WARNING: llama-server generated {counts}, not {expected} tokens for each request", flush=True)
    else:
        quantization = system.removeprefix("kvferry-")
        t0 = time.monotonic()
        with kvferry_server(args, quantization, args.out / f"{system}_server_run{run}.log") as url:
            out["_start_s"] = round(time.monotonic() - t0, 1)
            for phase, c in phases(args):
                one(url, phase, c)
    return out


def llama_server_counts(log: Path) -> dict[int, int]:
    """{tokens generated: requests} from llama-server's per-request timing lines
    (the warm-up's included): every benchmark request should show ``--output-len``."""
    counts: dict[int, int] = {}
    for m in re.finditer(r"\|\s+eval time =\s+[\d.]+ ms /\s+(\d+) tokens", log.read_text(errors="replace")):
        counts[int(m[1])] = counts.get(int(m[1]), 0) + 1
    return counts


def llama_server_prompt_rates(log: Path, tokens: int) -> list[float]:
    """Prompt tok/s of llama-server's requests of exactly ``tokens`` prompt tokens, from its timing lines."""
    found = re.finditer(r"prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens", log.read_text(errors="replace"))
    return [tokens / float(m[1]) * 1e3 for m in found if int(m[2]) == tokens and float(m[1]) > 0]


def llama_bench(args: argparse.Namespace) -> dict[str, object]:
    """llama.cpp's own prompt-processing rate, pp``--prefill-len`` (``-n 0``: no generation)."""
    tool = llama_cpp_bin("llama-bench")
    if tool is None or not args.prefill_len or args.llama_bench_reps <= 0:
        return {}
    cmd = [str(tool), "-m", str(args.model), "-t", str(args.threads), "-p", str(args.prefill_len), "-n", "0",
           "-r", str(args.llama_bench_reps), "-o", "json"]
    rec: dict[str, object] = {"load_before": loadavg()}
    start = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.phase_timeout)
    except subprocess.TimeoutExpired:
        return {**rec, "error": f"timed out after {args.phase_timeout} s"}
    rec.update(wall_s=round(time.monotonic() - start, 1), load_after=loadavg())
    if r.returncode != 0:
        return {**rec, "error": f"exit {r.returncode}: {r.stderr[-1500:]}"}
    row = json.loads(r.stdout)[0]
    rec.update({k: row.get(k) for k in ("avg_ts", "stddev_ts", "n_prompt", "n_threads", "backends", "cpu_info",
                                        "build_commit", "type_k")})
    return rec


def median_of(results: dict, system: str, phase: str, key: str) -> float | None:
    vals = [r[system][phase][key] for r in results.values()
            if phase in r.get(system, {}) and r[system][phase].get(key) is not None]
    return statistics.median(vals) if vals else None


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.3g}" if abs(x) < 100 else f"{x:,.0f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def table(args: argparse.Namespace, results: dict, systems: list[str], bench_pp: list[dict]) -> str:
    """Markdown: per phase and system the medians over runs; the ratios kvferry gguf / llama.cpp (and / none)."""
    lines = [f"| phase | server | {' | '.join(label for _, label in METRICS)} | prefill tok/s | failed | "
             "each run (output or prefill tok/s) |", "|---|---|" + "---|" * (len(METRICS) + 3)]
    for phase, _ in phases(args):
        for system in systems:
            # One token per prefill request: only its TTFT (and the prefill rate) mean anything.
            vals = [fmt(median_of(results, system, phase, key)) if "ttft" in key or not phase.startswith("prefill")
                    else "-" for key, _ in METRICS]
            failed = sum((r[system][phase].get("failed") or 0) + ("error" in r[system][phase])
                         + (r[system][phase].get("empty_outputs") or 0) + (r[system][phase].get("short_outputs") or 0)
                         for r in results.values() if phase in r.get(system, {}))
            key = "prefill_tok_s" if phase.startswith("prefill") else "output_throughput"
            each = [fmt(r[system][phase].get(key)) for r in results.values() if phase in r.get(system, {})]
            lines.append(f"| {phase} | {system} | {' | '.join(vals)} | "
                         f"{fmt(median_of(results, system, phase, 'prefill_tok_s'))} | {failed} | {', '.join(each)} |")
    lines += ["", "| phase | ratio | output tok/s | TTFT p99 | TPOT p99 | prefill tok/s |", "|---|---|---|---|---|---|"]
    pairs = [("kvferry-gguf", "llama.cpp"), ("kvferry-gguf", "kvferry-none"), ("kvferry-none", "llama.cpp")]
    for phase, _ in phases(args):
        for a, b in pairs:
            if a not in systems or b not in systems:
                continue
            keys = (("-", "p99_ttft_ms", "-", "prefill_tok_s") if phase.startswith("prefill")
                    else ("output_throughput", "p99_ttft_ms", "p99_tpot_ms", "-"))
            cells = [ratio(median_of(results, a, phase, k), median_of(results, b, phase, k)) for k in keys]
            lines.append(f"| {phase} | {a} / {b} | {' | '.join(cells)} |")
    if lines[-1].startswith("|---"):
        lines = lines[:-3]  # one system: no ratios
    server_pp = median_of(results, "llama.cpp", f"prefill{args.prefill_len}", "server_prompt_tok_s")
    if server_pp:
        lines += ["", f"llama-server's own prompt tok/s on those prefills (its log): {fmt(server_pp)}"]
    if bench_pp:
        pp = [b["avg_ts"] for b in bench_pp if b.get("avg_ts")]
        gguf = median_of(results, "kvferry-gguf", f"prefill{args.prefill_len}", "prefill_tok_s")
        if pp:
            lines += ["", f"llama-bench pp{args.prefill_len}: {fmt(statistics.median(pp))} tok/s "
                          f"(runs: {', '.join(fmt(x) for x in pp)}); kvferry-gguf / llama-bench: "
                          f"{ratio(gguf, statistics.median(pp))}"]
    return "\n".join(lines)


def main() -> int:
    from kvferry.model.gguf_convert import convert_gguf, embedded_gguf_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a .gguf file (default: the embedded Q4_1 file)")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[16, 64], help="max requests in flight per phase")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency phase")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill phase (0: skip it)")
    ap.add_argument("--prefill-prompts", type=int, default=5, help="requests of the prefill phase (the median)")
    ap.add_argument("--llama-bench-reps", type=int, default=3, help="llama-bench -r (0: skip llama-bench)")
    ap.add_argument("--runs", type=int, default=2, help="runs, the order of the systems alternating")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of kvferry; -t and -tb of llama.cpp")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="kvferry's KV pool")
    ap.add_argument("--skip-none", action="store_true", help="do not measure kvferry --quantization none")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--kvferry-args", default="", help="extra flags for kvferry serve, e.g. '--speculative-config off'")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="HF tokenizer folder for the client (default: the file's own, as kvferry converts it)")
    ap.add_argument("--vllm", default="/work/vllm-venv/bin/vllm", help="the vllm CLI (its own venv)")
    ap.add_argument("--phase-timeout", type=int, default=1800, help="seconds for one vllm bench serve call")
    ap.add_argument("--start-timeout", type=int, default=900, help="seconds for a server to get ready")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    # SIGTERM unwinds (the servers' ``with`` blocks stop them) rather than orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.model = (args.model or embedded_gguf_path()).resolve()
    args.out = (args.out or Path("bench/results/gguf_serve_vs_llama_cpp") / args.model.stem).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    tokenizer = args.tokenizer or convert_gguf(args.model, weights=False)
    systems = ["kvferry-gguf", *(() if args.skip_none else ("kvferry-none",))]
    reason = None if args.skip_llama_cpp else missing_reason("llama-server")
    if not args.skip_llama_cpp and reason is None:
        systems.insert(0, "llama.cpp")
    elif reason:
        print(f"skipping llama.cpp: {reason}")
    record = {"model": str(args.model), "file_mib": round(args.model.stat().st_size / 2**20, 1),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "threads": args.threads,
              "cpu": cpu_record(), "versions": versions(), "tokenizer": str(tokenizer),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "load_before": loadavg()}
    print(json.dumps({k: record[k] for k in ("model", "file_mib", "date", "threads", "cpu", "load_before")}),
          flush=True)
    t_start = time.monotonic()
    results: dict[str, dict] = {}
    bench_pp: list[dict] = []
    for run in range(1, args.runs + 1):
        order = systems if run % 2 else list(reversed(systems))
        results[f"run{run}"] = {system: run_system(args, system, run, tokenizer) for system in order}
        if "llama.cpp" in systems and (pp := llama_bench(args)):
            bench_pp.append(pp)
            shown = {k: pp[k] for k in ("avg_ts", "wall_s", "error") if k in pp}
            print(f"run {run} llama-bench pp{args.prefill_len}: {json.dumps(shown)}", flush=True)
    record.update(load_after=loadavg(), wall_s=round(time.monotonic() - t_start, 1), results=results,
                  llama_bench=bench_pp)
    md = table(args, results, systems, bench_pp)
    record["table"] = md
    (args.out / "summary.json").write_text(json.dumps(record, indent=2))
    (args.out / "summary.md").write_text(md + "\n")
    cpu = record["cpu"]
    print(f"\n{args.model.name} ({record['file_mib']:,.0f} MiB), {args.threads} threads, {cpu['model_name']} "
          f"(family {cpu['family']} model {cpu['model']}; {' '.join(cpu['flags_usable_by_kvferry'])}), "
          f"{record['date']}; load average before {record['load_before']}, after {record['load_after']}; "
          f"{record['wall_s']:.0f} s in all; {args.runs} run(s), medians\n")
    print(md)
    print(f"\nwrote {args.out / 'summary.json'}")
    bad = ("error", "failed", "empty_outputs", "short_outputs")
    failures = [(run, s, p) for run, r in results.items() for s, ph in r.items() for p, rec in ph.items()
                if isinstance(rec, dict) and any(rec.get(k) for k in bad)]
    if failures:
        print(f"failed or short phases (see summary.json): {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
