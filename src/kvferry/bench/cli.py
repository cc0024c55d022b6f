"""``kvferry bench`` and ``kvferry profile``: arguments, validation and commands.

    kvferry bench --url URL --workload W [--rate R | --concurrency C]   (--url and --workload required)
                  [--num-requests N | --duration S] [--slo ttft:MS,tpot:MS] [--output FILE.json]
    kvferry bench compare A.json B.json
    kvferry profile [--model PATH] [--new-tokens ...] [--batch-sizes ...] [--output profile.json]

Imported by the top-level CLI for every subcommand, so heavy modules
(torch, httpx, matplotlib, rich) are imported only when bench runs; the
light ones (workloads, metrics, plots' entry points) at the top.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from kvferry.bench.compare import compare_table
from kvferry.bench.metrics import RequestRecord, add_cost, parse_slo
from kvferry.bench.plots import plot_latency_cdfs, plot_sweep
from kvferry.bench.profile import ProfileGrid, plot_profile
from kvferry.bench.profile_layouts import layout_summary, parse_layouts, plot_layouts, run_layout_profiles
from kvferry.bench.workloads import BenchError
from kvferry.config import QUANTIZATIONS

WORKLOADS = ("random", "shared-prefix", "multi-turn", "long-doc", "trace", "multi-tenant")


def _one_line_error(prog: str):
    """A parser's error() that prints the message alone, one line (a
    kvferry.cli_parser.Parser still names the nearest flag for an unknown one)."""
    def error(message: str):
        print(f"{prog}: error: {message}", file=sys.stderr)
        sys.exit(2)
    return error


def _one_line(parser: argparse.ArgumentParser, prog: str) -> None:
    if hasattr(parser, "usage_on_error"):  # kvferry.cli_parser.Parser (the kvferry CLI's)
        parser.usage_on_error = False
    else:
        parser.error = _one_line_error(prog)


def add_bench_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvferry bench`` and ``kvferry profile``."""
    add_bench_parser(subparsers)
    add_profile_parser(subparsers)


