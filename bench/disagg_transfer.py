"""KV transfer throughput for one request, against an in-process memcpy of
the same bytes measured in the same run (interleaved, best of N).

A receiver process (a decode core's ``KVReceiver`` over a ``SharedKVPool``)
expects a transfer; this process plays the prefill core and sends the
request's KV layer by layer through ``ShmTransport``, ``TcpTransport`` or
``MooncakeTransport`` (Mooncake's Transfer Engine over its TCP transport;
both pools registered, a ``mooncake_master`` on loopback serving the
metadata; skipped when mooncake cannot load; a transfer of short runs of
blocks it sends framed, as TCP does: see its module), then
``KVTransferDone``. Time runs from the first layer's gather to the
acknowledgement, so it includes the sender's per-chunk checksums, the
decode core's verification of every chunk (read back from its pool) and its
completion check. The baseline copies
the same blocks between two pools in this process (per layer: one
``copy_`` of a contiguous run, or ``index_select`` + ``index_copy_`` of
scattered blocks: the shape of the transfer without any link).

Default shape: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, bf16), a
2048-token request in blocks of 16 (about 47 MiB of KV).

    python bench/disagg_transfer.py [--tokens 2048] [--dtype bfloat16] [--repeats 5]
                                    [--layout scattered|contiguous] [--transports shm,tcp,mooncake] [--json]
"""
from __future__ import annotations

import argparse
import atexit
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

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


def receiver_main(args, metadata: str, conn) -> None:
    """The decode side: a shared-memory pool and its receiver (and, with a
    metadata server, the pool registered with a Transfer Engine)."""
    torch.set_num_threads(args.threads)
    num_blocks = 2 * args.tokens // args.block_size + 8
    pool = SharedKVPool.create(pool_shape(args, num_blocks), DTYPES[args.dtype])
    receiver = KVReceiver(pool.tensor, "tcp://127.0.0.1:0")
    engine = None
    if metadata:
        from kvferry.disagg.mooncake_transport import MooncakeEngine

        engine = MooncakeEngine("127.0.0.1", metadata, pool.tensor)
    conn.send((receiver.address, pool.name, engine.descriptor if engine else b""))
    while True:
        message = conn.recv()
        if message is None:
            break
        transfer_id, block_ids = message
        receiver.expect("bench", transfer_id, block_ids, time.monotonic() + 60)
        conn.send("ready")
    receiver.close()
    if engine is not None:
        engine.close()
    pool.close()


def start_metadata_server(work: Path):
    """A ``mooncake_master`` on loopback, its HTTP metadata URL; (None, '')
    when mooncake cannot load."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kvstore_cluster import start_master

    try:
        from kvferry.disagg.mooncake_transport import load_transfer_engine

        load_transfer_engine()
        proc, url = start_master(work)
    except (ValueError, RuntimeError) as exc:
        print(f"mooncake skipped: {exc}", file=sys.stderr)
        return None, ""
    atexit.register(proc.kill)  # a failed run must not leave it behind
    return proc, url.split("metadata=")[1].split("&")[0]


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


def mooncake_link(zctx: zmq.Context, address: str, metadata: str, src: torch.Tensor, transport_desc: bytes):
    """The prefill side's engine over its whole source pool, and the link."""
    from kvferry.disagg.mooncake_transport import MooncakeEngine, MooncakeTransport

    return MooncakeTransport(zctx, address, MooncakeEngine("127.0.0.1", metadata, src), transport_desc)


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
    parser.add_argument("--transports", default="shm,tcp,mooncake",
                        help="comma-separated, timed in this order each round after the in-process copy")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    names = [t for t in args.transports.split(",") if t]
    if not set(names) <= {"shm", "tcp", "mooncake"}:
        parser.error(f"--transports: shm, tcp, mooncake; got {args.transports!r}")
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

    master, metadata = start_metadata_server(Path(tempfile.mkdtemp(prefix="kv-transfer-"))) \
        if "mooncake" in names else (None, "")
    if not metadata and "mooncake" in names:
        names.remove("mooncake")
    peer_auth.socket_secret()  # before the spawn: the receiver inherits it and expects our token
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(args, metadata, child), daemon=True)
    proc.start()
    address, shm_name, transport_desc = parent.recv()
    zctx = zmq.Context.instance()
    block_shape = (args.layers, 2, args.block_size, args.kv_heads, args.head_dim)
    links = {
        "shm": lambda: ShmTransport(zctx, address, SharedKVPool.attach(shm_name, block_shape, DTYPES[args.dtype])),
        "tcp": lambda: TcpTransport(zctx, address),
        "mooncake": lambda: mooncake_link(zctx, address, metadata, src, transport_desc),
    }
    links = {name: links[name]() for name in names}
    times: dict[str, list[float]] = {"memcpy": [], **{name: [] for name in names}}
    n = 0
    for _ in range(args.repeats + 1):  # the first round warms up (page faults, connections)
        for name in ("memcpy", *names):
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
        if hasattr(link, "engine"):
            link.engine.close()
    if master is not None:
        master.kill()

    best = {name: min(ts[1:]) for name, ts in times.items()}
    result = {
        "tokens": args.tokens, "bytes": nbytes, "dtype": args.dtype, "layout": args.layout,
        "gbps": {name: nbytes / t / 1e9 for name, t in best.items()},
        "median_ms": {name: 1e3 * statistics.median(ts[1:]) for name, ts in times.items()},
        "ratio_to_memcpy": {name: best["memcpy"] / best[name] for name in names},
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.tokens}-token request, {nbytes / 2**20:.1f} MiB of KV ({args.dtype}, {args.layout} blocks), "
          f"best of {args.repeats}")
    for name in ("memcpy", *names):
        ratio = "" if name == "memcpy" else f"  {result['ratio_to_memcpy'][name]:.2f}x memcpy"
        print(f"  {name:7s} {result['gbps'][name]:6.2f} GB/s  median {result['median_ms'][name]:7.1f} ms{ratio}")


if __name__ == "__main__":
    main()
