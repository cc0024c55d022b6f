"""Offline throughput on a CUDA GPU: kvferry (Triton attention, with and
without CUDA graphs) against HF transformers ``generate`` on the same GPU, in
one process, interleaved run by run.

No model can be downloaded, so the checkpoints are random-weight Llamas of
real shapes, written in bf16 with ``transformers``: SmolLM2-135M's (30 layers,
576 hidden, 9 heads / 3 KV heads) and Llama-3.2-1B's (16 layers, 2048
hidden, 32 / 8 heads, 128k vocabulary). Greedy, ``ignore_eos``: random
weights produce tokens as fast as real ones. Each system is warmed up before
it is timed (Triton's compiles, kvferry's CUDA graphs captured at start-up,
HF's first generate), in every run. Workloads: the CPU benchmark's
(32 requests, prompts of 128-512 tokens, 128 output tokens) and the same at
256 requests.

    python bench/gpu_offline.py [--runs 3] [--models smollm2-135m llama-1b] \
        [--requests 32 256] [--budget-s 300] [--json out.json]

Each result line is printed as it comes (and the JSON rewritten), so a run
cut short by ``--budget-s`` keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.tiny_models

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
}


def make_checkpoint(folder: Path, shape: str) -> str:
    import transformers as tf

    from tests.tiny_models import write_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder)
    config = tf.LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, rms_norm_eps=1e-5,
                            bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return str(folder)


def make_prompts(vocab: int, num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(128, 512))] for _ in range(num)]


def run_kvferry(path: str, prompts: list[list[int]], output_len: int, profile: str | None = None,
                **engine) -> dict:
    from kvferry import LLM, SamplingParams

    llm = LLM(model=path, dtype="bfloat16", device="cuda", max_num_seqs=len(prompts),
              max_num_batched_tokens=8192, kv_cache_memory_gb=16, max_model_len=1024, **engine)
    # Warm-up: Triton compiles, the allocators (device and pinned host) fill.
    llm.generate([p[:64] for p in prompts[:16]], SamplingParams(max_tokens=8, temperature=0.0))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    if profiler is not None:
        import pstats

        profiler.disable()
        with open(profile, "w") as f:
            f.write(f"{len(prompts)} requests, {elapsed:.3f} s (under cProfile)\n")
            stats = pstats.Stats(profiler, stream=f).sort_stats("tottime")
            stats.print_stats(40)
            stats.sort_stats("cumulative").print_stats(40)
    graphs = llm.engine.core.runner.graphs
    captured = {"graph_replays": graphs.replays} if graphs is not None else {}
    del llm
    torch.cuda.empty_cache()
    return {"elapsed": elapsed, "output_tokens": sum(len(o.token_ids) for o in outs), "graphs": captured}


def run_hf(path: str, prompts: list[list[int]], output_len: int, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():  # warm-up: cuBLAS handles, the allocator
        model.generate(torch.tensor([prompts[0][:16]], device="cuda"), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    produced = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
            out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, pad_token_id=0)
            produced += (out.shape[1] - width) * len(batch)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return {"elapsed": elapsed, "output_tokens": produced}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--requests", nargs="+", type=int, default=[32, 256])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting new measurements after this")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="only profile kvferry's host side: one cProfile'd run per model and request count "
                        "(FILE gets a suffix each), no timing table")
    args = p.parse_args()
    start = time.perf_counter()
    import triton

    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": []}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))

    systems = {
        "kvferry": lambda path, pr: run_kvferry(path, pr, args.output_len),
        "kvferry_eager": lambda path, pr: run_kvferry(path, pr, args.output_len, enforce_eager=True),
        "hf": lambda path, pr: run_hf(path, pr, args.output_len, args.hf_batch_size),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.models:
            path = make_checkpoint(Path(tmp) / shape, shape)
            for num in args.requests:
                prompts = make_prompts(SHAPES[shape]["vocab_size"], num)
                if args.profile:
                    out = f"{args.profile}.{shape}.{num}.txt"
                    r = run_kvferry(path, prompts, args.output_len, profile=out)
                    print(f"{shape} n={num}: profile in {out} ({r['output_tokens'] / r['elapsed']:.0f} tok/s "
                          f"under the profiler)", flush=True)
                    continue
                rates: dict[str, list[float]] = {s: [] for s in systems}
                for run in range(args.runs):
                    for name, fn in systems.items():
                        if time.perf_counter() - start > args.budget_s:
                            report["cut_short"] = True
                            continue
                        r = fn(path, prompts)
                        rate = r["output_tokens"] / r["elapsed"]
                        rates[name].append(rate)
                        print(f"{shape} n={num} run {run} {name}: {rate:.0f} tok/s "
                              f"({r['output_tokens']} tokens in {r['elapsed']:.2f} s) {r.get('graphs', '')}",
                              flush=True)
                entry = {"model": shape, "requests": num,
                         **{f"median_{s}_tok_s": round(statistics.median(v), 1) for s, v in rates.items() if v}}
                for s in ("kvferry_eager", "hf"):
                    pairs = list(zip(rates["kvferry"], rates[s]))
                    if pairs:
                        entry[f"ratio_kvferry_over_{s}"] = round(statistics.median(a / b for a, b in pairs), 2)
                report["results"].append(entry)
                print(json.dumps(entry), flush=True)
                save()
    save()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
