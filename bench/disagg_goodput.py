"""Goodput against request rate: disaggregated prefill/decode against
colocated serving on the same CPUs, with ``kvferry bench`` as the client.

    python bench/disagg_goodput.py [--configs disagg dp2 colocated] [--rates 0.25,0.5,1,1.5] \\
        [--duration 20] [--input-len 384:640] [--output-len 48] [--slo ttft:3000,tpot:100] \\
        [--output bench/results/disagg_goodput.json]

Configs (each starts its own server, one after another):

* ``disagg``: ``--mode disagg``, one prefill core pinned to --cpus[0], one
  decode core pinned to --cpus[1] (one thread each);
* ``dp2``: colocated, two data-parallel cores (chunked prefill), one pinned
  to each CPU (one thread each);
* ``colocated``: colocated, one core on both CPUs (two threads).

For every rate, one ``kvferry bench`` run sends random-token completions
(Poisson arrivals, ``ignore_eos``) for --duration seconds, then gives
in-flight requests --drain-timeout seconds (the rest count as failed, so
against the SLO). Each rate uses its own seed so that no run finds the
previous run's prompts in the prefix cache. Goodput = requests per second
meeting both SLOs (DistServe's definition, as ``kvferry bench`` reports).

The default SLO pair suits 2 CPUs and the embedded 135M model: one core
prefills a 512-token prompt in about 1 s and decodes a handful of streams
at 30-40 ms per token, so TTFT <= 3 s leaves room for a short queue, and
TPOT <= 100 ms is missed by a stream whose core ran two or three long
prefill chunks during its 48 tokens (the interference disagg removes).
One full sweep (3 configs x 4 rates) takes about 7 minutes.

Writes the combined JSON (per config and rate: goodput, attainment, TTFT and
TPOT percentiles, throughput) and a goodput-vs-rate PNG next to it; each
run's own ``kvferry bench`` JSON goes into ``<output stem>.runs/``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _servers



def config_flags(name: str, cpus: list[str]) -> list[str]:
    if name == "disagg":
        return ["--mode", "disagg", "--prefill", "1", "--decode", "1",
                "--prefill-cpus", cpus[0], "--decode-cpus", cpus[1]]
    if name == "dp2":
        return ["--data-parallel-size", "2", "--engine-cpus", cpus[0], "--engine-cpus", cpus[1]]
    if name == "colocated":
        return ["--engine-cpus", ",".join(cpus)]
    raise ValueError(f"--configs: unknown config {name!r}")


def start_server(args: argparse.Namespace, name: str, log: Path) -> tuple[subprocess.Popen, str]:
    flags = ["--max-model-len", str(args.max_model_len), "--dtype", args.dtype, "--kv-cache-memory-gb", "1",
             "--log-level", "warning", "--disable-uvicorn-access-log", *config_flags(name, args.cpus),
             *args.server_args]
    return _servers.start_server(flags + (["--model", args.model] if args.model else []), log)


def bench_once(args: argparse.Namespace, url: str, rate: float, seed: int, out: Path) -> dict:
    """One ``kvferry bench`` run at ``rate``; its summary."""
    cmd = [sys.executable, "-m", "kvferry.cli", "bench", "--url", url, "--endpoint", "completions",
           "--workload", "random", "--input-len", args.input_len, "--output-len", str(args.output_len),
           "--ignore-eos", "--rate", str(rate), "--duration", str(args.duration),  # bounded by time alone
           "--drain-timeout", str(args.drain_timeout), "--seed", str(seed),
           "--slo", *args.slo.split(","), "--output", str(out), "--no-plots", "--no-progress"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def point(rate: float, s: dict) -> dict:
    return {
        "rate": rate, "goodput": s["goodput"], "slo_attainment_pct": s["slo_attainment_pct"],
        "request_throughput": s["request_throughput"], "completed": s["completed"], "failed": s["failed"],
        "ttft_ms": {k: s["ttft_ms"][k] for k in ("p50", "p90", "p99")},
        "tpot_ms": {k: s["tpot_ms"][k] for k in ("p50", "p90", "p99")},
    }


def plot(results: dict, slo: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_good, ax_att) = plt.subplots(1, 2, figsize=(10, 4))
    for name, points in results.items():
        rates = [p["rate"] for p in points]
        ax_good.plot(rates, [p["goodput"] for p in points], marker="o", label=name)
        ax_att.plot(rates, [p["slo_attainment_pct"] for p in points], marker="o", label=name)
    top = max(p["rate"] for points in results.values() for p in points)
    ax_good.plot([0, top], [0, top], color="grey", linestyle=":", label="offered rate")
    ax_good.set(xlabel="offered rate (req/s)", ylabel="goodput (req/s)", title=f"goodput, SLO {slo}")
    ax_att.set(xlabel="offered rate (req/s)", ylabel="requests within SLO (%)", ylim=(0, 105),
               title="SLO attainment")
    for ax in (ax_good, ax_att):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["disagg", "dp2", "colocated"],
                        choices=["disagg", "dp2", "colocated"])
    parser.add_argument("--rates", default="0.25,0.5,1,1.5", help="offered request rates, req/s")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    parser.add_argument("--drain-timeout", type=float, default=10.0)
    parser.add_argument("--input-len", default="384:640", help="prompt tokens, N or LO:HI")
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--slo", default="ttft:3000,tpot:100", help="kvferry bench --slo, comma-separated")
    parser.add_argument("--cpus", nargs=2, default=["0", "1"], metavar=("CPU_A", "CPU_B"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="passed to every kvferry serve (last on the line)")
    parser.add_argument("--output", default="bench/results/disagg_goodput.json")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    output = Path(args.output)
    runs = output.with_suffix(".runs")
    runs.mkdir(parents=True, exist_ok=True)
    env_note = {"cpus": args.cpus, "affinity": sorted(os.sched_getaffinity(0))}

    results: dict[str, list[dict]] = {}
    started = time.monotonic()
    for name in args.configs:
        proc, url = start_server(args, name, runs / f"{name}.server.log")
        try:
            results[name] = []
            for i, rate in enumerate(rates):
                summary = bench_once(args, url, rate, seed=1000 + i, out=runs / f"{name}.rate{rate:g}.json")
                results[name].append(point(rate, summary))
                p = results[name][-1]
                print(f"{name:10s} rate {rate:5.2f}  goodput {p['goodput']:5.2f} req/s  "
                      f"({p['slo_attainment_pct']:5.1f}% within SLO)  TTFT p50 {p['ttft_ms']['p50'] or 0:7.0f} ms  "
                      f"TPOT p50 {p['tpot_ms']['p50'] or 0:6.1f} ms  failed {p['failed']}", flush=True)
        finally:
            _servers.stop_server(proc)
    data = {"slo": args.slo, "workload": {"input_len": args.input_len, "output_len": args.output_len,
                                          "duration_s": args.duration, "arrivals": "poisson"},
            "dtype": args.dtype, **env_note, "wall_s": time.monotonic() - started, "results": results}
    output.write_text(json.dumps(data, indent=1))
    plot(results, args.slo, output.with_suffix(".png"))
    print(f"wrote {output}, {output.with_suffix('.png')} ({data['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
