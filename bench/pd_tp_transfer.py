"""Who carries a resharded KV transfer: every decode rank's pool written
directly (shared memory, what kvferry does on one host) against every piece
relayed through decode rank 0's socket (TCP frames its receiver copies into
the ranks' pools: what one endpoint per core costs), for one long request.

The prefill ranks are threads here, one link each (as each rank's sender
thread has its own); the decode core is rank 0's ``KVReceiver`` over every
rank's pool in shared memory. Time runs from the first piece to rank 0's
acknowledgement (all pieces verified), best of N, interleaved.

Default shape: a 1B-shaped Llama's KV (16 layers, 8 KV heads, head_dim 64,
bf16), a 2048-token request in blocks of 16 (64 MiB).

    python bench/pd_tp_transfer.py [--tokens 2048] [--repeats 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch
import zmq

from kvferry.disagg.heads import head_slices, rank_heads
from kvferry.disagg.transport import KVReceiver, SharedKVPool, ShmTransport, TcpTransport, rank_pool_name
from kvferry.messages import KVTransferDone

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def transfer(args, a: int, b: int, transport: str, tid: str) -> float:
    heads, blocks = args.kv_heads, args.tokens // args.block_size
    shape = (args.layers, 2, blocks, args.block_size, heads // b, args.head_dim)
    pools = [SharedKVPool.create(shape, torch.bfloat16)]
    pools += [SharedKVPool.create(shape, torch.bfloat16, name=rank_pool_name(pools[0].name, r)) for r in range(1, b)]
    receiver = KVReceiver(pools[0].tensor, "tcp://127.0.0.1:0", rank_pools=[p.tensor for p in pools[1:]])
    ids = list(range(blocks))
    src = [torch.randn(args.layers, 2, blocks, args.block_size, heads // a, args.head_dim).to(torch.bfloat16)
           for _ in range(a)]
    ctx = zmq.Context.instance()
    links = []
    for _ in range(a):
        if transport == "tcp":
            links.append(TcpTransport(ctx, receiver.address))
        else:
            attached = [SharedKVPool.attach(rank_pool_name(pools[0].name, d),
                                            (args.layers, 2, args.block_size, heads // b, args.head_dim),
                                            torch.bfloat16) for d in range(b)]
            links.append(ShmTransport(ctx, receiver.address, attached))
    receiver.expect("r", tid, ids, time.monotonic() + 120)
    time.sleep(0.1)  # the links connected

    def send(rank: int) -> None:
        pieces = head_slices(heads, rank, a, b) if (a, b) != (1, 1) else [None]
        for layer in range(args.layers):
            for piece in pieces:
                links[rank].write_layer(tid, layer, src[rank][layer], ids, ids, len(ids), piece)

    start = time.perf_counter()
    threads = [threading.Thread(target=send, args=(r,)) for r in range(a)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    links[0].send_done(KVTransferDone(transfer_id=tid, num_layers=args.layers, block_ids=ids, output_token_ids=[1],
                                      num_ranks=a))
    while not (acks := links[0].poll_acks()):
        time.sleep(0.0005)
    elapsed = time.perf_counter() - start
    assert acks[0].ok, acks
    lo, hi = rank_heads(heads, 0, b)
    got = pools[0].tensor[..., : min(hi, heads // a), :]
    assert torch.equal(got, src[0][..., lo : lo + got.shape[-2], :])
    for link in links:
        link.close()
    receiver.close()
    for pool in pools:
        pool.close()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    load_before = os.getloadavg()
    best: dict[str, float] = {}
    for i in range(args.repeats):  # interleaved: a load change hits every case alike
        for a, b in LAYOUTS:
            for transport in ("shm", "tcp"):
                key = f"p{a} d{b} {transport}"
                best[key] = min(best.get(key, float("inf")), transfer(args, a, b, transport, f"t{i}{key}"))
    mib = args.layers * 2 * args.tokens * args.kv_heads * args.head_dim * 2 / 2**20
    if args.json:
        print(json.dumps({"ms": {k: 1000 * v for k, v in best.items()}, "mib": mib,
                          "loadavg": [load_before, os.getloadavg()]}))
        return
    print(f"{mib:.0f} MiB of KV ({args.tokens} tokens), best of {args.repeats}; load average "
          f"{load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    for a, b in LAYOUTS:
        shm, tcp = best[f"p{a} d{b} shm"], best[f"p{a} d{b} tcp"]
        print(f"prefill tp {a} -> decode tp {b}: direct (shm) {1000 * shm:7.1f} ms, relayed by rank 0 (tcp) "
              f"{1000 * tcp:7.1f} ms ({tcp / shm:.2f}x)")


if __name__ == "__main__":
    main()
