"""What an fp8 KV cache costs in output quality, against the model's own dtype.

Each document is read teacher-forced through the engine's model in chunks of
``--chunk`` tokens over the paged cache (the C++ kernel reads every K/V row
from the cache, the chunk's own included, as a decode step does), once with
the cache in the model's dtype and once in each fp8 format of
``--kv-cache-dtypes``. Per position it compares the next-token
distributions: top-1 agreement, KL(exact || fp8), and each run's perplexity
of the document's actual next tokens. A greedy continuation of each
document's first ``--prompt-tokens`` tokens also gives the first position
where an fp8 cache's output differs from the exact one's.

    python bench/kv_cache_fp8_quality.py --docs 8 --tokens 1024 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch

from kvferry.bench.corpus import load_documents
from kvferry.model.attention import AttentionMetadata
from kvferry.model.cpu_features import cpu_features
from kvferry.model.kv_cache_dtype import resolve_kv_cache_dtype
from kvferry.model.llama import allocate_kv_cache
from kvferry.model.loader import load_model


class PagedReader:
    """One sequence through LlamaModel.forward over a paged cache of ``cache_dtype``."""

    def __init__(self, model, length: int, cache_dtype: torch.dtype, block_size: int = 16, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        num_blocks = -(-length // block_size) + 1
        self.kv = allocate_kv_cache(model.config, num_blocks, block_size, cache_dtype)
        table = list(range(num_blocks))
        random.Random(seed).shuffle(table)  # scattered blocks, as in a served pool
        self.table = table
        self.computed = 0

    def step(self, ids: list[int]) -> torch.Tensor:
        """Feed ``ids`` after what was fed so far; float32 logits [len(ids), vocab]."""
        start, end = self.computed, self.computed + len(ids)
        bs = self.block_size
        slots = [self.table[p // bs] * bs + p % bs for p in range(start, end)]
        bt = torch.tensor([self.table[: -(-end // bs)]], dtype=torch.int64)
        meta = AttentionMetadata(query_start_loc=[0, len(ids)], seq_lens=[end], slot_mapping=torch.tensor(slots),
                                 block_tables=bt, block_size=bs, num_prefills=int(len(ids) > 1),
                                 kv_dtype=self.kv.dtype)
        hidden = self.model.forward(torch.tensor(ids), torch.arange(start, end), self.kv, meta)
        self.computed = end
        return self.model.compute_logits(hidden).float()


@torch.inference_mode()
def teacher_forced(model, tokens: list[int], cache_dtype: torch.dtype, chunk: int) -> torch.Tensor:
    reader = PagedReader(model, len(tokens), cache_dtype)
    return torch.cat([reader.step(tokens[i:i + chunk]) for i in range(0, len(tokens), chunk)])


@torch.inference_mode()
def greedy(model, prompt: list[int], new_tokens: int, cache_dtype: torch.dtype) -> list[int]:
    reader = PagedReader(model, len(prompt) + new_tokens, cache_dtype)
    out = [int(reader.step(prompt)[-1].argmax())]
    for _ in range(new_tokens - 1):
        out.append(int(reader.step(out[-1:])[-1].argmax()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024, help="tokens read per document")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--corpus", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["fp8_e4m3", "fp8_e5m2"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype)
    model, tok = loaded.model, loaded.tokenizer
    docs = load_documents(args.corpus, args.docs, min_chars=8 * args.tokens, seed=0)
    formats = {name: resolve_kv_cache_dtype(name, model.dtype, torch.device("cpu"), False)
               for name in args.kv_cache_dtypes}
    rows: dict[str, list[dict]] = {name: [] for name in formats}
    t0 = time.time()
    for d, doc in enumerate(docs):
        tokens = tok.encode(doc)[: args.tokens + 1]
        exact = teacher_forced(model, tokens[:-1], model.dtype, args.chunk)
        target = torch.tensor(tokens[1:])
        lp_exact = exact.log_softmax(-1)
        prompt = tokens[: args.prompt_tokens]
        g_exact = greedy(model, prompt, args.new_tokens, model.dtype)
        for name, fp8 in formats.items():
            quant = teacher_forced(model, tokens[:-1], fp8, args.chunk)
            lp_quant = quant.log_softmax(-1)
            kl = (lp_exact.exp() * (lp_exact - lp_quant)).sum(-1)
            g_quant = greedy(model, prompt, args.new_tokens, fp8)
            first_diff = next((i for i, (a, b) in enumerate(zip(g_exact, g_quant)) if a != b), args.new_tokens)
            rows[name].append(dict(
                kv_cache_dtype=name, doc=d, tokens=len(target),
                top1_agreement=float((exact.argmax(-1) == quant.argmax(-1)).float().mean()),
                mean_kl=float(kl.mean()), p99_kl=float(kl.quantile(0.99)),
                ppl_exact=math.exp(float(-lp_exact.gather(1, target[:, None]).mean())),
                ppl_fp8=math.exp(float(-lp_quant.gather(1, target[:, None]).mean())),
                greedy_first_difference=first_diff,
            ))
            print(json.dumps(rows[name][-1]), flush=True)

    def summary(rs: list[dict]) -> dict:
        def med(key: str) -> float:
            return statistics.median(r[key] for r in rs)
        return dict(
            median_top1_agreement=med("top1_agreement"), median_mean_kl=med("mean_kl"), median_p99_kl=med("p99_kl"),
            median_ppl_ratio=statistics.median(r["ppl_fp8"] / r["ppl_exact"] for r in rs),
            median_greedy_first_difference=med("greedy_first_difference"),
            greedy_identical=sum(r["greedy_first_difference"] == args.new_tokens for r in rs),
        )

    print(json.dumps(dict(
        cpu=cpu_features().describe(),
        model=loaded.model_path, dtype=args.dtype, docs=len(docs), tokens_per_doc=args.tokens, chunk=args.chunk,
        threads=args.threads, seconds=round(time.time() - t0, 1),
        formats={name: summary(rs) for name, rs in rows.items()},
    ), indent=2))


if __name__ == "__main__":
    main()