def add_profile_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="fit prefill and decode step times of the in-process engine",
                              description="Measure prefill time against new and cached tokens and decode "
                                          "step time against batch size and context; fit, save, plot.")
    _one_line(p, "kvferry profile")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: the embedded model); "
                                                 "with --url: the served model name (default: the first)")
    p.add_argument("--url", default=None, help="profile a running server from the client side instead of the "
                                               "in-process engine (HTTP, IPC, detokenization and CPU sharing "
                                               "included; disagg: the prefill -> decode hand-over too)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="the weight format, as kvferry serve's flag (a .gguf: its blocks by default; int8: "
                        "W8A8). The profile records the format the model ran in (weight_format: bf16, "
                        "float32, int8, the file's type such as Q4_K_M): kvferry plan never pairs pools "
                        "of different formats, and sets their costs side by side")
    p.add_argument("--weight-format", default=None, metavar="NAME",
                   help="with --url: the served model's weight format to record (bf16, int8, Q4_K_M, ...; "
                        "a client cannot see it). An in-process profile reads it from the loaded model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    p.add_argument("--new-tokens", default="64,128,256,512", help="prefill: new tokens per point")
    p.add_argument("--cached-tokens", default="0,256,512", help="prefill: cached tokens (block multiples)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16", help="decode: sequences per step")
    p.add_argument("--context-lens", default="128,512", help="decode: context per sequence")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per point")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds over the grid, a point's time the median of its rounds: prefill points; "
                        "with --url the decode and mixed points too (time grows with it: "
                        "bench/validate_simulator.py's grid at 3 takes roughly a minute on 2 CPUs)")
    p.add_argument("--idle-gap", type=float, default=0.5,
                   help="with --url: seconds the server idles before each first-token-delay request, as between "
                        "requests at a moderate rate (the delay measured ~0.4 ms back to back, ~5 ms after 0.6 s)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice); with "
                   "several ranks, the budget the ranks split evenly")
    p.add_argument("--tensor-parallel-sizes", default="1", metavar="N[,N]",
                   help="fit the step at each of these tensor-parallel sizes (-tp), one fit per layout in the "
                        "JSON's 'layouts'; each layout runs on the same --threads budget split over its ranks. "
                        "A layout the model or host cannot run is skipped with one line saying why")
    p.add_argument("--pipeline-parallel-sizes", default="1", metavar="N[,N]",
                   help="fit the step at each of these pipeline-parallel sizes (-pp), crossed with "
                        "--tensor-parallel-sizes (in-process profile only)")
    moe = p.add_argument_group("mixture-of-experts models (in-process profile; the fits plan's AFD layouts use)")
    moe.add_argument("--moe-active-experts", default=None, metavar="N[,N]",
                     help="MoE step fit: active experts per point (default: 1, 4, 16, ... and every expert)")
    moe.add_argument("--moe-tokens-per-expert", default="1,4,16", metavar="N[,N]",
                     help="MoE step fit: tokens routed to each active expert per point")
    moe.add_argument("--afd-hop-tokens", default="1,16,64,256", metavar="N[,N]",
                     help="AFD hop fit: tokens of hidden state sent attention -> FFN -> attention between two "
                          "local processes per point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="profile.json", help="results JSON; the PNG goes next to it")
    p.set_defaults(func=cmd_profile)
    return p


def _int_list(text: str, flag: str, minimum: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        raise BenchError(f"{flag}: expected integers >= {minimum} separated by commas, got {text!r}")
    return sorted(set(values))


def cmd_profile(args: argparse.Namespace) -> int:
    try:
        return _run_profile(args)
    except BenchError as e:
        print(f"kvferry profile: error: {e}", file=sys.stderr)
        return 2


def _run_profile(args: argparse.Namespace) -> int:
    grid = ProfileGrid(
        new_tokens=_int_list(args.new_tokens, "--new-tokens", 1),
        cached_tokens=_int_list(args.cached_tokens, "--cached-tokens", 0),
        batch_sizes=_int_list(args.batch_sizes, "--batch-sizes", 1),
        context_lens=_int_list(args.context_lens, "--context-lens", 1),
        decode_steps=args.decode_steps, repeats=args.repeats, seed=args.seed, idle_gap_s=args.idle_gap)
    if any(c % args.block_size for c in grid.cached_tokens):
        raise BenchError(f"--cached-tokens: each must be a multiple of --block-size ({args.block_size})")
    if args.decode_steps < 1 or args.repeats < 1:
        raise BenchError("--decode-steps and --repeats must be >= 1")
    if not 0 <= args.idle_gap <= 60:  # NaN fails too; inf would never end
        raise BenchError(f"--idle-gap must be between 0 and 60 seconds, got {args.idle_gap}")
    if len(grid.new_tokens) * len(grid.cached_tokens) < 4 or len(grid.batch_sizes) * len(grid.context_lens) < 3:
        raise BenchError("need at least 4 prefill points and 3 decode points to fit")
    if args.threads is not None and args.threads < 1:
        raise BenchError(f"--threads must be >= 1, got {args.threads}")
    layouts = parse_layouts(args.tensor_parallel_sizes, args.pipeline_parallel_sizes)
    if args.url:
        if [lay.name for lay in layouts] != ["tp1pp1"]:
            raise BenchError("--tensor-parallel-sizes/--pipeline-parallel-sizes: a served profile measures the "
                             "server as it runs; profile each layout in-process, or each server with its own --url")
        if args.quantization is not None:
            raise BenchError("--quantization: a served profile measures the server as it runs (its own "
                             "--quantization); name its format with --weight-format")
        return _run_served_profile(args, grid)
    if args.weight_format is not None:
        raise BenchError("--weight-format names a served model's format (with --url); an in-process profile "
                         "reads it from the loaded model")
    # Lazy: torch and the engine load only when an in-process profile runs,
    # not for every kvferry command (~1.5 s).
    import torch

    from kvferry.engine.engine import LLMEngine
    from kvferry.model.weight_format import loaded_weight_format

    if args.threads:
        torch.set_num_threads(args.threads)
    cpus = torch.get_num_threads()  # the budget every layout splits over its ranks

    longest = max(max(grid.new_tokens) + max(grid.cached_tokens), max(grid.context_lens) + args.decode_steps + 2)

    formats: list[str] = []  # each measured layout's weight format (model/weight_format.py)
    moe_grid = _moe_grid(args)
    moe: dict = {}  # the MoE and hop fits, taken once on the first one-rank engine of an MoE model

    def make_engine(layout, threads: int):
        engine = _make_engine(layout, threads)
        if layout.ranks == 1 and not moe and engine.core.loaded.config.num_experts:
            from kvferry.bench.profile_moe import run_hop_profile, run_moe_profile  # lazy: torch

            loaded = engine.core.loaded
            moe["moe"] = run_moe_profile(loaded, moe_grid, _show_point)
            moe["afd_hop"] = run_hop_profile(loaded.config.hidden_size, loaded.dtype, moe_grid, _show_point)
        return engine

    def _make_engine(layout, threads: int):
        if layout.ranks == 1:
            torch.set_num_threads(threads)
        try:
            engine = LLMEngine.from_args(
                model=args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
                block_size=args.block_size, kv_cache_memory_gb=args.kv_cache_memory_gb,
                max_num_seqs=max(grid.batch_sizes), max_num_batched_tokens=max(2048, longest),
                enable_prefix_caching=True,
                tensor_parallel_size=layout.tensor_parallel_size,
                pipeline_parallel_size=layout.pipeline_parallel_size,
                cpu_threads_per_rank=threads if layout.ranks > 1 else None)
        except OSError as e:
            raise BenchError(f"--model: {e}") from None
        except ValueError as e:
            if layout.ranks == 1:  # the model itself: no layout to skip to
                raise BenchError(f"--model: {e}") from None
            raise
        if longest >= engine.max_model_len:
            engine.core.close()
            raise BenchError(f"the grid needs {longest + 1} tokens of context; the model has "
                             f"{engine.max_model_len}")
        formats.append(loaded_weight_format(engine.core.loaded, args.model))
        return engine

    measured, skipped = run_layout_profiles(make_engine, grid, layouts, cpus, _show_point)
    if not measured:
        raise BenchError("no layout could run: " + "; ".join(f"{s['name']}: {s['reason']}" for s in skipped))
    for layout in measured:
        misses = [p for p in layout["prefill"]["points"] if p["num_cached_tokens"] != p["cached"]]
        if misses:
            raise BenchError(f"prefix cache missed: {misses[0]['num_cached_tokens']} of {misses[0]['cached']} "
                             "cached tokens found (is the KV cache big enough?)")
    result = {k: measured[0][k] for k in ("prefill", "decode", "quality")}
    model_name = Path(args.model).name if args.model else "embedded default model"
    # Each layout's own (a .gguf the loader expands over ranks runs float there); the top level is the first's.
    for layout, fmt in zip(measured, formats):
        layout["weight_format"] = fmt
    data = {"model": model_name, "dtype": args.dtype, "weight_format": measured[0]["weight_format"],
            "device": args.device, "block_size": args.block_size, "threads": cpus,
            "grid": {k: getattr(grid, k) for k in grid.__slots__}, **result,
            "layouts": measured, "skipped_layouts": skipped, **moe}
    title = f"kvferry profile: {model_name} ({args.device}, {data['weight_format']})"
    _save_profile(args, data, title)
    for kind, label in (("moe", "MoE step (per layer)"), ("afd_hop", "AFD hop (round trip)")):
        if kind in data:
            f = data[kind]["fit"]
            print(f"{label} fit: " + " + ".join(f"{c * 1e6:.3g} us*{t}" for t, c in zip(f["terms"], f["coef"]))
                  + f"   (R^2 {f['r2']:.3f})")
    for line in layout_summary(measured, skipped) if len(layouts) > 1 else ():
        print(line)
    if plots := plot_layouts(measured, title, Path(args.output).with_suffix(".png")):
        print(f"wrote each layout's plot: {', '.join(str(p) for p in plots)}")
    return 0


def _moe_grid(args: argparse.Namespace):
    from kvferry.bench.profile_moe import MoEGrid  # lazy: torch

    return MoEGrid(None if args.moe_active_experts is None
                   else _int_list(args.moe_active_experts, "--moe-active-experts", 1),
                   _int_list(args.moe_tokens_per_expert, "--moe-tokens-per-expert", 1),
                   _int_list(args.afd_hop_tokens, "--afd-hop-tokens", 1), args.repeats)


def _show_point(kind: str, p: dict) -> None:
    if kind in ("moe", "hop"):
        where = (f"experts {p['experts']:>4} tokens/expert {p['tokens_per_expert']:>6.1f}" if kind == "moe"
                 else f"tokens {p['tokens']:>5} ({p['bytes']} bytes each way)")
        print(f"{kind:>7}: {where}: {1000 * p['time_s']:8.3f} ms", flush=True)
        return
    where = f"new {p['new']:>5} cached {p['cached']:>5}" if kind == "prefill" else \
        f"batch {p['batch']:>4} context {p['context']:>5}" + (f" + new {p['new']:>5}" if kind == "mixed" else "")
    print(f"{kind:>7}: {where}: {1000 * p['time_s']:8.2f} ms", flush=True)


def _save_profile(args: argparse.Namespace, data: dict, title: str) -> None:
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    png = out.with_suffix(".png")
    plot_profile(data, title, png)
    for kind in ("prefill", "decode"):
        f = data[kind]["fit"]
        terms = " + ".join(f"{c * 1e6:.3g} us*{t}" if t != "1" else f"{c * 1e6:.3g} us"
                           for t, c in zip(f["terms"], f["coef"]))
        print(f"{kind} fit: t = {terms}   (R^2 {f['r2']:.3f})")
    print(f"wrote {out}, {png}")


def _run_served_profile(args: argparse.Namespace, grid) -> int:
    # Lazy: httpx and rich (~100 ms) load only when a served profile runs.
    from kvferry.bench.profile_served import run_served_profile
    from kvferry.bench.run import resolve_target

    base, model = resolve_target(argparse.Namespace(url=args.url, api_key=None, model=args.model))
    result = run_served_profile(base, model, grid, _show_point)
    data = {"model": model, "served": base, "block_size": args.block_size,
            **({"weight_format": args.weight_format} if args.weight_format else {}),
            "grid": {k: getattr(grid, k) for k in grid.__slots__}, **result}
    _save_profile(args, data, f"kvferry profile: {model} served at {base}")
    print(f"first-token delay when the engine steps on: {1000 * result['first_token_delay_s']:.1f} ms; "
          f"mixed-step fit (1, batch, new): {result['mixed']['fit']['coef']}")
    print(f"request overhead (one-word TTFT less its engine step): {1000 * result['request_overhead_s']:.1f} ms; "
          f"hand-over (first -> second token, less a decode step): {1000 * result['handover_s']:.1f} ms")
    if sharing := result.get("host_sharing"):  # a server that does not mix: its cores overlap instead
        print(f"host sharing (step slowdown while the other core steps): prefill x{sharing['prefill']:.3f}, "
              f"decode x{sharing['decode']:.3f}")
    return 0


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="load-test an OpenAI-compatible server (goodput under SLOs)",
                              description="Load-test any OpenAI-compatible server; report latency, "
                                          "throughput and goodput under SLOs.",
                              usage="%(prog)s --url URL --workload WORKLOAD [options]\n"
                                    "       %(prog)s compare A.json B.json")
    _one_line(p, "kvferry bench")
    sub = p.add_subparsers(dest="bench_command", metavar="compare")
    cmp = sub.add_parser("compare", help="print two result files side by side with ratios",
                         prog="kvferry bench compare")  # not derived from the bench usage above
    _one_line(cmp, "kvferry bench compare")
    cmp.add_argument("a", metavar="A.json")
    cmp.add_argument("b", metavar="B.json")

    # Not argparse-required: `kvferry bench compare` takes neither (_validate checks them).
    req = p.add_argument_group("required (but for `compare`)")
    req.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    req.add_argument("--workload", choices=WORKLOADS, help="what to send (see the workloads group)")
    t = p.add_argument_group("target")
    t.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    t.add_argument("--model", default=None,
                   help="one of the models GET /v1/models lists (default: its first; another is an error)")
    t.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    t.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (a vLLM extension)")
    t.add_argument("--temperature", type=float, default=0.0)

    load = p.add_argument_group("load")
    mode = load.add_mutually_exclusive_group()
    mode.add_argument("--rate", "--request-rate", type=float, default=None,
                      help="sessions per second (default: all at once; trace: its own timestamps)")
    mode.add_argument("--concurrency", "--max-concurrency", type=int, default=None,
                      help="a fixed number of sessions in flight")
    mode.add_argument("--sweep", default=None, help="R1,R2,...: one run per rate; plots goodput vs rate")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier")
    load.add_argument("--num-requests", "--num-prompts", type=int, default=None,
                      help="default 100 (trace: its length); with --duration only: bounded by time")
    load.add_argument("--duration", type=float, default=None, help="seconds during which requests are sent")
    load.add_argument("--max-time", type=float, default=1800.0,
                      help="hard limit on a run's seconds; requests still running then count as failed")
    load.add_argument("--drain-timeout", type=float, default=60.0,
                      help="with --duration: seconds in-flight requests get after it")
    load.add_argument("--request-timeout", type=float, default=600.0)
    load.add_argument("--seed", type=int, default=0)

    w = p.add_argument_group("workloads")
    w.add_argument("--input-len", default="256", help="random: N or LO:HI tokens")
    w.add_argument("--output-len", default="64", help="max_tokens: N or LO:HI (all but trace)")
    w.add_argument("--num-groups", type=int, default=4, help="shared-prefix")
    w.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix")
    w.add_argument("--system-prompt-len", type=int, default=512, help="shared-prefix")
    w.add_argument("--question-len", type=int, default=64, help="shared-prefix, multi-tenant")
    w.add_argument("--max-turns", type=int, default=6, help="multi-turn: user turns per conversation")
    w.add_argument("--think-time", type=float, default=1.0, help="multi-turn: seconds between turns")
    w.add_argument("--corpus", default="auto", help="long-doc: auto | python3.11-doc | bible-kjv | DIR")
    w.add_argument("--doc-len", type=int, default=2048, help="long-doc: tokens per document (about)")
    w.add_argument("--num-docs", type=int, default=4, help="long-doc")
    w.add_argument("--questions-per-doc", type=int, default=4, help="long-doc")
    w.add_argument("--trace", default=None, help="trace: a Mooncake JSONL file (default: the shipped slice)")
    w.add_argument("--trace-block-size", type=int, default=512, help="trace: tokens per hash id")
    w.add_argument("--time-scale", type=float, default=1.0, help="trace: >1 replays faster")
    w.add_argument("--max-input-len", type=int, default=None,
                   help="trace: clip prompts to N tokens (default: to what the served context, max_model_len "
                        "of GET /v1/models, leaves beside the output; the run reports how many it clipped)")
    w.add_argument("--max-output-len", type=int, default=None, help="trace: clip outputs")
    w.add_argument("--tenant-keys", default=None,
                   help="multi-tenant: KEY1,KEY2,...; the last one floods (default tenant-0..2 + flood)")
    w.add_argument("--flood-factor", type=float, default=4.0, help="multi-tenant: the flooder's share")
    w.add_argument("--public-prefix-len", type=int, default=256, help="multi-tenant")
    w.add_argument("--private-prefix-len", type=int, default=256, help="multi-tenant")

    out = p.add_argument_group("output")
    out.add_argument("--slo", "--goodput", nargs="+", default=None, metavar="NAME:MS",
                     help="ttft:MS,tpot:MS[,itl:MS,e2e:MS] (commas or spaces): goodput counts requests "
                          "meeting all")
    out.add_argument("--price-per-hour", type=float, default=None, metavar="P",
                     help="the served fleet's price per hour (any currency unit): adds the cost per million "
                          "useful tokens, P * wall hours / output tokens of requests meeting --slo * 1e6")
    out.add_argument("--output", default=None, help="results JSON; PNG plots go next to it")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_bench)
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        if args.bench_command == "compare":
            print(compare_table(args.a, args.b))
            return 0
        return _run_bench(args)
    except BenchError as e:
        print(f"kvferry bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvferry bench: interrupted", file=sys.stderr)
        return 130


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise BenchError(f"--{name.replace('_', '-')} must be > 0, got {value}")


