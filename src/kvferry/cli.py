"""kvferry command line: serve | demo."""
from __future__ import annotations

import argparse
import sys


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options, named after vLLM's flags."""
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=0, help="0: the model's context length")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from kvferry import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    questions = args.prompt or ["What is the capital of France?", "Write a haiku about the sea."]
    for q, out in zip(questions, llm.chat([[{"role": "user", "content": q}] for q in questions], params)):
        print(f"### {q}\n{out.text.strip()}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate text from the embedded default model")
    add_engine_args(demo)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("prompt", nargs="*")
    demo.set_defaults(func=cmd_demo)
    from kvferry.serve.cli import add_serve_parser  # light: heavy imports happen when serve runs

    add_serve_parser(sub, add_engine_args, engine_kwargs)
    from kvferry.bench.cli import add_bench_parsers  # bench, profile; light: tools load when they run
    add_bench_parsers(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
