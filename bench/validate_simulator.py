"""Validate ``kvferry simulate`` against real runs on this machine.

One command: profile the model (or reuse profiles), serve each configuration
for real under ``kvferry bench`` load, replay the very same request list
(send times, token counts, prompt blocks) through ``kvferry simulate``, and
report the relative error of TTFT p50/p99, TPOT p50/p99 and goodput.

    python bench/validate_simulator.py [--quick] [--output-dir runs/simval] \\
        [--profile-mode served|engine] [--rates-shared 1,2] [--rates-random 1,2] [--configs ...]

Configurations (each at every rate of its workload):
  cache-on / cache-off   colocated, chunked prefill, prefix cache on / off; shared-prefix workload
  colocated / disagg     colocated chunked prefill / disagg 1+1 (prefill on CPU 0, decode on CPU 1);
                         random workload; simulated with --instances-per-host 2 (one host: the
                         served profile's measured host sharing applies)

Profiles (--profile-mode): ``served`` (default) runs ``kvferry profile --url``
against each server before its runs, so HTTP, process hops,
detokenization, CPU sharing and the disagg hand-over are in the fits;
``engine`` profiles the in-process engine instead (the colocated engine runs
torch on every CPU, a disagg core on one: default threads and --threads 1).

Configurations with the same server flags (cache-on, colocated) share one
server; each run uses a fresh seed's prompts, so that no run finds an
earlier run's prompts in the cache.

Writes to --output-dir: profiles, every bench JSON, trace and simulate JSON,
validation.json (rows: run, metric, measured, predicted, rel_error;
breakdown: per run, the mean TTFT error of requests sent to an idle and to a
busy server, and the mean TPOT error; profile_quality: each served profile's
fit quality; speed and calibrated_rows, below), validation.md (the tables
and any profile warnings, also printed) and validation.png (predicted vs
measured). Each served profile's fit quality is printed when it is taken.

Speed calibration: the machine's speed drifts between the profile and a run
minutes later (the same request's TTFT moved 30 -> 18 ms over a few minutes
on one idle server). Each run is therefore also simulated with every step
time scaled by the run's measured engine busy time (the server's
``kvferry:engine_step_seconds``, before and after) over the simulated busy
time (``busy_s``): ``speed`` holds the three numbers per run,
``calibrated_rows`` and validation-calibrated.png the errors then. The raw
rows are the simulator's prediction; the calibrated ones its model error
once the run's speed is known.

Probe: right before each run, ``--probe-requests`` random-workload requests
go to the server one at a time; simulated likewise, their measured over
simulated busy time is the machine's speed just then (``probe_scale`` in
``speed``). Each run is simulated once more with that scale
(``probed_rows``, validation-probed.png): a prediction that knows the speed
of a few seconds before the run, not of the run itself.

Re-simulation: ``--resimulate DIR`` reads an earlier served-mode sitting's
output folder (its bench JSONs, traces, probes and profiles) and simulates
its runs again with this tree, starting no server, into ``--output-dir``:
a change to the model is then judged against every stored sitting.

Spread: the simulator runs each request list under several noise seeds;
``spread`` holds, per run and metric, the relative standard deviation over
the seeds: how far a single run may land from the mean of many when only
the steps' noise differs (with 40 requests the p99 is their largest one
or two; hence 120 by default).
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import _servers
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kvferry.bench.metrics import parse_slo  # noqa: E402
from kvferry.plan.validate import (  # noqa: E402
    breakdown_table, error_rows, markdown_table, measured_summary, plot_validation, predicted_spread,
    predicted_summary, request_breakdown, speed_table, spread_table, trace_lines)

COLOCATED = ["--enable-chunked-prefill"]
# name -> (workload, server flags, simulate --config, profile key, simulate extra flags)
CONFIGS = {
    "cache-on": ("shared-prefix", COLOCATED, "colocated:1", "colocated", []),
    "cache-off": ("shared-prefix", COLOCATED + ["--no-enable-prefix-caching"], "colocated:1", "colocated",
                  ["--no-prefix-caching"]),
    "colocated": ("random", COLOCATED, "colocated:1", "colocated", []),
    "disagg": ("random", ["--mode", "disagg", "--prefill", "1", "--decode", "1", "--prefill-cpus", "0",
                          "--decode-cpus", "1"], "prefill:1,decode:1", "one_cpu",
               ["--instances-per-host", "2"]),  # both cores on this one host: they slow each other
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--output-dir", default="runs/simval")
    p.add_argument("--quick", action="store_true", help="smoke run: one rate each, few requests, small profile")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--profile-mode", choices=("served", "engine"), default="served",
                   help="served: `kvferry profile --url` against each configuration's server before its runs "
                        "(HTTP, IPC, CPU sharing and the disagg hand-over included); engine: the in-process "
                        "profile (engine steps alone), once per thread count")
    p.add_argument("--profile", default=None, help="engine mode: reuse this profile JSON for colocated engines")
    p.add_argument("--profile-1cpu", default=None,
                   help="engine mode: reuse this profile JSON (--threads 1) for disagg cores")
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--rates-shared", default="0.5,1", help="shared-prefix request rates (req/s)")
    p.add_argument("--rates-random", default="1,2", help="random request rates (req/s)")
    p.add_argument("--num-requests", type=int, default=120,
                   help="requests per run (with 40 a run's p99 is its largest one or two requests)")
    p.add_argument("--slo", default="ttft:1000,tpot:150", help="goodput SLOs (ms), both workloads")
    p.add_argument("--input-len", default="96:160", help="random workload prompt tokens")
    p.add_argument("--output-len", default="24:40", help="both workloads: generated tokens (ignore_eos)")
    p.add_argument("--system-prompt-len", type=int, default=256, help="shared-prefix")
    p.add_argument("--question-len", type=int, default=32, help="shared-prefix")
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix")
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--warmup-requests", type=int, default=3, help="sent before each server's first run")
    p.add_argument("--resimulate", default=None, metavar="DIR",
                   help="simulate the runs of an earlier sitting's output folder again with this tree "
                        "(its bench JSONs, traces and profiles; no server is started)")
    p.add_argument("--probe-requests", type=int, default=8,
                   help="random-workload requests sent one at a time right before each run, to measure the "
                        "machine's speed then (0: no probe)")
    args = p.parse_args()
    if args.quick:
        args.rates_shared = args.rates_shared.split(",")[0]
        args.rates_random = args.rates_random.split(",")[0]
        args.num_requests = min(args.num_requests, 12)
        args.probe_requests = min(args.probe_requests, 3)
    return args


def kvferry(*argv: str, log: Path | None = None) -> None:
    cmd = [sys.executable, "-m", "kvferry.cli", *argv]
    with open(log, "w") if log else open("/dev/null", "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[2:5])} ... failed (exit {rc}); see {log}")


# -- profiles ---------------------------------------------------------------------
def profile_grid(args: argparse.Namespace) -> list[str]:
    if args.quick:
        return ["--new-tokens", "32,128,256", "--cached-tokens", "0,256", "--batch-sizes", "1,4",
                "--context-lens", "64,256", "--repeats", "1", "--decode-steps", "4"]
    return ["--new-tokens", "16,64,128,256,320", "--cached-tokens", "0,256", "--batch-sizes", "1,2,4,8",
            "--context-lens", "96,320", "--repeats", "3", "--decode-steps", "8"]


def profiles(args: argparse.Namespace, out: Path) -> dict[str, str | None]:
    """Engine mode: the in-process profiles (served mode profiles each server in run_config)."""
    paths = {"colocated": args.profile, "one_cpu": args.profile_1cpu}
    if args.profile_mode == "served":
        return paths
    grid = profile_grid(args)
    model = ["--model", args.model] if args.model else []
    needed = {CONFIGS[c][3] for c in args.configs}
    for key, threads in (("colocated", []), ("one_cpu", ["--threads", "1"])):
        if paths[key] is None and key in needed:
            paths[key] = str(out / f"profile_{key}.json")
            print(f"profiling ({key}) ...", flush=True)
            kvferry("profile", *grid, *threads, *model, "--block-size", str(args.block_size),
                    "--output", paths[key], log=out / f"profile_{key}.log")
            report_profile_quality(key, paths[key])
    return paths


PROFILE_QUALITY: dict[str, dict] = {}  # server label -> the profile's quality


def report_profile_quality(label: str, profile: str) -> None:
    """Print a fresh profile's fit quality (and its warnings: a run simulated
    from a poor profile is not the simulator's error alone)."""
    quality = json.loads(Path(profile).read_text()).get("quality") or {}
    PROFILE_QUALITY[label] = quality
    for kind in ("prefill", "decode"):
        q = quality.get(kind) or {}
        if q.get("rms_rel_error") is not None:
            print(f"{label}: {kind} fit: rms {100 * q['rms_rel_error']:.1f}%, worst point "
                  f"{100 * q['max_rel_error']:.1f}%, R^2 {q['r2']:.3f}"
                  + (f", rounds {q['round_trend']}" if q.get("round_trend") else "")
                  + (f", noise mean {q['noise_mean']:.3f}" if q.get("noise_mean") else ""), flush=True)
    for line in quality.get("warnings", ()):
        print(f"{label}: PROFILE WARNING: {line}", flush=True)


