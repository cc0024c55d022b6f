"""``kvferry simulate`` and ``kvferry plan``: arguments, validation, commands.

    kvferry simulate --profile P (--workload W | --trace T) [--config colocated:N | prefill:P,decode:D]
                     [--router R] [--slo ttft:MS,tpot:MS] [--fast] [--json]
                     [--layout tp2pp1] [--decode-layout tp1pp1]   (a profile of several parallel layouts)
    kvferry simulate --trace T --cache-blocks inf          (cache-only: the trace's reuse ceiling)
    kvferry plan --profile P --workload W --slo ttft:MS,tpot:MS --gpus N [--rate R] [--instances-per-host K]
                 [--output DIR | PREFIX]
    kvferry plan --hardware fast=F.json:4 --hardware cheap=C.json:1 [--prefill-hardware fast]
                 [--decode-hardware cheap] ...   (priced pools: ranked by cost per million useful tokens)
    kvferry plan --hardware node=MOE.json:1 --gpus 64 --equal-cost --fast [--afd-shapes 2+1,3+1]
                 (an MoE profile: AFD units beside colocated and P/D, every candidate 64 nodes)

A profile of several (TP, PP) layouts is searched per pool, one hardware
per layout (``layouts.py``).

A profile whose fits are poor (``kvferry.bench.profile.poor_fits``) is refused
unless --allow-poor-fit.

Bad arguments print one line and exit 2. Imported by the top-level CLI for
every command: the simulator and the real scheduler (~100 ms) load only
when simulate or plan runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvferry.bench.cli import _one_line_error
from kvferry.bench.metrics import parse_slo
from kvferry.bench.trace import load_trace
from kvferry.bench.workloads import BenchError
from kvferry.plan.afd import DEFAULT_SHAPES, AFDStepCost, afd_hardware, parse_afd_shapes, profile_moe_fits
from kvferry.plan.hardware import Hardware, load_hardware, pick, profile_device, profile_weight_format
from kvferry.plan.latency import KVTransferModel, PlanError, StepCostModel, check_profile_fits, profile_handover_s
from kvferry.plan.layouts import layout_hardware
from kvferry.plan.workload import make_bench_sessions, session_requests, trace_requests

SIM_WORKLOADS = ("random", "shared-prefix")
DEFAULT_PLAN_DIR = "kvferry-plan"  # plan's output folder when --output is not given


def add_plan_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvferry simulate`` and ``kvferry plan``."""
    sim = subparsers.add_parser("simulate", help="predict latency and goodput of a cluster (discrete-event)",
                                description="Replay a workload or trace on simulated instances driven by "
                                            "the real scheduler (or --fast: an analytic model).")
    sim.error = _one_line_error("kvferry simulate")
    _add_common(sim)
    sim.add_argument("--config", default="colocated:1",
                     help="colocated:N, or prefill:P,decode:D (disaggregated)")
    sim.add_argument("--router", default="round-robin", choices=("round-robin", "least-loaded", "prefix-aware"),
                     help="choice of (prefill) instance; decode instances are chosen least-loaded")
    sim.add_argument("--cache-blocks", default=None,
                     help="prefix-cache size in workload blocks: with --profile --fast, the analytic "
                          "cache (default: the KV pool); without --profile, or 'inf': cache-only mode, "
                          "hit ratios without timing. The scheduler mode's cache is the KV pool itself.")
    sim.add_argument("--noise-seeds", type=int, default=5,
                     help="with a profile that measured step-time noise: simulate this many seeded runs "
                          "(step times drawn from the measured spread) and report the mean of each number")
    sim.add_argument("--step-time-scale", type=float, default=1.0,
                     help="multiply every fitted step time by this (e.g. a run's measured engine busy time "
                          "over the simulated one: the profile on a machine that has since sped up or slowed "
                          "down); the JSON's busy_s is the simulated busy time to compare")
    sim.add_argument("--per-request", action="store_true",
                     help="add each request's arrival, TTFT and TPOT (mean over the noise seeds) to the JSON")
    sim.add_argument("--layout", default=None, metavar="NAME",
                     help="with a profile of several parallel layouts (kvferry profile --tensor-parallel-sizes): "
                          "the layout whose fits the colocated or prefill instances step by, e.g. tp2pp1 "
                          "(default: the profile's first layout)")
    sim.add_argument("--decode-layout", default=None, metavar="NAME",
                     help="the layout the decode instances step by (default: --layout)")
    sim.add_argument("--afd", default=None, metavar="A+F",
                     help="the colocated (or, with --config prefill:P,decode:D, the decode) instances are AFD "
                          "units of A attention + F FFN workers (a profile with MoE fits)")
    sim.add_argument("--afd-micro-batches", type=int, default=2,
                     help="with --afd: micro-batches ping-ponged between attention and FFN workers")
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    sim.add_argument("--output", default=None, help="also write the JSON result here")
    sim.set_defaults(func=cmd_simulate)

    plan = subparsers.add_parser("plan", help="choose prefill/decode instance counts for a rate and SLOs",
                                 description="DistServe-style placement search: simulate every split of "
                                             "--gpus into prefill and decode instances and every colocated "
                                             "count; pick the best goodput per GPU, or with priced "
                                             "--hardware pools the lowest cost per million useful tokens.")
    plan.error = _one_line_error("kvferry plan")
    _add_common(plan)
    plan.add_argument("--gpus", type=int, required=True,
                      help="most instances: one GPU each, or with a CPU profile one engine core on the threads it "
                           "was profiled with. With a profile of several parallel layouts every pool is searched "
                           "on each, and an instance counts its layout's share (a TP 2 instance of a GPU profile: "
                           "2 GPUs and twice the price; a CPU profile's layouts share one host's CPUs: 1)")
    plan.add_argument("--router", default="least-loaded", choices=("round-robin", "least-loaded", "prefix-aware"))
    plan.add_argument("--min-attainment", type=float, default=90.0,
                      help="percent of requests within the SLOs a placement must keep to qualify")
    hw = plan.add_argument_group("hardware and prices (instead of --profile)")
    hw.add_argument("--hardware", action="append", default=None, metavar="NAME=PROFILE.json:PRICE",
                    help="a hardware: its kvferry profile JSON and its price per instance per hour (any "
                         "currency unit); repeatable. Candidates put each pool on one hardware (colocated "
                         "counts on each; prefill/decode splits on every pair) and rank by cost per million "
                         "useful tokens (output tokens of requests meeting the SLO)")
    hw.add_argument("--prefill-hardware", default=None, metavar="NAME[,NAME]",
                    help="the hardware prefill pools may use (default: every --hardware)")
    hw.add_argument("--decode-hardware", default=None, metavar="NAME[,NAME]",
                    help="the hardware decode pools may use (default: every --hardware)")
    hw.add_argument("--colocated-hardware", default=None, metavar="NAME[,NAME]",
                    help="the hardware colocated pools may use (default: every --hardware; none: no "
                         "colocated candidates)")
    afd = plan.add_argument_group("attention/FFN disaggregation (a profile with MoE fits: kvferry profile on an "
                                  "MoE model)")
    afd.add_argument("--afd-shapes", default=DEFAULT_SHAPES, metavar="A+F[,A+F]",
                     help="AFD units searched as colocated and decode instances: A attention workers + F FFN "
                          "workers each, counting A+F nodes against --gpus and in the price; 'none': no AFD. "
                          "Only a profile with MoE fits has AFD candidates")
    afd.add_argument("--afd-micro-batches", type=int, default=2,
                     help="micro-batches an AFD unit ping-pongs between its attention and FFN workers "
                          "(1: no overlap, attention + FFN + hop per layer)")
    plan.add_argument("--equal-cost", action="store_true",
                      help="only placements using exactly --gpus units (the same fleet, so the same price): "
                           "compare colocated, P/D and AFD at equal cost, e.g. --gpus 64 --fast")
    plan.add_argument("--output", default=None,
                      help=f"where the plot and the JSON go: a folder (DIR/plan.png, DIR/plan.json) or a file "
                           f"prefix (PREFIX.png, PREFIX.json; a .png or .json ending is dropped). Default: "
                           f"{DEFAULT_PLAN_DIR}/ under the working directory; the paths are printed")
    plan.set_defaults(func=cmd_plan)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None, help="kvferry profile JSON (step time fits)")
    p.add_argument("--allow-poor-fit", action="store_true",
                   help="use a profile whose fits are poor (R² < 0.9 with scattered points: measured on a busy "
                        "machine) instead of refusing it; a warning says so")
    p.add_argument("--instances-per-host", type=int, default=1,
                   help="instances sharing one host (filled prefill-0, decode-0, prefill-1, ...): those on "
                        "one host slow each other's steps by the profile's measured host_sharing while both "
                        "step (a served disagg profile measures it). Default 1: each its own host, no effect")
    p.add_argument("--slo", default=None, help="ttft:MS,tpot:MS (also e2e, itl)")
    p.add_argument("--fast", action="store_true", help="analytic instance model (fleet scale) instead "
                                                       "of the real scheduler")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=SIM_WORKLOADS, default=None)
    w.add_argument("--trace", default=None, help="Mooncake JSONL trace ('default': the shipped slice)")
    w.add_argument("--rate", type=float, default=None,
                   help="requests/s (workloads: default 1; traces: scales the timestamps to this mean rate)")
    w.add_argument("--burstiness", type=float, default=1.0)
    w.add_argument("--num-requests", type=int, default=None, help="workloads: default 200; traces: the first N")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--input-len", default="256")
    w.add_argument("--output-len", default="64")
    w.add_argument("--num-groups", type=int, default=4)
    w.add_argument("--prompts-per-group", type=int, default=8)
    w.add_argument("--system-prompt-len", type=int, default=512)
    w.add_argument("--question-len", type=int, default=64)
    w.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash id")
    w.add_argument("--max-input-len", type=int, default=None)
    w.add_argument("--max-output-len", type=int, default=None)
    i = p.add_argument_group("instance (as kvferry serve)")
    i.add_argument("--num-kv-blocks", type=int, default=4096)
    i.add_argument("--block-size", type=int, default=16)
    i.add_argument("--max-num-seqs", type=int, default=64)
    i.add_argument("--max-num-batched-tokens", type=int, default=2048)
    i.add_argument("--no-prefix-caching", action="store_true")
    k = p.add_argument_group("KV transfer (disaggregated)")
    k.add_argument("--kv-bytes-per-token", type=float, default=0.0, help="KV bytes per token, all layers")
    k.add_argument("--kv-bandwidth-gbps", type=float, default=100.0, help="GB/s between prefill and decode")
    k.add_argument("--kv-latency-ms", type=float, default=None,
                   help="fixed hand-over time (default: the profile's measured hand-over, else 0)")


