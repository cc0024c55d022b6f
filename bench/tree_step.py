"""A verify step's forward pass, path against tree, in CPU time: the
target's forward over root + k tokens at a fixed context, batch 1, on the
embedded SmolLM2-135M (or ``--model``).

Variants, interleaved rep by rep (so machine noise hits all alike), each
the same step again over the same slots:

- ``path``: a chain of k drafts, the one-call C++ decoder layer;
- ``tree-python``: a tree of k drafts through the Python layer loop
  (``KVFERRY_DISABLE_LAYER_OP=1`` for that step: the path tree steps took
  before the layer op took tree masks);
- ``tree-fused``: the same tree through the one-call layer
  (``paged_attention_tree`` inside it).

Each time covers building the step's attention metadata and the forward
(the LM head is the same for all three and left out). Reports the median
CPU ms of each and its ratio to ``path``.

    python bench/tree_step.py [--context 300] [--parents -1 -1 0 0] [--reps 200] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvferry.model.attention import AttentionMetadata
from kvferry.model.loader import load_model
from kvferry.spec.tree import ancestor_mask, depths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=300, help="cached tokens before the root")
    ap.add_argument("--parents", type=int, nargs="+", default=[-1, -1, 0, 0],
                    help="the tree's drafts' parents (-1: the root); the path has as many drafts")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype).model
    c = model.config
    block_size, ctx, k = 16, args.context, len(args.parents)
    blocks = -(-(ctx + k + 1) // block_size)
    kv = torch.zeros(c.num_hidden_layers, 2, blocks + 1, block_size, c.num_key_value_heads, c.head_dim,
                     dtype=model.dtype)
    table = torch.arange(1, blocks + 1, dtype=torch.int64)[None]  # block 0 unused
    ids = torch.randint(100, c.vocab_size, (ctx + k + 1,), generator=torch.Generator().manual_seed(0))

    def step(start: int, n: int, parents: list[int] | None) -> None:
        pos = list(range(start, start + n))
        if parents is not None:
            pos = [start] + [start + d for d in depths(parents)]
        meta = AttentionMetadata(
            query_start_loc=[0, n], seq_lens=[start + n], block_tables=table, block_size=block_size,
            slot_mapping=torch.tensor([table[0, p // block_size] * block_size + p % block_size
                                       for p in range(start, start + n)]),
            num_prefills=int(n > 1),
            tree_masks=None if parents is None else {0: torch.from_numpy(ancestor_mask(parents))})
        model.forward(ids[start:start + n], torch.tensor(pos), kv, meta)

    variants = {"path": ("0", None), "tree-python": ("1", args.parents), "tree-fused": ("0", args.parents)}
    with torch.no_grad():
        os.environ["KVFERRY_DISABLE_LAYER_OP"] = "0"
        step(0, ctx, None)  # the context, cached once
        for name, (off, parents) in variants.items():  # first calls' one-time costs
            os.environ["KVFERRY_DISABLE_LAYER_OP"] = off
            step(ctx, k + 1, parents)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.reps):
            for name, (off, parents) in variants.items():
                os.environ["KVFERRY_DISABLE_LAYER_OP"] = off
                t0 = time.process_time()
                step(ctx, k + 1, parents)
                times[name].append(time.process_time() - t0)
    os.environ.pop("KVFERRY_DISABLE_LAYER_OP")
    path = statistics.median(times["path"])
    result = {"context": ctx, "parents": args.parents, "reps": args.reps, "threads": args.threads,
              "dtype": args.dtype, "load_average": [round(x, 2) for x in os.getloadavg()]}
    for name, ts in times.items():
        med = statistics.median(ts)
        result[name] = {"cpu_ms": round(med * 1e3, 3), "x_path": round(med / path, 3)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
