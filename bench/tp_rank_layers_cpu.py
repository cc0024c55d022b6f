"""CPU time of one tensor-parallel rank's layers (``tp_decoder_layers``, the
one C++ call of a TP decode step) in one process, and what the allocator
costs in it (issue 47).

Rank 0's shard of TP 2 (``TPShard(0, 2)``: its half of the heads and of the
MLP) of the Llama-3.2-1B-shaped bf16 checkpoint of bench/tp_vs_vllm.py
(``--layers`` of its 16), one thread, decode steps of ``--batch`` sequences
of ``--context`` tokens each. The sums go through a ShmSums of one rank
(the same copy into the slot and the same sum loop, no peer to wait for),
so what is timed is the rank's own work: no scheduler and no other rank.
Prints the thread's CPU time per call (median, min over ``--calls``) and
its minor page faults per call, with the load average.

Where the allocator's time goes: run it under perf, the loading left out:

    perf record -D 15000 -F 1999 -e cpu-clock:u -o rank.data \
        python bench/tp_rank_layers_cpu.py --batch 16 --calls 400
    perf report -i rank.data --sort sym -n

    python bench/tp_rank_layers_cpu.py [--layers 4] [--batch 1 16] [--calls 200]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer_models import LLAMA_1B, random_checkpoint  # noqa: E402


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def decode_meta(batch: int, context: int, block_size: int, num_blocks: int):  # noqa: ANN201
    """A decode step of ``batch`` sequences, each at position ``context``,
    over disjoint scattered blocks."""
    import torch

    from kvferry.model.attention import AttentionMetadata

    per_seq = -(-(context + 1) // block_size)
    assert batch * per_seq < num_blocks
    ids = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0))[: batch * per_seq] + 1
    tables = ids.view(batch, per_seq)
    slots = tables[:, context // block_size] * block_size + context % block_size
    meta = AttentionMetadata(query_start_loc=list(range(batch + 1)), seq_lens=[context + 1] * batch,
                             slot_mapping=slots.clone(), block_tables=tables.clone(), block_size=block_size,
                             num_prefills=0)
    meta.prepare()
    return meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from kvferry.model import layer_op
    from kvferry.model.layers.parallel import TPShard
    from kvferry.model.loader import load_model

    path = random_checkpoint("llama-1b", LLAMA_1B)
    model = load_model(str(path), dtype="bfloat16", shard=TPShard(0, 2)).model
    del model.layers[args.layers:]
    model.config.num_hidden_layers = args.layers
    model.pack_weights()
    assert layer_op.available() and model._layer_args is not None, "the layer op does not apply here"
    stack = layer_op.layer_stack(model._layer_args)
    slot_bytes = 1 << 20
    sums = torch.classes.kvferry_layer.ShmSums(torch.zeros(2, dtype=torch.int64),
                                               torch.zeros(2 * slot_bytes, dtype=torch.uint8), 0, slot_bytes,
                                               [os.getpid()], 60.0)
    c, block_size, num_blocks = model.config, 16, 512
    kv = torch.zeros(args.layers, 2, num_blocks, block_size, model.num_kv_heads, c.head_dim, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {loadavg()} before; rank 0 of TP 2, "
          f"{args.layers} layers, bf16, 1 thread, context {args.context}, {args.calls} rounds")
    for batch in args.batch:
        meta = decode_meta(batch, args.context, block_size, num_blocks)
        positions = torch.full((batch,), args.context, dtype=torch.int64)
        cos, sin = model.rotary.rows(positions, model.dtype)
        h = torch.randn(batch, c.hidden_size, generator=gen).to(torch.bfloat16)
        x = model.layers[0].input_layernorm(h)

        step = (stack, sums, h, x, cos, sin, kv, meta)
        for _ in range(3):
            layer_op.run_tp_layers(*step)
        times, faults = [], 0
        for _ in range(args.calls):
            f0, t0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time()
            layer_op.run_tp_layers(*step)
            times.append(time.thread_time() - t0)
            faults += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
        print(f"batch {batch:3d}: CPU median {1000 * statistics.median(times):7.3f} ms  min {1000 * min(times):7.3f} ms "
              f"a call; page faults {faults / args.calls:.1f} a call")
    print(f"# load {loadavg()} after")


if __name__ == "__main__":
    main()
