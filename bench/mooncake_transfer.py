"""Mooncake's Transfer Engine against kvferry's own KV transports, on this
host: is an optional ``--kv-transport mooncake`` worth having here?

    python bench/mooncake_transfer.py [--repeats 7]

The same shape as bench/disagg_transfer.py: one 2,048-token request's KV of
the embedded model (128 blocks of 360 KiB, 45 MiB) written into scattered
blocks of a peer process's registered pool, with Mooncake's engine over its
TCP transport (the one this build has: no RDMA device here), through a
``mooncake_master``'s HTTP metadata server on loopback. Baseline: the
in-process copy of the same blocks, in the same run. The engine's raw write
bandwidth is an upper bound for a transport built on it (which would add
the layer streaming, the checksums and the acknowledgement that
bench/disagg_transfer.py's figures include).

That transport now exists (``--kv-transport mooncake``), and this probe's
block-major shape flatters it: kvferry's pool is layer-major, so a block
is one write of a few KiB per layer and K/V, and the engine pays 30-50 us a
write over TCP. bench/disagg_transfer.py measures the real shape
(BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvstore_cluster import free_port, start_master  # noqa: E402

BLOCK = 360 * 1024
NUM_BLOCKS = 128
POOL_BLOCKS = 512


def _receiver(metadata: str, name: str, conn) -> None:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(name, metadata, "tcp", "") != 0:
        conn.send(None)
        return
    pool = np.zeros(POOL_BLOCKS * BLOCK, dtype=np.uint8)
    engine.register_memory(pool.ctypes.data, pool.nbytes)
    conn.send((name, pool.ctypes.data))
    conn.recv()  # until the sender is done
    conn.send(int(pool[::4096].astype(np.int64).sum()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from mooncake.engine import TransferEngine

    work = Path(tempfile.mkdtemp(prefix="mc-transfer-"))
    master, url = start_master(work)
    metadata = url.split("metadata=")[1].split("&")[0]
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    # Each engine is named by a host:port of its own in the metadata server.
    peer = ctx.Process(target=_receiver, args=(metadata, f"127.0.0.1:{free_port()}", there), daemon=True)
    peer.start()
    try:
        target = here.recv()
        if target is None:
            print("the receiver's transfer engine did not initialize", file=sys.stderr)
            return 1
        peer_name, peer_base = target
        engine = TransferEngine()
        assert engine.initialize(f"127.0.0.1:{free_port()}", metadata, "tcp", "") == 0
        source = np.random.default_rng(0).integers(0, 255, NUM_BLOCKS * BLOCK, dtype=np.uint8)
        engine.register_memory(source.ctypes.data, source.nbytes)
        slots = random.Random(0).sample(range(POOL_BLOCKS), NUM_BLOCKS)
        buffers = [source.ctypes.data + i * BLOCK for i in range(NUM_BLOCKS)]
        dests = [peer_base + s * BLOCK for s in slots]
        local_pool = np.zeros(POOL_BLOCKS * BLOCK, dtype=np.uint8)
        mooncake_s, copy_s = [], []
        for _ in range(args.repeats + 1):  # the first is a warm-up (connections)
            start = time.perf_counter()
            rc = engine.batch_transfer_sync_write(peer_name, buffers, dests, [BLOCK] * NUM_BLOCKS)
            mooncake_s.append(time.perf_counter() - start)
            assert rc == 0, f"batch_transfer_sync_write returned {rc}"
            start = time.perf_counter()
            for i, s in enumerate(slots):
                local_pool[s * BLOCK:(s + 1) * BLOCK] = source[i * BLOCK:(i + 1) * BLOCK]
            copy_s.append(time.perf_counter() - start)
        here.send("done")
        here.recv()
    finally:
        peer.kill()
        master.kill()
    nbytes = NUM_BLOCKS * BLOCK
    mooncake_s, copy_s = mooncake_s[1:], copy_s[1:]
    print("| path | GB/s (best) | median ms | ratio to the in-process copy |\n|---|---|---|---|")
    for name, times in (("in-process copy between two pools", copy_s),
                        ("Mooncake Transfer Engine, TCP (loopback), one batch write", mooncake_s)):
        print(f"| {name} | {nbytes / min(times) / 1e9:.2f} | {statistics.median(times) * 1e3:.1f} | "
              f"{min(copy_s) / min(times):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
