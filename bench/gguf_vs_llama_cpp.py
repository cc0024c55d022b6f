"""Batch 1 on one GGUF file, side by side: kvferry (``--quantization gguf``,
the file's blocks; and ``--quantization none``, expanded) against llama.cpp's
``llama-server``, with the same prompts, the same thread count, one request
at a time, streamed through the openai client.

Per server: TTFT and TPOT p50 over the requests (TPOT: the time from the
first streamed token to the last, over the tokens after the first), output
tokens/s, and the RSS of the serving processes once the requests are done.
A short run for a shared machine; `vllm bench serve` (bench/vllm_bench_serve.sh)
is the client for the long ones.

    python bench/gguf_vs_llama_cpp.py [--model FILE.gguf] [--requests 8] [--output-len 64]

llama.cpp comes from bench/llama_cpp_build.sh (``$KVFERRY_LLAMA_CPP_BIN``);
without it only kvferry is measured.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama_cpp import llama_server, missing_reason  # noqa: E402
from _servers import served  # noqa: E402

WORDS = ("the river carried old stories past the mill while the town slept and the lamps burned low "
         "over quiet streets where nobody walked after the bells rang twice").split()


def prompt(i: int, words: int) -> str:
    """A distinct prompt of ``words`` words (no shared prefix beyond the first word: no prefix-cache help)."""
    return f"Story {i}: " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words))


def tree_rss_mb(pid: int) -> float:
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:")) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total


def run_batch1(base_url: str, model: str, prompts: list[str], output_len: int) -> dict[str, float]:
    ttft, tpot, tokens, wall = [], [], 0, 0.0
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as c:
        c.completions.create(model=model, prompt="warm up", max_tokens=4, temperature=0.0)
        for p in prompts:
            start = time.perf_counter()
            stamps, generated = [], None
            # Tokens are counted from the usage record, not the chunks: with
            # speculation one chunk carries every token a step accepted, so a
            # time per chunk is not a time per token.
            stream = c.completions.create(model=model, prompt=p, max_tokens=output_len, temperature=0.0,
                                          stream=True, extra_body={"ignore_eos": True},
                                          stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    stamps.append(time.perf_counter())
                if chunk.usage is not None:
                    generated = chunk.usage.completion_tokens
            wall += time.perf_counter() - start
            generated = generated or len(stamps)
            tokens += generated
            ttft.append(stamps[0] - start)
            if generated > 1:  # the first chunk is the prefill's one token
                tpot.append((stamps[-1] - stamps[0]) / (generated - 1))
    return {"ttft_p50_ms": 1e3 * statistics.median(ttft), "tpot_p50_ms": 1e3 * statistics.median(tpot),
            "output_tok_s": tokens / wall, "requests": len(prompts)}


def pid_on_port(url: str) -> int | None:
    """The pid listening on ``url``'s port (for llama-server's RSS), from /proc/net/tcp."""
    port = int(url.rsplit(":", 1)[1])
    inodes = {line.split()[9] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
              if int(line.split()[1].split(":")[1], 16) == port and line.split()[3] == "0A"}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                if os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes:
                    return int(d.name)
        except (PermissionError, FileNotFoundError, ProcessLookupError):
            continue
    return None


def main() -> None:
    from kvferry.model.gguf_convert import embedded_gguf_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a .gguf file (default: the embedded Q4_1 file)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--input-words", type=int, default=160, help="about 1.3 tokens a word")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=0.5)
    ap.add_argument("--skip-none", action="store_true", help="do not measure --quantization none")
    ap.add_argument("--speculative-config", default=None,
                    help="passed to kvferry as is ('off' compares plain decoding; default: kvferry's default)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gguf_vs_llama_cpp"))
    args = ap.parse_args()
    model = (args.model or embedded_gguf_path()).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = [prompt(i, args.input_words) for i in range(args.requests)]
    results: dict[str, dict[str, float]] = {}
    env_threads = {"OMP_NUM_THREADS": str(args.threads)}
    os.environ.update(env_threads)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    for quantization in ("gguf", *(() if args.skip_none else ("none",))):
        flags = ["--model", str(model), "--quantization", quantization, "--served-model-name", "m",
                 "--kv-cache-memory-gb", str(args.kv_cache_memory_gb), "--max-num-seqs", "16",
                 "--disable-uvicorn-access-log", "--log-level", "warning"]
        if args.speculative_config is not None:
            flags += ["--speculative-config", args.speculative_config]
        with served(flags, args.out / f"kvferry_{quantization}.log") as url:
            r = run_batch1(f"{url}/v1", "m", prompts, args.output_len)
            pid = pid_on_port(url)
            r["rss_mb"] = tree_rss_mb(pid) if pid else float("nan")
            results[f"kvferry --quantization {quantization}"] = r
        print(json.dumps({f"kvferry --quantization {quantization}": r}), flush=True)
    reason = missing_reason("llama-server")
    if reason is None:
        with llama_server(model, args.out / "llama_server.log", threads=args.threads, ctx=4096) as url:
            r = run_batch1(f"{url}/v1", "m", prompts, args.output_len)
            pid = pid_on_port(url)
            r["rss_mb"] = tree_rss_mb(pid) if pid else float("nan")
            results["llama.cpp llama-server"] = r
        print(json.dumps({"llama.cpp llama-server": r}), flush=True)
    else:
        print(f"skipping llama.cpp: {reason}")
    summary = {"model": str(model), "file_mb": model.stat().st_size / 2**20, "threads": args.threads,
               "loadavg_before": load, "results": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{model.name} ({summary['file_mb']:.0f} MB), {args.threads} threads, batch 1, "
          f"{args.requests} requests of ~{args.input_words} words in / {args.output_len} tokens out; load {load}")
    print(f"{'server':34} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'tok/s':>7} {'RSS MB':>8}")
    for name, r in results.items():
        print(f"{name:34} {r['ttft_p50_ms']:12.1f} {r['tpot_p50_ms']:12.1f} {r['output_tok_s']:7.1f} "
              f"{r['rss_mb']:8.0f}")


if __name__ == "__main__":
    main()
