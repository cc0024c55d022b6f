"""Speculation by default against ``--speculative-config off``, with vLLM's
own client (``vllm bench serve``, which we do not write), side by side in one
run.

Two ``kvferry serve`` configurations, the same model, dtype and threads:
``default`` (no --speculative-config: auto under the cost-aware controller)
and ``off``. Each case runs against both, ``--runs`` times, the order of the
two alternating from run to run (a loaded machine drifts: alternation
spreads the drift over both). A server is started afresh for each run, so
that the default starts cold, as a new deployment does: its controller
measures each batch size's levels and its suffix tries start empty.

Cases (``--cases``, TASK:CONCURRENCY):

- ``chat``: held-out chitchat-dataset conversations (the ones no draft head
  was trained on), chat template applied here;
- ``code``: "add type hints and a docstring" to a function of the Python
  standard library (the answer re-emits the code: the case suffix decoding
  and prompt lookup are for);
- ``random``: ``vllm bench serve``'s random token prompts (nothing to look up).

Targets (issue 49): default / off >= 1.3x output tok/s at c1 on chat and
code, >= 0.98x at c16 and c64, p99 TTFT and TPOT no worse.

    python bench/spec_default.py [--vllm /work/vllm-venv/bin/vllm] [--runs 2]
        [--cases chat:1 code:1 chat:16 chat:64 random:16 random:64] [--output-len 128]

The load average is printed before and after (and saved): compare ratios
only from a quiet machine.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import served  # noqa: E402

CONFIGS = {"default": [], "off": ["--speculative-config", "off"]}
CODE_FUNCTIONS = ["textwrap.dedent", "textwrap.indent", "shlex.quote", "shlex.join", "fnmatch.translate",
                  "shutil.copyfileobj", "textwrap.shorten", "base64.b64encode", "calendar.isleap", "calendar.leapdays",
                  "colorsys.rgb_to_hsv", "colorsys.hsv_to_rgb", "heapq.nsmallest", "shutil.which",
                  "statistics.median", "statistics.mode", "json.dumps", "glob.escape", "string.capwords",
                  "difflib.get_close_matches"]
METRICS = [("output_throughput", "output tok/s", "higher"), ("p50_tpot_ms", "TPOT p50 ms", "lower"),
           ("p99_tpot_ms", "TPOT p99 ms", "lower"), ("p99_ttft_ms", "TTFT p99 ms", "lower")]


def chat_prompts(tokenizer, num: int) -> list[str]:  # noqa: ANN001
    from kvferry.train.draft_head import held_out_chats

    return [tokenizer.apply_chat_template(conv, add_generation_prompt=True) for conv in held_out_chats(num)]


def code_prompts(tokenizer, num: int) -> list[str]:  # noqa: ANN001
    import importlib

    prompts = []
    for name in (CODE_FUNCTIONS * (num // len(CODE_FUNCTIONS) + 1))[:num]:
        module, func = name.rsplit(".", 1)
        source = inspect.getsource(getattr(importlib.import_module(module), func))
        conv = [{"role": "user", "content": "Rewrite this Python function with type hints and a short docstring; "
                                            f"keep its body as it is.\n\n```python\n{source}```"}]
        prompts.append(tokenizer.apply_chat_template(conv, add_generation_prompt=True))
    return prompts


def write_dataset(path: Path, prompts: list[str]) -> None:
    """ShareGPT's layout, which ``vllm bench serve`` reads with json alone
    (its "custom" jsonl needs pandas): the first turn is the prompt as sent,
    chat template applied; the reply is unused (``--sharegpt-output-len``)."""
    rows = [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "-"}]} for p in prompts]
    path.write_text(json.dumps(rows))


def num_prompts(task: str, concurrency: int, args: argparse.Namespace) -> int:
    if args.num_prompts:
        return args.num_prompts
    return args.c1_prompts if concurrency == 1 else args.prompts_per_slot * concurrency


def bench(args: argparse.Namespace, url: str, model_dir: str, datasets: dict[str, Path], task: str, c: int,
          result: Path) -> None:
    n = num_prompts(task, c, args)
    cmd = [args.vllm, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", "smollm2", "--tokenizer", model_dir, "--ignore-eos", "--num-prompts", str(n),
           "--max-concurrency", str(c), "--seed", str(c), "--temperature", str(args.temperature),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    if task == "random":
        cmd += ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", str(args.output_len)]
    else:
        cmd += ["--dataset-name", "sharegpt", "--dataset-path", str(datasets[task]),
                "--sharegpt-output-len", str(args.output_len), "--disable-shuffle"]
    with open(result.with_suffix(".txt"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)


def summarize(out: Path, cases: list[tuple[str, int]]) -> str:
    """One row per case and metric: each side's median, and each side's
    median over off's (every side but off, in CONFIGS' order)."""
    sides = [cfg for cfg in CONFIGS if cfg != "off"]
    lines = ["| case | metric | " + " | ".join(sides) + " | off | " + " | ".join(f"{s} / off" for s in sides)
             + " | runs (" + " / ".join(sides) + " / off) |",
             "|---|---|" + "---|" * (2 * len(sides) + 2)]
    for task, c in cases:
        rows = {cfg: [json.loads(p.read_text()) for p in sorted(out.glob(f"{cfg}_{task}_c{c}_run*.json"))]
                for cfg in CONFIGS}
        for key, label, _ in METRICS:
            values = {cfg: [r[key] for r in rows[cfg] if key in r] for cfg in CONFIGS}
            if not all(values.values()):
                continue
            med = {cfg: statistics.median(v) for cfg, v in values.items()}
            ratios = [f"{med[s] / med['off'] if med['off'] else float('inf'):.2f}x" for s in sides]
            each = " / ".join(", ".join(f"{x:.3g}" for x in values[cfg]) for cfg in [*sides, "off"])
            lines.append(f"| {task} c{c} | {label} | " + " | ".join(f"{med[s]:.3g}" for s in sides)
                         + f" | {med['off']:.3g} | " + " | ".join(ratios) + f" | {each} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm", default="/work/vllm-venv/bin/vllm", help="the vllm CLI (its own venv)")
    p.add_argument("--cases", nargs="+", default=["chat:1", "code:1", "chat:16", "chat:64", "random:16", "random:64"])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=0,
                   help="per case (0: --c1-prompts at c1, else --prompts-per-slot x concurrency)")
    p.add_argument("--c1-prompts", type=int, default=8)
    p.add_argument("--prompts-per-slot", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of the server (0: leave it)")
    p.add_argument("--default-config", default=None,
                   help="run this --speculative-config JSON as the 'default' side (e.g. the default with "
                        "draft trees: '{\"method\": \"auto\", \"draft_tree\": true}'); unset: no flag")
    p.add_argument("--compare", nargs="*", default=[], metavar="NAME=JSON",
                   help="more sides, each a --speculative-config JSON run as NAME in the same runs (e.g. "
                        "the default with paths: 'paths={\"method\": \"auto\", \"model\": HEAD}')")
    p.add_argument("--out", default="bench/results/spec_default")
    args = p.parse_args()
    if args.default_config:
        CONFIGS["default"] = ["--speculative-config", args.default_config]
    for side in args.compare:
        name, _, config = side.partition("=")
        if not name or not config or name in CONFIGS:
            p.error(f"--compare {side!r}: NAME=JSON, NAME other than {', '.join(CONFIGS)}")
        CONFIGS[name] = ["--speculative-config", config]
    CONFIGS["off"] = CONFIGS.pop("off")  # the sides in turn, then off (reversed on even runs)
    # SIGTERM unwinds (the servers' ``with`` blocks stop them) rather than orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cases = [(t, int(c)) for t, c in (case.split(":") for case in args.cases)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*_c*_run*.*"):  # an earlier invocation's runs would join this one's medians
        old.unlink()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    from kvferry.model.loader import load_model

    loaded = load_model(None)
    model_dir, tokenizer = loaded.model_path, loaded.tokenizer
    most = max((num_prompts(t, c, args) for t, c in cases), default=8)
    datasets = {"chat": out / "chat.json", "code": out / "code.json"}
    write_dataset(datasets["chat"], chat_prompts(tokenizer, most))
    write_dataset(datasets["code"], code_prompts(tokenizer, most))
    del loaded
    # No --model: the embedded default model (the same folder), as a bare
    # `kvferry serve` runs it, so the default has its committed head too.
    flags = ["--dtype", args.dtype, "--served-model-name", "smollm2", "--disable-uvicorn-access-log"]
    load = {"start": os.getloadavg()}
    print(f"load average at start: {load['start']}", flush=True)
    for run in range(1, args.runs + 1):
        order = list(CONFIGS) if run % 2 else list(reversed(CONFIGS))  # run 1 default first, run 2 off first
        for cfg in order:
            with served(flags + CONFIGS[cfg], out / f"{cfg}_server_run{run}.log") as url:
                for task, c in cases:
                    start = time.monotonic()
                    bench(args, url, model_dir, datasets, task, c, out / f"{cfg}_{task}_c{c}_run{run}.json")
                    print(f"run {run} {cfg} {task} c{c}: {time.monotonic() - start:.0f} s, "
                          f"load {os.getloadavg()[0]:.2f}", flush=True)
    load["end"] = os.getloadavg()
    (out / "load_average.json").write_text(json.dumps(load))
    print(f"load average at end: {load['end']}")
    table = summarize(out, cases)
    (out / "summary.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
