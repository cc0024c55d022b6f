"""The cluster KV pool (Mooncake Store) across two node stores, in one run:

1. **Cross-store reuse TTFT.** Engine A, on node store A, computes a
   ``--prompt-tokens`` prompt (its blocks written through to the pool);
   engine B, on node store B (another store, its DRAM empty), serves the
   same prompt from the pool. Against the same prompt recomputed by an
   engine without a store.
2. **Pool bandwidth.** Blocks of the model's size put and got through the
   tier, 32 a call as the store's pool writer and load threads do
   (``MooncakeTier.put_many``, and ``get_into`` DRAM slots; ``get_many``
   too, which returns fresh bytes: one lookup per put batch, checksum,
   AES-GCM sealing for private blocks, in registered transfer buffers)
   against Mooncake's own client (``put_batch``/``get_batch``, raw bytes,
   32 a call) on the same pool.

A ``mooncake_master`` (from the mooncake package) is started on loopback;
the stores use TCP.

    python bench/kvstore_cluster.py [--model PATH] [--prompt-tokens 2048] [--rounds 3] [--bandwidth-repeats 3]
    python bench/kvstore_cluster.py --skip-reuse    # the bandwidth figures alone (no model)

Prints one JSON object per figure. Timings on a shared machine are noisy:
compare the ratios, measured in the same run.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _servers, tiers_resume beside this file

from tiers_resume import close, engine, random_prompt  # noqa: E402

from kvferry import SamplingParams  # noqa: E402
from kvferry.config import KVTierConfig  # noqa: E402
from kvferry.kvstore.client import KVStoreClient  # noqa: E402
from kvferry.kvstore.cluster import MooncakeTier  # noqa: E402
from kvferry.kvstore.mooncake_lib import master_binary, metadata_server_argv  # noqa: E402
from kvferry.kvstore.crypto import TierCrypto  # noqa: E402
from kvferry.kvstore.launch import start_store  # noqa: E402
from kvferry.kvstore.tier import BlockOwner  # noqa: E402

GREEDY_ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master(workdir: Path) -> tuple[subprocess.Popen, str]:
    rpc, http, metrics = free_port(), free_port(), free_port()
    # The package's metadata server, on loopback (the master's built-in one
    # listens on every interface); it ends with this process.
    metadata = subprocess.Popen(metadata_server_argv("127.0.0.1", http), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    atexit.register(metadata.kill)
    proc = subprocess.Popen(
        [master_binary(), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
         "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", "--enable_metric_reporting=false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", rpc), timeout=0.2).close()
            socket.create_connection(("127.0.0.1", http), timeout=0.2).close()
            return proc, f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{http}/metadata&segment_gb=2"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("mooncake_master did not start")


def timed(llm, prompt) -> float:
    start = time.perf_counter()
    llm.generate([prompt], GREEDY_ONE)
    return time.perf_counter() - start


def wait_written(address: str, nbytes: int, timeout_s: float = 60.0) -> None:
    with KVStoreClient(address) as client:
        deadline = time.monotonic() + timeout_s
        while client.stats().tiers["cluster"].bytes_written < nbytes:
            if time.monotonic() > deadline:
                raise RuntimeError("the pool never got the blocks")
            time.sleep(0.02)


def reuse(args, url: str, secret: str) -> dict:
    stores = [start_store(KVTierConfig(kv_dram_gb=args.dram_gb, kv_cluster=url), cache_secret_file=secret)
              for _ in range(2)]
    (_, address_a), (_, address_b) = stores
    try:
        rng = random.Random(0)
        a, b, plain = engine(args, address_a), engine(args, address_b), engine(args, None)
        block = a.engine.core.block_size
        pool, recompute, written = [], [], 0
        for _ in range(args.rounds):
            prompt = random_prompt(rng, args.prompt_tokens)
            a.generate([prompt], GREEDY_ONE)
            with KVStoreClient(address_a) as client:
                written += (len(prompt) // block) * client.stats().block_nbytes
            wait_written(address_a, written)
            pool.append(timed(b, prompt))
            recompute.append(timed(plain, prompt))
        with KVStoreClient(address_b) as client:
            hits = client.stats().tiers["cluster"].hits
            block_nbytes = client.stats().block_nbytes
        for llm in (a, b, plain):
            close(llm)
        return {"figure": "cross-store reuse TTFT", "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
                "pool_ttft_s": round(statistics.median(pool), 3),
                "recompute_ttft_s": round(statistics.median(recompute), 3),
                "speedup": round(statistics.median(recompute) / statistics.median(pool), 2),
                "pool_hits_blocks": hits, "block_bytes": block_nbytes}
    finally:
        for process, _ in stores:
            process.terminate()
            process.wait(timeout=30)


def bandwidth(url: str, block_nbytes: int, num_blocks: int, repeats: int) -> list[dict]:
    """Blocks put and got through the tier, 32 a call as the store's pool
    writer and load threads do (``put_many``/``get_many``), against the
    Mooncake client's own ``put_batch``/``get_batch`` of raw bytes, 32 a
    call, on the same pool. Each repeat measures every path once, back to
    back; the ratios are the medians of each repeat's ratio."""
    crypto = TierCrypto(os.urandom(32))
    writer, reader = MooncakeTier(url + "&namespace=bw", crypto=crypto), MooncakeTier(url + "&namespace=bw",
                                                                                      crypto=crypto)
    data = [os.urandom(block_nbytes) for _ in range(8)]
    paths = {"tier, private (sealed)": BlockOwner("acme"), "tier, public (clear)": BlockOwner("acme", public=True)}
    rates: dict[str, dict[str, list[float]]] = {p: {"put": [], "get": [], "get_many": []} for p in [*paths, "raw"]}
    # The store's loads read into its DRAM slots (get_into); get_many
    # returns fresh bytes per block, as get_batch does.
    arena = memoryview(bytearray(32 * block_nbytes))
    slots = [arena[i * block_nbytes:(i + 1) * block_nbytes] for i in range(32)]

    def rate(seconds: float) -> float:
        return num_blocks * block_nbytes / seconds / 1e6

    try:
        for rep in range(repeats):
            for label, owner in paths.items():
                keys = [os.urandom(32) for _ in range(num_blocks)]
                start = time.perf_counter()
                for i in range(0, num_blocks, 32):
                    assert all(writer.put_many([(k, data[(i + j) % 8], owner)
                                                for j, k in enumerate(keys[i:i + 32])]))
                rates[label]["put"].append(rate(time.perf_counter() - start))
                start = time.perf_counter()
                for i in range(0, num_blocks, 32):
                    assert all(reader.get_into(keys[i:i + 32], owner, slots[:len(keys[i:i + 32])]))
                rates[label]["get"].append(rate(time.perf_counter() - start))
                start = time.perf_counter()
                got = [reader.get_many(keys[i:i + 32], owner) for i in range(0, num_blocks, 32)]
                rates[label]["get_many"].append(rate(time.perf_counter() - start))
                assert all(g is not None for batch in got for g in batch)
            raw_w, raw_r = writer._store, reader._store
            names = [f"bw/raw/{rep}/{i}" for i in range(num_blocks)]
            start = time.perf_counter()
            for i in range(0, num_blocks, 32):
                assert raw_w.put_batch(names[i:i + 32],
                                       [data[j % 8] for j in range(i, min(i + 32, num_blocks))]) == 0
            rates["raw"]["put"].append(rate(time.perf_counter() - start))
            start = time.perf_counter()
            for i in range(0, num_blocks, 32):
                assert all(raw_r.get_batch(names[i:i + 32]))
            rates["raw"]["get"].append(rate(time.perf_counter() - start))
    finally:
        writer.close()
        reader.close()
    out = []
    for label in rates:
        row = {"figure": "pool bandwidth",
               "path": label if label != "raw" else "Mooncake client put_batch/get_batch (raw)",
               "block_bytes": block_nbytes, "blocks": num_blocks, "repeats": repeats}
        for op in ("put", "get", "get_many") if label != "raw" else ("put", "get"):
            row[f"{op}_MBps"] = round(statistics.median(rates[label][op]))
            if label != "raw":
                raw = rates["raw"]["get" if op == "get_many" else op]
                row[f"{op}_ratio"] = round(statistics.median(t / r for t, r in zip(rates[label][op], raw)), 2)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dram-gb", type=float, default=1.0)
    parser.add_argument("--bandwidth-blocks", type=int, default=256)
    parser.add_argument("--bandwidth-repeats", type=int, default=3)
    parser.add_argument("--skip-reuse", action="store_true",
                        help="the bandwidth figures alone (blocks of --block-bytes)")
    parser.add_argument("--block-bytes", type=int, default=360 * 1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp) / "secret"
        secret.write_text(os.urandom(32).hex())
        master, url = start_master(Path(tmp))
        try:
            block_nbytes = args.block_bytes
            if not args.skip_reuse:
                result = reuse(args, url, str(secret))
                print(json.dumps(result), flush=True)
                block_nbytes = result["block_bytes"]
            for row in bandwidth(url, block_nbytes, args.bandwidth_blocks, args.bandwidth_repeats):
                print(json.dumps(row), flush=True)
        finally:
            master.kill()
            master.wait()


if __name__ == "__main__":
    main()
