"""Rank functions for the tests (module level, so that spawned processes can import them)."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import torch

from kvferry.parallel import ProcessGroup


def collectives(group: ProcessGroup) -> dict:
    r, n = group.rank, group.world_size
    summed = group.all_reduce(torch.tensor([float(r + 1), 10.0 * (r + 1)]))
    biggest = group.all_reduce(torch.tensor([float(r)]), op="max")
    gathered = group.all_gather(torch.full((2, 3), float(r)))
    # Row block j goes to rank j: rank r receives [r from rank 0, r from rank 1, ...] * 100 + sender
    sent = torch.tensor([[100.0 * j + r] for j in range(n)])
    exchanged = group.all_to_all(sent)
    root = group.broadcast(torch.tensor([42.0 if r == 0 else -1.0]))
    group.barrier()
    return {"rank": r, "world": n, "pid": os.getpid(), "sum": summed.tolist(), "max": biggest.tolist(),
            "gathered": gathered.tolist(), "all_to_all": exchanged.tolist(), "broadcast": root.tolist()}


def one_dies(group: ProcessGroup) -> str:
    group.barrier()  # the group formed
    if group.rank == 1:
        os._exit(3)  # as a crash: no goodbye to the peers
    group.all_reduce(torch.ones(4))
    return "unreachable"


def one_raises(group: ProcessGroup) -> None:
    if group.rank == 1:
        raise ValueError("rank 1's bad input")
    group.all_reduce(torch.ones(4))  # blocks until the launcher ends this rank


def python_and_cpp_sums(group: ProcessGroup) -> dict:
    """The same partial sums (a decode row, a prefill's rows over two calls)
    through Python's ShmAllReduce and through the C++ ShmSums: their bits."""
    from kvferry.model import layer_op
    from kvferry.parallel import ShmAllReduce
    shm = ShmAllReduce(group, slot_bytes=64 << 10)
    out: dict = {}
    for native in (False, True):
        if native:
            shm.attach(layer_op.shm_sums(shm))
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for rows in (1, 37):
                x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(group.rank)).to(dtype)
                out[(native, str(dtype), rows)] = shm.all_reduce(x).view(torch.uint8).numpy().tobytes()
        out[(native, "gather")] = shm.all_gather(torch.full((2, 3), float(group.rank)), dim=1).tolist()
    shm.close()
    return out


def late_peer_sums(group: ProcessGroup, calls: int = 8, late_s: float = 0.03) -> dict:
    """C++ sums where rank 1 comes ``late_s`` late to every call: rank 0
    sleeps on rank 1's flag each time (past its spin) and rank 1 finds
    it asleep; rank 1 never waits. Each rank's FUTEX_WAKE count, and how
    long rank 0's calls took (a lost wake ends its sleep only at the
    wait's 50 ms slice)."""
    from kvferry.model import layer_op
    from kvferry.parallel import ShmAllReduce
    torch.set_num_threads(1)
    shm = ShmAllReduce(group)
    shm.attach(sums := layer_op.shm_sums(shm))
    shm.barrier()
    sums_ok, took = True, []
    for i in range(calls):
        if group.rank == 1:
            time.sleep(late_s)
        x = torch.full((1, 2048), float(group.rank + i), dtype=torch.bfloat16)
        t0 = time.perf_counter()
        shm.all_reduce(x)
        took.append(time.perf_counter() - t0)
        sums_ok &= bool((x == float(2 * i + 1)).all())
    out = {"rank": group.rank, "wakes": sums.wakes(), "took": took, "sums_ok": sums_ok}
    shm.close()
    return out


def member_process(rank: int, world: int, host: str, port: int, action: str) -> None:
    """A plain process joining a group built by the test itself."""
    from kvferry.parallel import GroupAddress
    group = ProcessGroup(rank, world, GroupAddress(host, port), timeout_s=30)
    if action == "shm_die":
        from kvferry.parallel import ShmAllReduce
        ShmAllReduce(group).all_reduce(torch.ones(4))
        os._exit(3)
    group.barrier()
    if action == "die":
        os._exit(3)
    if action == "hang":
        time.sleep(120)  # alive, sockets open, never joins the next collective


def shm_sums(group: ProcessGroup, native: bool = False) -> dict:
    """Float sums through shared memory: small, across several slot-sized
    chunks, in place on a view, and the same bits on every rank. ``native``:
    after the first call, the calls run in C++ (layer_op.shm_sums)."""
    from kvferry.parallel import ShmAllReduce
    shm = ShmAllReduce(group, slot_bytes=256)  # 64 float32s a call: the big tensor takes many
    r = group.rank
    small = shm.all_reduce(torch.tensor([1.0 + r, 10.0 * r]))
    if native:  # the C++ side goes on from the Python side's count
        from kvferry.model import layer_op
        shm.attach(layer_op.shm_sums(shm))
    gen = torch.Generator().manual_seed(r)
    big = torch.randn(37, 11, generator=gen)  # 407 elements: 7 calls, the last partial
    expected = sum(torch.randn(37, 11, generator=torch.Generator().manual_seed(j)) for j in range(group.world_size))
    got = shm.all_reduce(big.clone())
    ints = shm.all_reduce(torch.tensor([r + 1]))  # not a float: gloo's
    half = torch.full((4, 8), float(r))
    shm.all_reduce(half[:, :4].contiguous())  # a copy: the sum lands in it, not in half
    gathered = shm.all_gather(torch.tensor([[float(r)]]), dim=1)
    # Logits-like: 37 rows of 11 (44 bytes): 5 rows a call over the 256-byte slots, the last call short.
    wide = [torch.randn(37, 11, generator=torch.Generator().manual_seed(j)) for j in range(group.world_size)]
    by_cols = torch.equal(shm.all_gather(wide[r], dim=1), torch.cat(wide, dim=1))
    by_rows = torch.equal(shm.all_gather(wide[r][:3], dim=-2), torch.cat([w[:3] for w in wide]))
    bf16 = shm.all_reduce(torch.full((5,), 0.1 * (r + 1), dtype=torch.bfloat16))  # summed in float32
    shm.barrier()
    return {"small": small.tolist(), "close": bool(torch.allclose(got, expected, atol=1e-5)),
            "bits": got.numpy().tobytes(), "ints": ints.tolist(), "gathered": gathered.tolist(),
            "half": half.tolist(), "bf16": bf16.float().tolist(), "by_cols": by_cols, "by_rows": by_rows}



def stop_core(core: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM a core started apart (kvferry engine-core), SIGKILL past the timeout."""
    core.send_signal(signal.SIGTERM)
    try:
        core.wait(timeout_s)
    except subprocess.TimeoutExpired:
        core.kill()
        core.wait()