# -- servers ----------------------------------------------------------------------
def start_server(args: argparse.Namespace, flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    common = ["--max-model-len", "2048", "--num-kv-blocks", str(args.num_kv_blocks), "--block-size",
              str(args.block_size), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning", "--disable-uvicorn-access-log"]
    return _servers.start_server([*common, *flags, *(["--model", args.model] if args.model else [])], log,
                                 timeout_s=300)


def warm_up(url: str, n: int) -> None:
    """First requests build kernels and allocate: keep them out of the measurements."""
    for i in range(n):
        httpx.post(f"{url}/v1/completions", json={"prompt": f"warm up {i}: " + "ferry " * 100, "max_tokens": 8,
                                                  "temperature": 0}, timeout=300, trust_env=False)


def prompts_token_ids(url: str, args: argparse.Namespace, workload: str, seed: int,
                      num_requests: int | None = None) -> list[list[int]]:
    """The token ids of the run's prompts, as the server tokenizes them (chat
    template included): the same sessions the bench generates for ``seed``."""
    from itertools import islice

    from kvferry.bench.run import make_workload

    wargs = argparse.Namespace(workload=workload, seed=seed, **workload_args(args))
    sessions, _ = make_workload(wargs)
    ids = []
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        for s in islice(sessions, num_requests or args.num_requests):
            resp = client.post("/tokenize", json={"messages": s.requests[0].messages})
            resp.raise_for_status()
            ids.append(resp.json()["tokens"])
    return ids


def workload_args(args: argparse.Namespace) -> dict:
    return {"input_len": args.input_len, "output_len": args.output_len, "num_groups": args.num_groups,
            "prompts_per_group": max(args.num_requests // args.num_groups, 1),
            "system_prompt_len": args.system_prompt_len, "question_len": args.question_len}


def bench_flags(args: argparse.Namespace, workload: str) -> list[str]:
    w = workload_args(args)
    flags = ["--output-len", w["output_len"]]
    if workload == "random":
        return flags + ["--input-len", w["input_len"]]
    return flags + ["--num-groups", str(w["num_groups"]), "--prompts-per-group", str(w["prompts_per_group"]),
                    "--system-prompt-len", str(w["system_prompt_len"]), "--question-len", str(w["question_len"])]


# -- one configuration ------------------------------------------------------------
BREAKDOWNS: dict[str, dict] = {}  # run -> request_breakdown
def run_server(args: argparse.Namespace, names: list[str], rates: dict[str, list[float]], profile: str | None,
               out: Path) -> list[dict]:
    """One server for ``names`` (configurations with the same server flags):
    profile it (served mode), bench each configuration at each rate, then
    simulate every run."""
    label = "+".join(names)
    proc, url = start_server(args, CONFIGS[names[0]][1], out / f"{label}.server.log")
    runs = []
    try:
        warm_up(url, args.warmup_requests)
        if profile is None:
            profile = str(out / f"{label}.profile.json")
            print(f"{label}: profile the server ...", flush=True)
            kvferry("profile", "--url", url, *profile_grid(args), "--output", profile,
                    log=out / f"{label}.profile.log")
            report_profile_quality(label, profile)
        for name in names:
            workload = CONFIGS[name][0]
            for i, rate in enumerate(rates[workload]):
                seed = 1000 + i  # a fresh prompt set per rate: no run hits an earlier run's cache
                run = f"{name}@{rate:g}"
                probe = probe_run(args, url, run, out) if args.probe_requests else None
                runs.append((name, run, *bench_run(args, url, workload, rate, seed, out, name), probe))
    finally:
        _servers.stop_server(proc)
    rows = []
    for name, run, prompts, bench_json, probe in runs:
        trace = write_trace(bench_json, prompts, args.block_size, out / f"{run}.trace.jsonl")
        probe_files = None
        if probe is not None:
            probe_prompts, probe_json = probe
            probe_files = (probe_json, write_trace(probe_json, probe_prompts, args.block_size,
                                                   out / f"{run}.probe.trace.jsonl"))
        rows += simulate_run(args, name, run, bench_json, trace, profile, out, probe_files)
    return rows


_probe_seeds = iter(range(5000, 6000))  # every probe its own prompts: none hits an earlier one in the cache


def probe_run(args: argparse.Namespace, url: str, run: str, out: Path) -> tuple[list[list[int]], Path]:
    """A few random-workload requests, one at a time, right before the run:
    the machine's speed then, which the profile taken minutes earlier does
    not know. Simulated like a run (``simulate_run``), its busy time against
    the measured one gives a step-time scale known before the run starts."""
    seed = next(_probe_seeds)
    prompts = prompts_token_ids(url, args, "random", seed, args.probe_requests)
    bench_json = out / f"{run}.probe.bench.json"
    kvferry("bench", "--url", url, "--workload", "random", "--concurrency", "1", "--seed", str(seed),
            "--num-requests", str(args.probe_requests), "--ignore-eos", *bench_flags(args, "random"),
            "--no-progress", "--no-plots", "--output", str(bench_json), log=out / f"{run}.probe.bench.log")
    return prompts, bench_json


def bench_run(args: argparse.Namespace, url: str, workload: str, rate: float, seed: int, out: Path,
              name: str) -> tuple[list[list[int]], Path]:
    run = f"{name}@{rate:g}"
    prompts = prompts_token_ids(url, args, workload, seed)
    bench_json = out / f"{run}.bench.json"
    print(f"{run}: bench ({workload}, {args.num_requests} requests) ...", flush=True)
    kvferry("bench", "--url", url, "--workload", workload, "--rate", f"{rate:g}", "--seed", str(seed),
            "--num-requests", str(args.num_requests), "--ignore-eos", "--slo", args.slo,
            *bench_flags(args, workload), "--no-progress", "--no-plots", "--output", str(bench_json),
            log=out / f"{run}.bench.log")
    return prompts, bench_json


def write_trace(bench_json: Path, prompts: list[list[int]], block_size: int, path: Path) -> Path:
    """The bench run's request list as a trace (``trace_lines``), saved
    beside it so that ``--resimulate`` can replay it later."""
    records = json.loads(bench_json.read_text())["records"]
    path.write_text("".join(json.dumps(line) + "\n" for line in trace_lines(records, prompts, block_size)))
    return path


def busy_scale(args: argparse.Namespace, name: str, run: str, bench_json: Path, trace: Path,
               profile: str, out: Path, tag: str) -> float | None:
    """Measured engine busy seconds of a bench run over the simulated ones
    for its requests (None without the server's counter)."""
    bench = json.loads(bench_json.read_text())
    busy = (bench.get("server") or {}).get("engine_step_seconds_delta")
    sim = simulate(args, name, run, profile, trace, out / f"{run}.{tag}.sim.json", out / f"{run}.{tag}.sim.log")
    return busy / sim["busy_s"] if busy and sim.get("busy_s") else None


def simulate_run(args: argparse.Namespace, name: str, run: str, bench_json: Path, trace: Path,
                 profile: str, out: Path, probe: tuple[Path, Path] | None = None) -> list[dict]:
    """Replay one bench run's request list through ``kvferry simulate``; its
    error rows (and, per request, where the error sits: BREAKDOWNS;
    the simulator's own seed-to-seed spread: SPREAD). Then again with every
    step time scaled, twice:

    - PROBED: by the probe's measured busy time over its simulated one (the
      machine's speed right before the run: still a prediction);
    - CALIBRATED: by the run's own measured busy time over the simulated one
      (its speed taken as known, so what is left is the model's error)."""
    bench = json.loads(bench_json.read_text())
    measured = measured_summary(bench["records"], parse_slo(args.slo))
    sim = simulate(args, name, run, profile, trace, out / f"{run}.sim.json", out / f"{run}.sim.log")
    BREAKDOWNS[run] = request_breakdown(bench["records"], sim["requests"])
    SPREAD[run] = predicted_spread(sim)
    busy = (bench.get("server") or {}).get("engine_step_seconds_delta")
    if busy and sim.get("busy_s"):
        scale = busy / sim["busy_s"]
        SPEED[run] = {"measured_busy_s": busy, "simulated_busy_s": sim["busy_s"], "scale": scale}
        if probe is not None and (probed := busy_scale(args, name, run, *probe, profile, out, "probe")):
            SPEED[run]["probe_scale"] = probed
            print(f"{run}: the probe before it ran x{probed:.3f} the profile's step times: "
                  "simulate again with that ...", flush=True)
            sim_probed = simulate(args, name, run, profile, trace, out / f"{run}.sim-probed.json",
                                  out / f"{run}.sim-probed.log", ["--step-time-scale", f"{probed:.4f}"])
            PROBED.extend(error_rows(run, measured, predicted_summary(sim_probed)))
        print(f"{run}: engine busy {busy:.2f} s measured, {sim['busy_s']:.2f} s simulated: "
              f"simulate again with step times x{scale:.3f} ...", flush=True)
        calibrated = simulate(args, name, run, profile, trace, out / f"{run}.sim-calibrated.json",
                              out / f"{run}.sim-calibrated.log", ["--step-time-scale", f"{scale:.4f}"])
        CALIBRATED.extend(error_rows(run, measured, predicted_summary(calibrated)))
    return error_rows(run, measured, predicted_summary(sim))


SPEED: dict[str, dict] = {}  # run -> engine busy seconds measured / simulated, their ratio (and the probe's)
CALIBRATED: list[dict] = []  # error rows of the simulations scaled by the run's own busy time
PROBED: list[dict] = []  # error rows of the simulations scaled by the probe before the run
SPREAD: dict[str, dict] = {}  # run -> the simulator's seed-to-seed spread per metric


def simulate(args: argparse.Namespace, name: str, run: str, profile: str, trace: Path, sim_json: Path, log: Path,
             extra: list[str] = ()) -> dict:
    _, _, sim_config, _, sim_flags = CONFIGS[name]
    print(f"{run}: simulate ...", flush=True)
    kvferry("simulate", "--profile", profile, "--trace", str(trace), "--trace-block-size", str(args.block_size),
            "--config", sim_config, "--slo", args.slo, "--num-kv-blocks", str(args.num_kv_blocks),
            "--block-size", str(args.block_size), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-num-seqs", str(args.max_num_seqs), *sim_flags, *extra, "--per-request", "--json",
            "--output", str(sim_json), log=log)
    return json.loads(sim_json.read_text())


def resimulate_server(args: argparse.Namespace, names: list[str], rates: dict[str, list[float]], src: Path,
                      out: Path) -> list[dict]:
    """``--resimulate``: the runs of a served-mode sitting in ``src`` (bench
    JSONs, traces, probes, the server's profile) simulated again by this
    tree, no server started. A profile of an older tree gets the fields
    this one reads that it can derive from its own points and fits (the
    fitted time of each step-noise ratio)."""
    from kvferry.bench.profile_served import step_noise

    label = "+".join(names)
    data = json.loads((src / f"{label}.profile.json").read_text())
    noise = data.get("step_noise") or {}
    if noise and "prefill_at_s" not in noise:
        derived = step_noise(data["prefill"]["points"], data["prefill"]["fit"], data["decode"]["points"],
                             data["decode"]["fit"], data["mixed"]["points"], data["mixed"]["fit"])
        if derived["prefill"] != noise["prefill"] or derived["decode"] != noise["decode"]:
            raise RuntimeError(f"{label}: the profile's step_noise is not its points over its fits")
        data["step_noise"] = derived
    profile = out / f"{label}.profile.json"
    profile.write_text(json.dumps(data))
    report_profile_quality(label, str(profile))
    rows = []
    for name in names:
        for rate in rates[CONFIGS[name][0]]:
            run = f"{name}@{rate:g}"
            bench_json = out / f"{run}.bench.json"
            bench_json.write_bytes((src / f"{run}.bench.json").read_bytes())
            probe = None
            if (src / f"{run}.probe.trace.jsonl").exists():
                probe = (src / f"{run}.probe.bench.json", src / f"{run}.probe.trace.jsonl")
            rows += simulate_run(args, name, run, bench_json, src / f"{run}.trace.jsonl", str(profile), out, probe)
    return rows


def main() -> int:
    args = parse_args()
    out = Path(args.output_dir)
    src = Path(args.resimulate) if args.resimulate else None
    if src is not None:
        if src.resolve() == out.resolve():
            print("error: --resimulate needs an --output-dir other than the sitting it reads", file=sys.stderr)
            return 2
        try:
            stored = json.loads((src / "validation.json").read_text())["args"]
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --resimulate {src}: no validation.json of a sitting there ({e})", file=sys.stderr)
            return 2
        if stored.get("profile_mode", "served") != "served" or stored.get("resimulate"):
            print(f"error: --resimulate {src}: only a served-mode sitting with its own runs can be replayed",
                  file=sys.stderr)
            return 2
        # the sitting's own request lists and server settings
        for key in ("configs", "rates_shared", "rates_random", "num_requests", "slo", "block_size",
                    "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs"):
            setattr(args, key, stored[key])
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # unwind: servers stop in `finally`
    start = time.monotonic()
    rates = {"shared-prefix": [float(r) for r in args.rates_shared.split(",")],
             "random": [float(r) for r in args.rates_random.split(",")]}
    # configurations with the same server flags share one server (and its profile)
    servers: dict[tuple[str, ...], list[str]] = {}
    for name in args.configs:
        servers.setdefault(tuple(CONFIGS[name][1]), []).append(name)
    rows: list[dict] = []
    if src is not None:
        for names in servers.values():
            rows += resimulate_server(args, names, rates, src, out)
    else:
        paths = profiles(args, out)
        for names in servers.values():
            rows += run_server(args, names, rates, paths[CONFIGS[names[0]][3]], out)
    table = markdown_table(rows) + "\n\nWhere the error sits (mean relative error per request):\n\n" + \
        breakdown_table(BREAKDOWNS)
    table += ("\n\nThe simulator's spread over its noise seeds (relative standard deviation of each "
              "metric across seeded runs of the same requests: how far one run lands from the mean of "
              "many when only step noise differs):\n\n" + spread_table(SPREAD))
    if SPEED:
        table += ("\n\nEngine busy time (`engine_step_seconds` from the server's /metrics) over the "
                  "simulated one, in each run and in the probe sent right before it:\n\n" + speed_table(SPEED))
    if PROBED:
        table += ("\n\nProbe-calibrated (step times scaled by the probe's ratio: the machine's speed "
                  "right before the run, so still a prediction):\n\n" + markdown_table(PROBED))
    if CALIBRATED:
        table += ("\n\nSpeed-calibrated (step times scaled by the run's own ratio: its speed taken as "
                  "known, so what is left is the model's error):\n\n" + markdown_table(CALIBRATED))
    warnings = [f"- {label}: {w}" for label, q in PROFILE_QUALITY.items() for w in q.get("warnings", ())]
    if warnings:
        table += "\n\nProfile warnings (fit quality, `quality` in each profile JSON):\n\n" + "\n".join(warnings)
    (out / "validation.json").write_text(json.dumps({"args": vars(args), "rows": rows, "breakdown": BREAKDOWNS,
                                                     "speed": SPEED, "calibrated_rows": CALIBRATED,
                                                     "probed_rows": PROBED, "spread": SPREAD,
                                                     "profile_quality": PROFILE_QUALITY}, indent=1))
    (out / "validation.md").write_text(table + "\n")
    plot_validation(rows, out / "validation.png")
    if PROBED:
        plot_validation(PROBED, out / "validation-probed.png",
                        title="kvferry simulate (probe-calibrated before each run) vs measured")
    if CALIBRATED:
        plot_validation(CALIBRATED, out / "validation-calibrated.png",
                        title="kvferry simulate (speed-calibrated per run) vs measured")
    print(table)
    print(f"wrote {out}/validation.json, validation.md, validation.png ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
