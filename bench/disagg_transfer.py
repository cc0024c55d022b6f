"""KV transfer throughput for one request, against an in-process memcpy of
the same bytes measured in the same run (interleaved, best of N).

A receiver process (a decode core's ``KVReceiver`` over a ``SharedKVPool``)
expects a transfer; this process plays the prefill core and sends the
request's KV layer by layer through ``ShmTransport`` or ``TcpTransport``,
then ``KVTransferDone``. Time runs from the first layer's gather to the
acknowledgement, so it includes the sender's per-chunk checksums, the
decode core's verification of every chunk (read back from its pool) and its
completion check. The baseline copies
the same blocks between two pools in this process (per layer: one
``copy_`` of a contiguous run, or ``index_select`` + ``index_copy_`` of
scattered blocks: the shape of the transfer without any link).

Default shape: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, bf16), a
2048-token request in blocks of 16 (about 47 MiB of KV).

    python bench/disagg_transfer.py [--tokens 2048] [--dtype bfloat16] [--repeats 5]
                                    [--layout scattered|contiguous] [--json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch
import zmq

from kvferry import peer_auth
from kvferry.disagg.transport import (
    KVReceiver, SharedKVPool, ShmTransport, TcpTransport, block_runs,
)
from kvferry.messages import KVTransferDone

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pool_shape(args, num_blocks: int) -> tuple[int, ...]:
    return (args.layers, 2, num_blocks, args.block_size, args.kv_heads, args.head_dim)


def receiver_main(args, conn) -> None:
    """The decode side: a shared-memory pool and its receiver."""
    torch.set_num_threads(args.threads)
    num_blocks = 2 * args.tokens // args.block_size + 8
    pool = SharedKVPool.create(pool_shape(args, num_blocks), DTYPES[args.dtype])
    receiver = KVReceiver(pool.tensor, "tcp://127.0.0.1:0")
    conn.send((receiver.address, pool.name))
    while True:
        message = conn.recv()
        if message is None:
            break
        transfer_id, block_ids = message
        receiver.expect("bench", transfer_id, block_ids, time.monotonic() + 60)
        conn.send("ready")
    receiver.close()
    pool.close()


def transfer_once(link, src: torch.Tensor, src_blocks: list[int], dst_blocks: list[int], transfer_id: str) -> float:
    """What the prefill core's sender thread does for a whole prompt."""
    start = time.perf_counter()
    for layer in range(src.shape[0]):
        link.write_layer(transfer_id, layer, src[layer], src_blocks, dst_blocks, len(dst_blocks))
    link.send_done(KVTransferDone(transfer_id=transfer_id, num_layers=src.shape[0], block_ids=dst_blocks,
                                  output_token_ids=[1]))
    while True:
        acks = link.poll_acks()
        if acks:
            assert acks[0].ok, acks[0].reason
            return time.perf_counter() - start
        link.sock.poll(1)


def memcpy_once(src: torch.Tensor, dst: torch.Tensor, src_blocks: list[int], dst_blocks: list[int]) -> float:
    """The same bytes between two pools in this process: one copy per layer
    of a contiguous run, else a gather and a scatter (``index_copy_``)."""
    src_index = torch.tensor(src_blocks, dtype=torch.int64)
    dst_index = torch.tensor(dst_blocks, dtype=torch.int64)
    runs = len(block_runs(src_blocks)) == len(block_runs(dst_blocks)) == 1
    s0, d0, n = src_blocks[0], dst_blocks[0], len(src_blocks)
    start = time.perf_counter()
    for layer in range(src.shape[0]):
        if runs:
            dst[layer, :, d0 : d0 + n].copy_(src[layer, :, s0 : s0 + n])
        else:
            dst[layer].index_copy_(1, dst_index, src[layer].index_select(1, src_index))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    parser.add_argument("--layout", choices=["scattered", "contiguous"], default="scattered",
                        help="the request's blocks in both pools: every other block, or one run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    num_blocks = args.tokens // args.block_size
    src_pool_blocks = 2 * num_blocks + 8
    src = torch.randn(pool_shape(args, src_pool_blocks)).to(DTYPES[args.dtype])
    local_dst = torch.zeros_like(src)
    if args.layout == "scattered":  # as in a pool that has served a while: every other block
        src_blocks = list(range(1, 2 * num_blocks + 1, 2))
        dst_blocks = list(range(2, 2 * num_blocks + 2, 2))
    else:  # as in a fresh pool
        src_blocks = list(range(1, num_blocks + 1))
        dst_blocks = list(range(3, num_blocks + 3))
    nbytes = args.layers * 2 * num_blocks * args.block_size * args.kv_heads * args.head_dim * src.element_size()

    peer_auth.socket_secret()  # before the spawn: the receiver inherits it and expects our token
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(args, child), daemon=True)
    proc.start()
    address, shm_name = parent.recv()
    zctx = zmq.Context.instance()
    block_shape = (args.layers, 2, args.block_size, args.kv_heads, args.head_dim)
    links = {
        "shm": ShmTransport(zctx, address, SharedKVPool.attach(shm_name, block_shape, DTYPES[args.dtype])),
        "tcp": TcpTransport(zctx, address),
    }
    times: dict[str, list[float]] = {"memcpy": [], "shm": [], "tcp": []}
    n = 0
    for _ in range(args.repeats + 1):  # the first round warms up (page faults, connections)
        for name in ("memcpy", "shm", "tcp"):
            if name == "memcpy":
                seconds = memcpy_once(src, local_dst, src_blocks, dst_blocks)
            else:
                n += 1
                parent.send((f"t{n}", dst_blocks))
                assert parent.recv() == "ready"
                seconds = transfer_once(links[name], src, src_blocks, dst_blocks, f"t{n}")
            times[name].append(seconds)
    parent.send(None)
    proc.join(10)
    for link in links.values():
        link.close()

    best = {name: min(ts[1:]) for name, ts in times.items()}
    result = {
        "tokens": args.tokens, "bytes": nbytes, "dtype": args.dtype, "layout": args.layout,
        "gbps": {name: nbytes / t / 1e9 for name, t in best.items()},
        "median_ms": {name: 1e3 * statistics.median(ts[1:]) for name, ts in times.items()},
        "ratio_to_memcpy": {name: best["memcpy"] / best[name] for name in ("shm", "tcp")},
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.tokens}-token request, {nbytes / 2**20:.1f} MiB of KV ({args.dtype}, {args.layout} blocks), "
          f"best of {args.repeats}")
    for name in ("memcpy", "shm", "tcp"):
        ratio = "" if name == "memcpy" else f"  {result['ratio_to_memcpy'][name]:.2f}x memcpy"
        print(f"  {name:7s} {result['gbps'][name]:6.2f} GB/s  median {result['median_ms'][name]:7.1f} ms{ratio}")


if __name__ == "__main__":
    main()