def _validate(args: argparse.Namespace) -> None:
    if not args.url:
        raise BenchError("--url is required (e.g. --url http://127.0.0.1:8000)")
    if not args.url.startswith(("http://", "https://")):
        raise BenchError(f"--url must start with http:// or https://, got {args.url!r}")
    if not args.workload:
        raise BenchError(f"--workload is required (one of {', '.join(WORKLOADS)})")
    _positive(args, "rate", "concurrency", "burstiness", "num_requests", "duration", "max_time",
              "drain_timeout", "request_timeout", "num_groups", "prompts_per_group", "system_prompt_len",
              "question_len", "max_turns", "doc_len", "num_docs", "questions_per_doc", "trace_block_size",
              "time_scale", "max_input_len", "max_output_len", "flood_factor", "public_prefix_len",
              "private_prefix_len")
    if args.think_time < 0:
        raise BenchError(f"--think-time must be >= 0, got {args.think_time}")
    if args.price_per_hour is not None and not (args.price_per_hour >= 0 and math.isfinite(args.price_per_hour)):
        raise BenchError(f"--price-per-hour must be a finite number >= 0, got {args.price_per_hour}")
    if args.temperature < 0:
        raise BenchError(f"--temperature must be >= 0, got {args.temperature}")


def _sweep_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise BenchError(f"--sweep: expected rates R1,R2,... > 0, got {text!r}")
    return sorted(rates)