def _fail(command: str, message: str) -> int:
    print(f"kvferry {command}: error: {message}", file=sys.stderr)
    return 2


def _user_errors():
    return (BenchError, PlanError, ValueError)


# -- inputs ------------------------------------------------------------------------
def parse_config(text: str) -> dict[str, int]:
    """``colocated:N`` or ``prefill:P,decode:D`` -> ClusterConfig counts."""
    counts = {}
    for part in text.split(","):
        name, _, value = part.partition(":")
        name = name.strip()
        if name not in ("colocated", "prefill", "decode") or not value.strip().isdigit():
            raise ValueError(f"--config: expected colocated:N or prefill:P,decode:D, got {text!r}")
        counts[f"num_{name}"] = int(value)
    counts.setdefault("num_colocated", 0)
    return counts


def load_requests(args: argparse.Namespace):
    if (args.workload is None) == (args.trace is None):
        raise ValueError("give one of --workload or --trace")
    for name in ("num_requests", "max_input_len", "max_output_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.rate is not None and not args.rate > 0:
        raise ValueError(f"--rate must be > 0, got {args.rate}")
    if args.trace is not None:
        entries = load_trace(None if args.trace == "default" else args.trace)[: args.num_requests]
        reqs = trace_requests(entries, 1.0, args.trace_block_size, args.max_input_len, args.max_output_len)
        span = reqs[-1].arrival_s
        if args.rate is not None and span > 0:  # rescale to the asked mean rate
            for r in reqs:
                r.arrival_s *= (len(reqs) - 1) / span / args.rate
        return reqs
    sessions = make_bench_sessions(args.workload, args)
    return session_requests(sessions, args.num_requests or 200, args.rate or 1.0, args.burstiness,
                            args.seed, args.block_size)


def instance_config(args: argparse.Namespace):
    from kvferry.plan.instance import InstanceConfig  # lazy: the real scheduler, ~100 ms

    for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return InstanceConfig(args.num_kv_blocks, args.block_size, args.max_num_seqs, args.max_num_batched_tokens,
                          not args.no_prefix_caching)


def transfer_model(args: argparse.Namespace):
    latency_ms = args.kv_latency_ms
    if latency_ms is None:  # a served profile measured the hand-over (transfer + the decode core's first step)
        latency_ms = 1000.0 * profile_handover_s(args.profile) if args.profile else 0.0
    if args.kv_bytes_per_token < 0 or not args.kv_bandwidth_gbps > 0 or latency_ms < 0:
        raise ValueError("--kv-bytes-per-token, --kv-latency-ms must be >= 0 and --kv-bandwidth-gbps > 0")
    return KVTransferModel(args.kv_bytes_per_token, args.kv_bandwidth_gbps, latency_ms / 1000.0)


def layout_cost(profile: str, name: str | None, flag: str, allow_poor_fit: bool) -> StepCostModel:
    """The step model of one parallel layout of ``profile`` (None: its first
    layout, the profile's top-level fits)."""
    hardware = Hardware("profile", profile, None, StepCostModel.from_profile(profile), profile_device(profile))
    if name is None:
        return hardware.cost
    layouts = layout_hardware(hardware, allow_poor_fit)
    for hw in layouts:
        if (hw.layout or "tp1pp1") == name:
            return hw.cost
    known = ", ".join(hw.layout or "tp1pp1" for hw in layouts)
    raise ValueError(f"{flag}: {profile} has no layout {name!r} (it has: {known})")


def _cache_blocks(text: str | None) -> int | None:
    """None: unbounded."""
    if text is None or text.lower() in ("inf", "infinite", "none"):
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--cache-blocks: expected a block count >= 1 or 'inf', got {text!r}")
    return int(text)


# -- simulate ------------------------------------------------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        result = run_simulate(args)
    except _user_errors() as e:
        return _fail("simulate", str(e))
    text = json.dumps(result, indent=1)
    if args.output:
        Path(args.output).write_text(text)
    print(text if args.json else format_simulate(result))
    return 0


def run_simulate(args: argparse.Namespace) -> dict:
    slo = parse_slo(args.slo)
    counts = parse_config(args.config)
    cache_only = args.cache_blocks is not None and (args.profile is None or _cache_blocks(args.cache_blocks) is None)
    if not cache_only and args.profile is None:
        raise ValueError("--profile is required (only --cache-blocks runs without one)")
    capacity = _cache_blocks(args.cache_blocks)
    requests = load_requests(args)
    start = time.perf_counter()
    if cache_only:
        return _run_cache_only(args, counts, requests, capacity, start)
    # Lazy: the simulator and the real scheduler (~100 ms) load only when a command runs.
    from kvferry.plan.report import instance_stats, mean_summary, summarize
    from kvferry.plan.simulator import ClusterConfig, Simulation

    check_profile_fits(args.profile, args.allow_poor_fit, "simulate")
    cost = layout_cost(args.profile, args.layout, "--layout", args.allow_poor_fit)
    decode_cost = (None if args.decode_layout in (None, args.layout)
                   else layout_cost(args.profile, args.decode_layout, "--decode-layout", args.allow_poor_fit))
    if args.afd is not None:  # the decode pool (colocated: every instance) is AFD units
        cost, decode_cost = _afd_costs(args, cost, decode_cost, counts)
    if args.step_time_scale != 1.0:
        cost = cost.scaled(args.step_time_scale)
        decode_cost = decode_cost.scaled(args.step_time_scale) if decode_cost is not None else None
    instance, transfer = instance_config(args), transfer_model(args)
    try:
        cluster = ClusterConfig(**counts, instance=instance, router=args.router, transfer=transfer, fast=args.fast,
                                instances_per_host=args.instances_per_host)
    except ValueError as e:
        flag = "--instances-per-host" if "instances_per_host" in str(e) else "--config"
        raise ValueError(f"{flag}: {e}") from None
    if args.noise_seeds < 1:
        raise ValueError(f"--noise-seeds must be >= 1, got {args.noise_seeds}")
    # Without measured noise (or in the analytic mode) every seed gives the same run.
    seeds = range(args.noise_seeds if cost.noise is not None and not args.fast else 1)
    summaries, runs, sim, busy = [], [], None, []
    for seed in seeds:
        sim = Simulation(cluster, cost, capacity, seed=seed, decode_cost=decode_cost)
        runs.append(list(sim.run([replace(r) for r in requests]).values()))
        summaries.append(summarize(runs[-1], slo))
        busy.append(sum(inst.busy_time for inst in sim.instances()))
    result = {"mode": "fast-analytic" if args.fast else "scheduler", "config": _config_json(args, counts),
              "noise_seeds": len(seeds), "summary": mean_summary(summaries),
              # each seeded run's own summary: how much one run of these very
              # requests varies with the step noise alone
              "seed_summaries": summaries,
              # the instances' summed step time (mean over seeds): a server's engine_step_seconds
              "busy_s": sum(busy) / len(busy), "step_time_scale": args.step_time_scale,
              "instances": instance_stats(sim.instances(), summaries[-1]["duration_s"])}
    if args.per_request:
        result["requests"] = per_request(runs)
    return {**result, "wall_s": time.perf_counter() - start}


def _afd_costs(args: argparse.Namespace, cost: StepCostModel, decode_cost: StepCostModel | None,
               counts: dict[str, int]) -> tuple[StepCostModel, StepCostModel | None]:
    """simulate --afd: (front, decode) step models with the AFD pool's units."""
    shapes = parse_afd_shapes(args.afd, "--afd")
    if len(shapes) != 1:
        raise ValueError(f"--afd: expected one ATTENTION+FFN shape (e.g. 2+1), got {args.afd!r}")
    fits = profile_moe_fits(args.profile)
    if fits is None:
        raise ValueError(f"--afd: {args.profile} has no MoE fits (kvferry profile on an MoE model writes them)")
    if counts.get("num_prefill"):
        return cost, AFDStepCost.of(decode_cost or cost, fits, shapes[0], args.afd_micro_batches)
    return AFDStepCost.of(cost, fits, shapes[0], args.afd_micro_batches), decode_cost


def per_request(runs: list[list]) -> list[dict]:
    """Each request's arrival, TTFT and TPOT (ms), the mean over seeded runs
    of the same requests (None where a run has no value)."""
    out = []
    for results in zip(*runs):
        req = results[0].request

        def mean_ms(values: list) -> float | None:
            return None if any(v is None for v in values) else 1000.0 * sum(values) / len(values)

        out.append({"request_id": req.request_id, "arrival_s": req.arrival_s,
                    "ttft_ms": mean_ms([r.ttft_s for r in results]),
                    "tpot_ms": mean_ms([r.tpot_s for r in results])})
    return out


def _run_cache_only(args, counts, requests, capacity, start) -> dict:
    from kvferry.plan.simulator import simulate_cache_only  # lazy: the simulator, ~100 ms

    if counts.get("num_prefill"):
        counts = {"num_colocated": counts["num_prefill"]}  # the prefill pool is where prompts hit
    instances = simulate_cache_only(requests, max(counts["num_colocated"], 1), args.router, capacity)
    q = sum(i.cache.query_blocks for i in instances)
    h = sum(i.cache.hit_blocks for i in instances)
    return {"mode": "cache-only", "config": _config_json(args, counts),
            "summary": {"num_requests": len(requests), "block_hit_ratio": h / q if q else None,
                        "cache_blocks": capacity, "key_block_size": requests[0].key_block_size},
            "instances": [{"name": i.name, "role": "colocated", "block_hit_ratio": i.cache.block_hit_ratio,
                           "num_requests": i.num_outstanding} for i in instances],
            "wall_s": time.perf_counter() - start}


def _config_json(args, counts) -> dict:
    return {**counts, "router": args.router, "workload": args.workload, "trace": args.trace, "rate": args.rate,
            "num_kv_blocks": args.num_kv_blocks, "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "prefix_caching": not args.no_prefix_caching,
            "instances_per_host": getattr(args, "instances_per_host", 1),
            "layout": getattr(args, "layout", None), "decode_layout": getattr(args, "decode_layout", None),
            "afd": getattr(args, "afd", None)}


def format_simulate(result: dict) -> str:
    s = result["summary"]
    lines = [f"===== kvferry simulate ({result['mode']}, {s['num_requests']} requests, "
             f"{result['wall_s']:.2f} s wall) ====="]
    if result["mode"] == "cache-only":
        lines.append(f"block hit ratio: {_fmt(s['block_hit_ratio'])}")
    else:
        lines.append(f"completed {s['completed']}  failed {s['failed']}  simulated {s['duration_s']:.2f} s  "
                     f"{s['request_throughput']:.3f} req/s")
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            v = s[name]
            lines.append(f"{name:>8}: p50 {_fmt(v['p50'])}  p90 {_fmt(v['p90'])}  p99 {_fmt(v['p99'])}")
        if s["goodput"] is not None:
            lines.append(f"goodput {s['goodput']:.3f} req/s  (SLO attainment {s['slo_attainment_pct']:.1f}%)")
    for inst in result["instances"]:
        lines.append(f"  {inst['name']:>10}: block_hit_ratio {_fmt(inst['block_hit_ratio'])}"
                     + (f"  busy {_fmt(inst.get('busy_fraction'))}" if "busy_fraction" in inst else ""))
    return "\n".join(lines)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"


# -- plan ------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    try:
        result = run_plan(args)
    except _user_errors() as e:
        return _fail("plan", str(e))
    from kvferry.plan.search import format_plan, plot_plan  # lazy: the simulator, ~100 ms

    png, js = plan_output_paths(args.output)
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_plan(result, png)
    js.write_text(json.dumps(result, indent=1))
    print(format_plan(result))
    print(f"wrote the plot to {png} and the result to {js}")
    return 0


def plan_output_paths(output: str | None) -> tuple[Path, Path]:
    """(plot, JSON) for plan's ``--output``: a folder (an existing one, or a
    path ending in a separator) gets plan.png and plan.json; anything else is
    a prefix, a .png or .json ending dropped. Absolute, so the printed paths
    say exactly where the files are."""
    if output is None:
        prefix = Path(DEFAULT_PLAN_DIR) / "plan"
    elif output.endswith(("/", os.sep)) or Path(output).is_dir():
        prefix = Path(output) / "plan"
    else:
        prefix = Path(output)
        if prefix.suffix.lower() in (".png", ".json"):
            prefix = prefix.with_suffix("")
    prefix = prefix.expanduser().absolute()
    return prefix.parent / f"{prefix.name}.png", prefix.parent / f"{prefix.name}.json"


def run_plan(args: argparse.Namespace) -> dict:
    from kvferry.plan.search import search_placement  # lazy: the simulator, ~100 ms

    slo = parse_slo(args.slo)
    if not slo:
        raise ValueError("--slo is required (e.g. ttft:500,tpot:50)")
    if args.gpus < 1 or args.gpus > 64:
        raise ValueError(f"--gpus must be in 1..64, got {args.gpus}")
    if math.isinf(args.rate or 0):
        raise ValueError("--rate must be finite")
    if not 0 < args.min_attainment <= 100:
        raise ValueError(f"--min-attainment must be in (0, 100], got {args.min_attainment}")
    if args.instances_per_host < 1:
        raise ValueError(f"--instances-per-host must be >= 1, got {args.instances_per_host}")
    pools = plan_pools(args)
    if args.instances_per_host > 1 and len({h.base_name for h in pools.all}) > 1:
        raise ValueError("--instances-per-host: pools of different hardware do not share hosts; give one "
                         "--hardware (or --profile) to pack instances onto hosts")
    requests = load_requests(args)
    return search_placement(requests, pools, slo, args.gpus, instance_config(args), pair_transfer(args),
                            args.router, args.fast, args.min_attainment, args.instances_per_host,
                            rate=args.rate, equal_cost=args.equal_cost)


def plan_pools(args: argparse.Namespace):
    """The hardware each pool may use: the --hardware list (priced), or
    --profile alone as one unpriced hardware (the goodput-per-GPU search)."""
    from kvferry.plan.search import Pools  # lazy: the simulator, ~100 ms

    if args.hardware and args.profile is not None:
        raise ValueError("--profile: give either --profile or --hardware NAME=PROFILE.json:PRICE, not both")
    if not args.hardware:
        if args.profile is None:
            raise ValueError("--profile is required (or --hardware NAME=PROFILE.json:PRICE, repeatable)")
        for flag in ("prefill_hardware", "decode_hardware", "colocated_hardware"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --hardware NAME=PROFILE.json:PRICE")
        check_profile_fits(args.profile, args.allow_poor_fit, "plan")
        only = Hardware("profile", args.profile, None, StepCostModel.from_profile(args.profile),
                        profile_device(args.profile), weight_format=profile_weight_format(args.profile))
        layouts = layout_hardware(only, args.allow_poor_fit)  # one per (TP, PP) the profile measured
        units = _afd_units(args, layouts)
        return Pools(list(layouts) + units, list(layouts), list(layouts) + units)
    hardware = [lay for hw in load_hardware(args.hardware, args.allow_poor_fit)
                for lay in layout_hardware(hw, args.allow_poor_fit)]
    colocated = ([] if (args.colocated_hardware or "").strip().lower() == "none"
                 else pick(hardware, args.colocated_hardware, "--colocated-hardware"))
    # Every layout serves every pool: a prefill or decode pool runs TP x PP as a colocated core does.
    decode = pick(hardware, args.decode_hardware, "--decode-hardware")
    prefill = pick(hardware, args.prefill_hardware, "--prefill-hardware")
    return Pools(colocated + _afd_units(args, colocated), prefill, decode + _afd_units(args, decode))


def _afd_units(args: argparse.Namespace, hardware: list[Hardware]) -> list[Hardware]:
    """Each MoE-profiled hardware of a pool (its first layout) as an AFD
    unit of each --afd-shapes shape; none without MoE fits, or when hosts
    are shared (--instances-per-host: a unit's workers are nodes of their own)."""
    shapes = parse_afd_shapes(args.afd_shapes)
    if args.afd_micro_batches < 1:
        raise ValueError(f"--afd-micro-batches must be >= 1, got {args.afd_micro_batches}")
    if not shapes or args.instances_per_host > 1:
        return []
    first = [h for h in hardware if h.layout in ("", "tp1pp1")]
    return [unit for h in first for unit in afd_hardware(h, shapes, args.afd_micro_batches)]


def pair_transfer(args: argparse.Namespace):
    """The hand-over between a prefill and a decode pool: the flags' bytes
    and bandwidth, and a fixed latency of --kv-latency-ms or else the larger
    of the two profiles' measured hand-overs (each includes its decode
    core's first step; which pool's dominates a mixed pair is not measured)."""
    if args.kv_bytes_per_token < 0 or not args.kv_bandwidth_gbps > 0 or (args.kv_latency_ms or 0) < 0:
        raise ValueError("--kv-bytes-per-token, --kv-latency-ms must be >= 0 and --kv-bandwidth-gbps > 0")

    def transfer(prefill, decode) -> KVTransferModel:
        latency_ms = args.kv_latency_ms
        if latency_ms is None:
            latency_ms = 1000.0 * max(profile_handover_s(prefill.profile), profile_handover_s(decode.profile))
        return KVTransferModel(args.kv_bytes_per_token, args.kv_bandwidth_gbps, latency_ms / 1000.0)

    return transfer
