"""kvferry and vLLM-CPU side by side on one checkpoint, with vLLM's own
client (``vllm bench serve``, random dataset): the runner that
bench/tp_vs_vllm.py and bench/moe_vs_vllm.py share (imported as
``_vllm_peer``).

Every configuration gets the same model folder, dtype, CPUs (the first
``--threads`` this process may run on, split evenly over the ranks), KV
space per rank, max model length, batch size and tokens a step, and the
client the same prompts: at concurrency C the seed is ``--seed x 1000 + C``
in every run and for every configuration (greedy, ``--ignore-eos``). Each
configuration runs in a server of its own, started afresh each run (a
warm-up of up to 4 requests first, not counted); the order of the
configurations reverses from run to run, so that a machine's drift spreads
over all of them.

Threads: kvferry runs ``OMP_NUM_THREADS`` threads at TP 1,
``--cpu-threads-per-rank`` per rank at TP N, and in ``--mode afd N+M``
``--threads / (N + M)`` in each attention core and FFN worker; vLLM-CPU runs one OpenMP
team per rank on the CPUs its ``VLLM_CPU_OMP_THREADS_BIND`` gives (``0-1``
at TP 1, ``0|1`` at TP 2). ``--bind`` (default) pins both (kvferry:
``KVFERRY_CPU_BIND=1``); ``--no-bind`` pins neither (vLLM's ``nobind``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from _servers import served
from _vllm_server import vllm_served
from summarize_vllm_bench import load, median, table

REPO = Path(__file__).resolve().parents[1]
SERVED_NAME = "peer-model"


@dataclass(frozen=True, slots=True)
class Config:
    """One server: which system, its tensor-parallel size, whether its
    experts are split whole over the ranks (expert parallelism)."""

    name: str  # the result files' prefix: letters, digits, '-' and '.'
    system: str  # "kvferry" or "vllm"
    tp: int = 1
    expert_parallel: bool = False
    afd: str = ""  # kvferry "N+M": --mode afd, N attention cores and M FFN workers (one process each)

    @property
    def ranks(self) -> int:
        """The processes the server's --threads CPUs are split over."""
        if self.afd:
            attention, ffn = (int(n) for n in self.afd.split("+"))
            return attention + ffn
        return self.tp


@dataclass(frozen=True, slots=True)
class Target:
    """``first`` / ``second``'s ``metric`` at each concurrency, and the
    ratio the issue asks for (``higher``: at least, else at most)."""

    first: str
    second: str
    metric: str = "output_throughput"
    goal: float | None = None
    higher: bool = True


def add_common_args(p: argparse.ArgumentParser, *, concurrency: list[int], prompts_per_slot: int, input_len: int,
                    output_len: int, kv_gb: int, out: str) -> None:
    p.add_argument("--vllm", default="/work/vllm-venv/bin/vllm", help="the vllm CLI (its own venv)")
    p.add_argument("--concurrency", type=int, nargs="+", default=concurrency)
    p.add_argument("--prompts-per-slot", type=int, default=prompts_per_slot,
                   help="requests per concurrency level: this x C (at least --min-prompts)")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="CPUs in total for each server, split over its ranks")
    p.add_argument("--bind", action=argparse.BooleanOptionalAction, default=True,
                   help="pin each rank's threads to its CPUs (both systems)")
    p.add_argument("--vllm-preload", action=argparse.BooleanOptionalAction, default=True,
                   help="LD_PRELOAD for vLLM as its CPU install guide sets it: its venv's libiomp5 and "
                        "tcmalloc, those of them that exist")
    p.add_argument("--kv-cache-gb", type=int, default=kv_gb, help="KV space per rank, GiB (both systems)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens a step, both systems (vLLM-CPU's own default grows with TP: 2048 x TP)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kvferry-args", default="", help="more kvferry serve flags, one string "
                   "(e.g. \"--speculative-config off\"; the default: kvferry's defaults, as a user gets them)")
    p.add_argument("--vllm-args", default="", help="more vllm serve flags, one string")
    p.add_argument("--client-timeout", type=int, default=3600, help="seconds one `vllm bench serve` may take")
    p.add_argument("--out", default=out)


def cpu_info() -> dict:
    """The CPU as /proc/cpuinfo names it, and the vector/matrix flags that decide the kernels."""
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "cpu family", "model", "flags") and key not in fields:
            fields[key] = value.strip()
    flags = set(fields.get("flags", "").split())
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"]
    return {"model_name": fields.get("model name"), "family": fields.get("cpu family"), "model": fields.get("model"),
            "flags": [f for f in wanted if f in flags], "cpus_online": os.cpu_count(),
            "cpus_allowed": sorted(os.sched_getaffinity(0))}


def _versions(vllm: str) -> dict:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unknown ({exc})"

    vllm_py = str(Path(vllm).with_name("python"))
    return {"kvferry_commit": run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
            "vllm": run([vllm_py, "-c",
                         "import importlib.metadata as m; print(m.version('vllm'), m.version('torch'))"])}