def _run_bench(args: argparse.Namespace) -> int:
    # Lazy: httpx and rich (~100 ms) load only when bench runs.
    from kvferry.bench.run import clipped_trace_requests, make_workload, resolve_served, run_once

    _validate(args)
    try:
        slo = parse_slo(",".join(args.slo) if args.slo else None)
    except ValueError as e:
        raise BenchError(str(e)) from None
    rates = _sweep_rates(args.sweep) if args.sweep else [args.rate]
    make_workload(args)  # fail fast on a bad workload argument, before touching the server
    target = resolve_served(args)
    if clipped := clipped_trace_requests(args, target.max_model_len):
        context = (f"the served context (max_model_len {target.max_model_len}) with their outputs"
                   if target.max_model_len else "")
        limits = " and ".join(x for x in (context, args.max_input_len and f"--max-input-len {args.max_input_len}") if x)
        print(f"kvferry bench: {clipped} trace prompts clipped to fit {limits}", file=sys.stderr)
    results = []
    for rate in rates:
        results.append(run_once(args, target.base_url, target.model, rate, slo, target.max_model_len))
        if args.price_per_hour is not None:
            add_cost(results[-1]["summary"], args.price_per_hour)
        _print_summary(results[-1])
    _write_outputs(args, results)
    return 0


