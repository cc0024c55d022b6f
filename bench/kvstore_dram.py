"""Copy throughput between a device KV pool and the KV store's shared-memory
DRAM arena, against the same copies into private process memory.

A real store process is started (``start_store``); the benchmark maps its
arena through a ``KVStoreClient`` and moves batches of blocks both ways
with the same tensor ops the runner uses:

    save: arena[slots] <- kv_cache[:, :, blocks]   (gather on the pool's block dim)
    load: kv_cache[:, :, blocks] <- arena[slots]

The baseline does exactly the same into a private tensor of the same
shape (no shared memory), and a flat memcpy of the same bytes bounds both.
Rounds are interleaved (arena, private, memcpy, arena, ...) so that a noisy
machine hits all three alike. It also times the control plane: one
reserve + commit and one begin_load + poll + release round trip per batch.

    python bench/kvstore_dram.py --blocks-per-batch 64 --rounds 20
    python bench/kvstore_dram.py --device cuda --pin      # pinned arena (cudaHostRegister)
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvferry.kvstore.client import KVStoreClient
from kvferry.config import KVTierConfig
from kvferry.kvstore.launch import start_store
from kvferry.kvstore.service import GIB
from kvferry.kvstore.tier import BlockOwner


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--num-blocks", type=int, default=512, help="blocks in the device pool")
    parser.add_argument("--blocks-per-batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pin", action="store_true", help="page-lock the arena for the device (CUDA only)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return parser.parse_args()


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    block_shape = (args.num_layers, 2, args.block_size, args.num_kv_heads, args.head_dim)
    block_nbytes = int(np.prod(block_shape)) * torch.finfo(dtype).bits // 8
    n = args.blocks_per_batch
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache = torch.randn(args.num_layers, 2, args.num_blocks, *block_shape[2:], dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    process, address = start_store(KVTierConfig(kv_dram_gb=2 * n * block_nbytes / GIB), block_nbytes=block_nbytes)
    client = KVStoreClient(address, block_nbytes=block_nbytes)
    try:
        # [num_slots, num_layers, 2, block_size, num_kv_heads, head_dim] over the shared bytes
        arena = torch.from_numpy(client.arena()).view(dtype).view(client.num_slots, *block_shape)
        if args.pin:
            torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel() * arena.element_size(), 0)
        # Touch every page of both first: the rounds time copies, not page faults.
        private = torch.zeros_like(arena)
        arena.zero_()
        flat_src = np.empty(n * block_nbytes, dtype=np.uint8)
        flat_dst = np.empty_like(flat_src)
        flat_src[:] = 1
        flat_dst[:] = 1
        rng = np.random.default_rng(0)
        owners = [BlockOwner("bench")] * n
        times: dict[str, list[float]] = {k: [] for k in (
            "save arena", "save private", "load arena", "load private", "memcpy", "reserve+commit",
            "begin_load+poll+release")}
        for r in range(args.rounds):
            blocks = torch.from_numpy(rng.choice(args.num_blocks, n, replace=False)).to(device)
            slots = torch.arange(n)
            keys = [r.to_bytes(4, "little") + i.to_bytes(4, "little") + bytes(24) for i in range(n)]

            def save(dst):
                # [L, 2, n, bs, H, D] gathered on the device -> [n, L, 2, bs, H, D] into the slots
                gathered = kv_cache.index_select(2, blocks).permute(2, 0, 1, 3, 4, 5)
                dst.index_copy_(0, slots, gathered.to("cpu", non_blocking=True))

            def load(src):
                # [n, L, 2, bs, H, D] from the slots -> the pool's blocks on dim 2
                kv_cache.index_copy_(2, blocks, src.index_select(0, slots).to(device, non_blocking=True)
                                     .permute(1, 2, 0, 3, 4, 5))

            times["save arena"].append(timed(lambda: save(arena), sync))
            times["save private"].append(timed(lambda: save(private), sync))
            times["load arena"].append(timed(lambda: load(arena), sync))
            times["load private"].append(timed(lambda: load(private), sync))
            times["memcpy"].append(timed(lambda: np.copyto(flat_dst, flat_src), sync))

            t0 = time.perf_counter()
            got = client.reserve(keys, owners)
            client.commit([k for k, s in zip(keys, got) if s is not None], [s for s in got if s is not None])
            times["reserve+commit"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ticket = client.begin_load(keys, owners)
            results = []
            while not results:
                results = client.poll_loads()
            client.release(ticket)
            times["begin_load+poll+release"].append(time.perf_counter() - t0)
            client.drop_tenant("bench")  # room for the next round's keys

        batch_bytes = n * block_nbytes
        print(f"block {block_nbytes / 1024:.0f} KiB x {n} blocks = {batch_bytes / 2**20:.1f} MiB per batch, "
              f"device {args.device}, {args.rounds} rounds (median)")
        medians = {k: statistics.median(v) for k, v in times.items()}
        for name in ("save arena", "save private", "load arena", "load private", "memcpy"):
            print(f"  {name:14s} {batch_bytes / medians[name] / 2**30:7.2f} GiB/s  ({medians[name] * 1e3:.2f} ms)")
        print(f"  save: arena / private = {medians['save private'] / medians['save arena']:.2f}x throughput")
        print(f"  load: arena / private = {medians['load private'] / medians['load arena']:.2f}x throughput")
        for name in ("reserve+commit", "begin_load+poll+release"):
            print(f"  {name:24s} {medians[name] * 1e3:.2f} ms per batch of {n}")
    finally:
        client.close()
        process.terminate()
        process.wait(10)


if __name__ == "__main__":
    main()