def _cpu_lists(args: argparse.Namespace, tp: int) -> list[list[int]]:
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]
    if len(cpus) < args.threads or args.threads % tp:
        raise SystemExit(f"--threads {args.threads} over TP {tp}: needs a multiple of {tp} and that many CPUs "
                         f"(this process may run on {len(os.sched_getaffinity(0))})")
    per = args.threads // tp
    return [cpus[r * per:(r + 1) * per] for r in range(tp)]


def kvferry_server(cfg: Config, model: str, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    per = args.threads // cfg.ranks
    if per < 1 or args.threads % cfg.ranks:
        raise SystemExit(f"--threads {args.threads} over {cfg.name}'s {cfg.ranks} processes: needs a multiple")
    flags = ["--model", model, "--dtype", args.dtype, "--served-model-name", SERVED_NAME,
             "--disable-uvicorn-access-log", "--max-model-len", str(args.max_model_len),
             "--max-num-seqs", str(max(args.concurrency)), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--kv-cache-memory-gb", str(args.kv_cache_gb)]
    if cfg.tp > 1:
        flags += ["--tensor-parallel-size", str(cfg.tp), "--cpu-threads-per-rank", str(per)]
    if cfg.expert_parallel:
        flags.append("--enable-expert-parallel")
    if cfg.afd:  # the attention cores and the FFN workers each get `per` threads
        attention, ffn = cfg.afd.split("+")
        flags += ["--mode", "afd", "--attention", attention, "--ffn", ffn, "--cpu-threads-per-rank", str(per)]
    env = {"OMP_NUM_THREADS": str(per), "KVFERRY_CPU_BIND": "1" if args.bind else "0"}
    return flags + shlex.split(args.kvferry_args), env


def vllm_server(cfg: Config, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    flags = ["--dtype", args.dtype, "--served-model-name", SERVED_NAME, "--disable-uvicorn-access-log",
             "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(max(args.concurrency)),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--tensor-parallel-size", str(cfg.tp), "--seed", str(args.seed)]
    if cfg.expert_parallel:
        flags.append("--enable-expert-parallel")
    lists = _cpu_lists(args, cfg.tp)
    bind = "|".join(f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0]) for c in lists) if args.bind else "nobind"
    env = {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gb)}
    flags += shlex.split(args.vllm_args)
    if not args.bind:  # with a binding vLLM sets each rank's OMP_NUM_THREADS itself
        env["OMP_NUM_THREADS"] = str(args.threads // cfg.tp)
    if args.vllm_preload:
        libs = [Path(args.vllm).resolve().parents[1] / "lib" / "libiomp5.so",
                *(Path("/usr/lib/x86_64-linux-gnu") / n for n in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"))]
        found = [str(lib) for lib in libs if lib.exists()]
        if found:
            env["LD_PRELOAD"] = ":".join(found)
    return flags, env


def num_prompts(args: argparse.Namespace, c: int) -> int:
    return max(args.min_prompts, args.prompts_per_slot * c)


def client(args: argparse.Namespace, url: str, model: str, c: int, result: Path, warmups: int) -> None:
    """``vllm bench serve`` at concurrency ``c``; its JSON in ``result``, its output beside it (.txt)."""
    cmd = [args.vllm, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", SERVED_NAME, "--tokenizer", model, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
           "--num-prompts", str(num_prompts(args, c)), "--max-concurrency", str(c),
           "--seed", str(args.seed * 1000 + c), "--temperature", "0", "--num-warmups", str(warmups),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    with open(result.with_suffix(".txt"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=args.client_timeout)


def _vllm_log_notes(log: Path) -> list[str]:
    """What vLLM says about its all-reduce and thread binding (whether its SHM communicator is on)."""
    keep = re.compile(r"SHM communicator|shm_manager|local_rank=\d+, core ids|LD_PRELOAD|"
                      r"MoE backend|Experts MoE|KV cache size")
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
             if keep.search(ln) and "shm_broadcast" not in ln and "with config:" not in ln]
    return [ln[:300] for ln in lines][:12]


def run(args: argparse.Namespace, model: str, configs: list[Config], targets: list[Target],
        model_info: dict) -> int:
    """Every configuration, ``args.runs`` times; the tables and
    ``summary.json`` in ``args.out``. Returns 0."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the with blocks stop the servers
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*_c*_run*.*"):  # results of an earlier run would join this one's medians
        old.unlink()
    meta = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu_info(), "threads_per_server": args.threads, "bind": args.bind,
            "load_average_start": os.getloadavg(), **_versions(args.vllm), "model": model_info,
            "args": {k: v for k, v in vars(args).items()}, "configs": [asdict(c) for c in configs], "steps": []}
    print(f"{meta['date_utc']}  {meta['cpu']['model_name']} (family {meta['cpu']['family']} model "
          f"{meta['cpu']['model']}; {' '.join(meta['cpu']['flags'])}), {args.threads} threads a server, "
          f"load average {' '.join(f'{x:.2f}' for x in meta['load_average_start'])}", flush=True)
    started = time.monotonic()
    for r in range(1, args.runs + 1):
        order = configs if r % 2 else list(reversed(configs))
        for cfg in order:
            log = out / f"{cfg.name}_server_run{r}.log"
            t0 = time.monotonic()
            if cfg.system == "kvferry":
                flags, env = kvferry_server(cfg, model, args)
                ctx = served(flags, log, timeout_s=1200, env=env)
            else:
                flags, env = vllm_server(cfg, args)
                ctx = vllm_served(args.vllm, model, flags, env, log)
            with ctx as url:
                ready_s = time.monotonic() - t0
                for i, c in enumerate(args.concurrency):
                    t1, load0 = time.monotonic(), os.getloadavg()[0]
                    warmups = min(c, 4) if i == 0 else 0  # the server's first requests: not counted
                    client(args, url, model, c, out / f"{cfg.name}_c{c}_run{r}.json", warmups)
                    step = {"run": r, "config": cfg.name, "concurrency": c, "server_start_s": round(ready_s, 1),
                            "client_s": round(time.monotonic() - t1, 1), "load_before": load0,
                            "load_after": os.getloadavg()[0], "server_flags": flags, "server_env": env}
                    meta["steps"].append(step)
                    print(f"run {r} {cfg.name} c{c}: server ready in {ready_s:.0f} s, client {step['client_s']:.0f} s, "
                          f"load {load0:.2f} -> {step['load_after']:.2f}", flush=True)
            if cfg.system == "vllm":
                meta.setdefault("vllm_log_notes", {})[cfg.name] = _vllm_log_notes(log)
    meta["load_average_end"] = os.getloadavg()
    meta["wall_s"] = round(time.monotonic() - started, 1)
    runs = load(out)
    lines = headline(runs, configs, targets, args.concurrency)
    for t in targets:
        if t.goal is not None and t.metric == "output_throughput":
            lines += ["", f"### {t.first} against {t.second}", *table(runs, t.first, t.second)]
    failed = {f"{name} c{c}": sum(r.get("failed", 0) for r in rs) for (c, name), rs in runs.items()}
    if any(failed.values()):  # a failed request is missing from tok/s: the ratios would flatter its server
        lines.insert(0, "**failed requests:** " + ", ".join(f"{k}: {v}" for k, v in failed.items() if v) + "\n")
    meta["ratios"] = ratios(runs, targets, args.concurrency)
    meta["medians"] = {cfg.name: {c: {k: median(runs, c, cfg.name, k) for k in
                                      ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms",
                                       "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "completed", "failed")}
                                  for c in args.concurrency} for cfg in configs}
    (out / "summary.json").write_text(json.dumps(meta, indent=2, default=str))
    lines.append(f"\nload average {' '.join(f'{x:.2f}' for x in meta['load_average_start'])} at start, "
                 f"{' '.join(f'{x:.2f}' for x in meta['load_average_end'])} at end; {meta['wall_s']:.0f} s in all; "
                 f"kvferry {meta['kvferry_commit']}, vllm/torch {meta['vllm']}")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nresults: {out}/summary.json, summary.md, and each run's files")
    return 0


def ratios(runs, targets: list[Target], concurrency: list[int]) -> list[dict]:  # noqa: ANN001 - summarize's Runs
    rows = []
    for t in targets:
        for c in concurrency:
            a, b = median(runs, c, t.first, t.metric), median(runs, c, t.second, t.metric)
            ratio = a / b if a is not None and b else None
            met = None if ratio is None or t.goal is None else (ratio >= t.goal if t.higher else ratio <= t.goal)
            rows.append({"first": t.first, "second": t.second, "metric": t.metric, "concurrency": c,
                         "first_value": a, "second_value": b, "ratio": ratio, "goal": t.goal, "met": met})
    return rows


def headline(runs, configs: list[Config], targets: list[Target], concurrency: list[int]) -> list[str]:  # noqa: ANN001
    """Output tok/s of every configuration per concurrency, then each
    target's ratio with its goal."""
    lines = ["| concurrency | " + " | ".join(f"{c.name} tok/s" for c in configs) + " |",
             "|---|" + "---|" * len(configs)]
    for c in concurrency:
        cells = []
        for cfg in configs:
            v = median(runs, c, cfg.name, "output_throughput")
            cells.append("-" if v is None else f"{v:.1f}")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "| ratio | metric | concurrency | value | goal |", "|---|---|---|---|---|"]
    higher = {(t.first, t.second, t.metric): t.higher for t in targets}
    for row in ratios(runs, targets, concurrency):
        goal = ""
        if row["goal"] is not None and row["met"] is not None:
            sign = ">=" if higher[(row["first"], row["second"], row["metric"])] else "<="
            goal = f"{sign} {row['goal']}: {'met' if row['met'] else 'missed'}"
        value = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(f"| {row['first']} / {row['second']} | {row['metric']} | {row['concurrency']} | {value} "
                     f"| {goal} |")
    return lines