def _print_summary(result: dict) -> None:
    s, server = result["summary"], result.get("server") or {}
    rate = result["config"]["rate"]
    lines = [f"===== kvferry bench: {result['config']['workload']} @ "
             f"{'trace timestamps' if rate is None and result['config']['use_timestamps'] else rate or 'max'}"
             f"{' req/s' if isinstance(rate, float) else ''} =====",
             f"requests: {s['completed']} completed, {s['failed']} failed in {s['duration_s']:.1f} s"]
    for err, n in s["errors"].items():
        lines.append(f"  {n} x {err}")
    if clipped := result["config"].get("clipped_requests"):
        lines.append(f"clipped prompts: {clipped} (to fit max_model_len {result['config']['max_model_len']} "
                     "or --max-input-len)")
    lines.append(f"throughput: {s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output "
                 f"tok/s, {s['total_token_throughput']:.1f} total tok/s")
    if s["goodput"] is not None:
        slo = ", ".join(f"{k} <= {v:.0f} ms" for k, v in s["slo_ms"].items())
        lines.append(f"goodput: {s['goodput']:.2f} req/s ({s['slo_attainment_pct']:.1f}% meet {slo})")
    if s.get("price_per_hour") is not None:
        cost = s["cost_per_million_useful_tokens"]
        lines.append(f"cost: {'- (no useful tokens)' if cost is None else f'{cost:.4g}'} per million useful tokens "
                     f"({s['useful_output_tokens']} useful output tokens in {s['duration_s']:.1f} s at "
                     f"{s['price_per_hour']:g}/h)")
    for m in ("ttft", "tpot", "itl", "e2e"):
        st = s[f"{m}_ms"]
        if st["mean"] is not None:
            lines.append(f"{m.upper():>5} ms: mean {st['mean']:8.1f}  p50 {st['p50']:8.1f}  "
                         f"p90 {st['p90']:8.1f}  p99 {st['p99']:8.1f}")
    for tenant, t in (result.get("per_tenant") or {}).items():
        good = f", goodput {t['goodput']:.2f} req/s" if t["goodput"] is not None else ""
        p50 = t["ttft_ms"]["p50"]
        lines.append(f"  {tenant}: {t['completed']}/{t['num_requests']} ok, TTFT p50 "
                     f"{'-' if p50 is None else f'{p50:.0f} ms'}{good}")
    if server.get("prefix_cache_hit_rate") is not None:
        lines.append(f"prefix cache hit rate (server): {100 * server['prefix_cache_hit_rate']:.1f}%")
    print("\n".join(lines))


def _write_outputs(args: argparse.Namespace, results: list[dict]) -> None:
    if not args.output:
        return
    path = Path(args.output)
    data = results[0] if len(results) == 1 else {"sweep": results}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    except OSError as e:
        raise BenchError(f"--output: cannot write {path}: {e.strerror}") from None
    written = [path]
    if not args.no_plots:
        stem = path.with_suffix("")
        last = results[-1]
        records = [RequestRecord.from_json(r) for r in last["records"]]
        title = f"{args.workload} against {last['config']['model']}"
        rate = last["config"]["rate"]
        cdf_title = title + (f" at {rate:g} req/s" if rate else "")
        written.append(plot_latency_cdfs(records, last["summary"], cdf_title,
                                         Path(f"{stem}.latency_cdf.png")))
        if len(results) > 1:
            points = [{**r["summary"], "rate": r["config"]["rate"]} for r in results]
            written.append(plot_sweep(points, title, Path(f"{stem}.sweep.png")))
    print("wrote " + ", ".join(str(p) for p in written))
