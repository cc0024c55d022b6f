"""The two-rank shared-memory all-reduce of a prefill step's activations
(parallel/shm_all_reduce.py): the same bits as the float32 sum rounded
once, on both ranks, and one pass over memory (a 1B-shaped model's
[2048, 2048] bf16 sum is 33 of a 2048-token step's all-reduces)."""
from __future__ import annotations

import time

import torch

import pytest

from kvferry.model import layer_op
from kvferry.parallel import ProcessGroup, ShmAllReduce, launch
from tests.parallel import ranks

TOKENS, HIDDEN = 2048, 2048  # 8 MiB in bf16: two calls through the 4 MiB slots
REPS = 7


def _partial(rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)


def sums_and_cost(group: ProcessGroup) -> dict:
    torch.set_num_threads(1)  # as a rank of --cpu-threads-per-rank 1
    shm = ShmAllReduce(group)
    out: dict = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = shm.all_reduce(_partial(group.rank, dtype))
        want = (_partial(0, dtype).float() + _partial(1, dtype).float()).to(dtype)
        out[str(dtype)] = torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
    x = _partial(group.rank, torch.bfloat16)
    copies = [x.clone() for _ in range(REPS)]
    other = _partial(1 - group.rank, torch.bfloat16)
    reduce_s, add_s = [], []
    for y in copies:  # CPU time, not wall: the host is shared; the least of a few is the cost
        shm.barrier()
        t0 = time.thread_time()
        shm.all_reduce(y)
        reduce_s.append(time.thread_time() - t0)
        z = x.clone()
        t0 = time.thread_time()
        z.add_(other)  # one bf16 add of the same size: the floor's unit
        add_s.append(time.thread_time() - t0)
    shm.close()
    out["ratio"] = min(reduce_s) / min(add_s)
    return out


def test_two_ranks_sum_a_prefill_step_in_one_pass_with_the_same_bits():
    out = launch(sums_and_cost, 2, timeout_s=60, deadline_s=180)
    for o in out:
        assert o["torch.bfloat16"] and o["torch.float16"] and o["torch.float32"]
        # Copy in, then add the peer's slot: about 2 adds' worth. The float32
        # round trip (a conversion, an add in float32, a copy back) was 4-6.
        assert o["ratio"] < 2.8, o


def test_the_cpp_sums_are_the_python_sums_to_the_bit():
    """A tensor-parallel rank's sums run in C++ where the decoder layer
    builds (layer_op.shm_sums: its layers in one call, the sums inside):
    the same bits as Python's, and the same gather."""
    if not layer_op.available():
        pytest.skip("the C++ decoder layer's library does not build here")
    for o in launch(ranks.python_and_cpp_sums, 2, timeout_s=60, deadline_s=180):
        for key, value in o.items():
            if key[0]:
                assert value == o[(False, *key[1:])], key
    assert o[(True, "gather")] == [[0.0] * 3 + [1.0] * 3] * 2


def test_a_rank_wakes_its_peer_only_when_the_peer_sleeps():
    """The C++ wait sleeps on the late rank's flag as a futex: the late
    rank wakes it, and a rank whose peer is not asleep makes no wake
    syscall (one per all-reduce was 33 syscalls a 16-layer decode step)."""
    if not layer_op.available():
        pytest.skip("the C++ decoder layer's library does not build here")
    calls, late_s = 8, 0.03
    early, late = launch(ranks.late_peer_sums, 2, timeout_s=60, deadline_s=180, args=(calls, late_s))
    assert early["sums_ok"] and late["sums_ok"]
    assert early["wakes"] == 0, early  # rank 1 never waits: nobody to wake
    assert late["wakes"] >= 1, late  # rank 0 was asleep when rank 1 came
    # Woken when rank 1 stores, not at the end of a 50 ms sleep slice.
    assert sorted(early["took"])[calls // 2] < late_s + 0.015, early["took"]


@pytest.mark.skipif(not layer_op.available(), reason="the C++ layer op needs its compiled kernels")
def test_one_rank_sums_are_the_tensor_itself_in_every_dtype():
    """One rank (the benches' single-process sums): the sum over one rank is
    x, bit for bit; float32 once read a second rank's slot that one rank has not."""
    import os

    slot = 1 << 16
    sums = torch.classes.kvferry_layer.ShmSums(torch.zeros(2, dtype=torch.int64),
                                               torch.full((2 * slot,), 0x7f, dtype=torch.uint8),
                                               0, slot, [os.getpid()], 10.0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(3, 257, generator=torch.Generator().manual_seed(5)).to(dtype)
        y = x.clone()
        sums.all_reduce_(y)
        assert torch.equal(y, x), dtype
