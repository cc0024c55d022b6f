"""CPU time of batch-1 decode layers with small_gemm's packed weights on
4 KiB pages against 2 MiB pages (linear.py's on_huge_pages), in one process,
the two alternating: a TP 2 rank's shard (``--shard``, its sums through a
one-rank ShmSums, as bench/tp_rank_layers_cpu.py) or the whole model, of
the 1B-shaped bf16 checkpoint of bench/tp_vs_vllm.py (``--layers`` of its
16). Both copies hold the same bytes: the outputs are checked equal.

    python bench/packed_huge_pages_ab.py [--layers 8] [--rounds 30] [--shard] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer_models import LLAMA_1B, random_checkpoint  # noqa: E402
from tp_rank_layers_cpu import decode_meta, loadavg  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--shard", action="store_true", help="rank 0 of TP 2's shard (else the whole model)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=300)
    args = p.parse_args()
    import torch

    from kvferry.model import layer_op, linear
    from kvferry.model.layers.parallel import TPShard
    from kvferry.model.loader import load_model

    torch.set_num_threads(args.threads)
    path = random_checkpoint("llama-1b", LLAMA_1B)

    def model(min_bytes: int):  # noqa: ANN202
        linear.HUGE_PAGE_MIN_BYTES = min_bytes
        m = load_model(str(path), dtype="bfloat16", shard=TPShard(0, 2) if args.shard else None).model
        del m.layers[args.layers:]
        m.config.num_hidden_layers = args.layers
        m.pack_weights()
        return m

    small_pages, huge = model(1 << 62), model(4 << 20)
    assert layer_op.available() and huge._layer_args is not None, "the layer op does not apply here"
    slot = 1 << 20
    sums = torch.classes.kvferry_layer.ShmSums(torch.zeros(2, dtype=torch.int64), torch.zeros(2 * slot, dtype=torch.uint8),
                                               0, slot, [os.getpid()], 60.0)
    c, block_size, num_blocks = huge.config, 16, 512
    meta = decode_meta(1, args.context, block_size, num_blocks)
    cos, sin = huge.rotary.rows(torch.full((1,), args.context), huge.dtype)
    h = torch.randn(1, c.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x = huge.layers[0].input_layernorm(h)

    def call(m):  # noqa: ANN001, ANN202
        stack = layer_op.layer_stack(m._layer_args)
        kv = torch.zeros(args.layers, 2, num_blocks, block_size, m.num_kv_heads, c.head_dim, dtype=torch.bfloat16)
        if args.shard:
            return lambda: layer_op.run_tp_layers(stack, sums, h, x, cos, sin, kv, meta)
        return lambda: layer_op.run_layers(stack, h, x, cos, sin, kv, meta)

    cases = {"4 KiB pages": call(small_pages), "2 MiB pages": call(huge)}
    outs = [f() for f in cases.values()]
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1], strict=True)), "not the same bits"
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in cases}
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {loadavg()} before; "
          f"{'rank 0 of TP 2' if args.shard else 'whole model'}, {args.layers} layers, bf16, batch 1, "
          f"{args.threads} thread(s), {args.rounds} rounds of 2 calls each", flush=True)
    for _ in range(args.rounds):
        for name, fn in cases.items():
            for _ in range(2):
                w, cpu = time.perf_counter(), time.process_time()
                fn()
                times[name][0].append(time.perf_counter() - w)
                times[name][1].append(time.process_time() - cpu)
    base = statistics.median(times["4 KiB pages"][1])
    for name, (wall, cpu) in times.items():
        print(f"{name}: CPU median {1e3 * statistics.median(cpu):7.2f} ms ({statistics.median(cpu) / base:.2f}x) "
              f"min {1e3 * min(cpu):7.2f} ms; wall median {1e3 * statistics.median(wall):7.2f} ms "
              f"min {1e3 * min(wall):7.2f} ms")
    print(f"# load {loadavg()} after")


if __name__ == "__main__":
    main()
