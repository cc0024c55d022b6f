"""Process groups with real rank processes on loopback: collectives' results,
and a group whose member dies or hangs fails clearly instead of hanging."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from kvferry.model import layer_op
from kvferry.parallel import CollectiveError, GroupAddress, ProcessGroup, RankFailed, ShmAllReduce, launch
from tests.parallel import ranks


def test_collectives_across_two_processes():
    out = launch(ranks.collectives, 2, timeout_s=60, deadline_s=120)
    assert [o["rank"] for o in out] == [0, 1] and out[0]["pid"] != out[1]["pid"]
    for o in out:
        assert o["world"] == 2
        assert o["sum"] == [3.0, 30.0]  # (1 + 2), (10 + 20)
        assert o["max"] == [1.0]
        assert o["gathered"] == [[0.0] * 3] * 2 + [[1.0] * 3] * 2  # rank order along dim 0
        assert o["broadcast"] == [42.0]
    # Rank r receives block r of every sender, in sender order: 100 * r + sender.
    assert out[0]["all_to_all"] == [[0.0], [1.0]]
    assert out[1]["all_to_all"] == [[100.0], [101.0]]


def test_a_rank_that_dies_fails_the_launch_quickly():
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as e:
        launch(ranks.one_dies, 2, timeout_s=60, deadline_s=120)
    # Rank 1 died first; rank 0 saw its peer's sockets close (not the 60 s timeout).
    assert e.value.rank in (0, 1) and "rank" in str(e.value)
    assert time.monotonic() - t0 < 55


def test_a_rank_that_raises_ends_the_group():
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1's bad input") as e:
        launch(ranks.one_raises, 2, timeout_s=60, deadline_s=120)
    assert e.value.rank == 1
    assert time.monotonic() - t0 < 55  # rank 0, blocked in all_reduce, was stopped


@pytest.fixture
def member():
    """Rank 1 in a child process; rank 0 is the test's own process."""
    procs = []

    def start(action: str) -> tuple[ProcessGroup, mp.Process]:
        address = GroupAddress.free_loopback()
        p = mp.get_context("spawn").Process(target=ranks.member_process,
                                            args=(1, 2, address.host, address.port, action), daemon=True)
        p.start()
        procs.append(p)
        return ProcessGroup(0, 2, address, timeout_s=5), p

    yield start
    for p in procs:
        p.kill()
        p.join()


def test_collective_with_a_dead_member_raises(member):
    group, proc = member("die")
    group.barrier()
    proc.join(60)
    assert proc.exitcode == 3
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="rank 0 of 2: all_reduce failed"):
        group.all_reduce(torch.ones(8))
    assert time.monotonic() - t0 < 30


def test_collective_with_a_hung_member_times_out(member):
    group, proc = member("hang")
    group.barrier()
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="5s"):
        group.all_gather(torch.ones(8))
    assert 4 <= time.monotonic() - t0 < 60  # the group's 5 s timeout, not forever
    assert proc.is_alive()


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="rank"):
        ProcessGroup(2, 2, GroupAddress.free_loopback())
    with pytest.raises(ValueError, match="world_size"):
        launch(ranks.collectives, 0)


@pytest.mark.parametrize("native", [False, True], ids=["python", "cpp"])
def test_shm_all_reduce_sums_like_gloo_and_gives_every_rank_the_same_bits(native):
    if native and not layer_op.available():
        pytest.skip("the C++ decoder layer's library does not build here")
    out = launch(ranks.shm_sums, 3, args=(native,), timeout_s=60, deadline_s=180)
    for o in out:
        assert o["small"] == [6.0, 30.0]  # (1 + 2 + 3), (0 + 10 + 20)
        assert o["close"]
        assert o["ints"] == [6]
        assert o["gathered"] == [[0.0, 1.0, 2.0]]
        assert o["by_cols"] and o["by_rows"]  # gathers through the slots, in several calls
        assert o["bf16"] == pytest.approx([0.6] * 5, abs=0.01)
    for r, o in enumerate(out):
        assert o["half"] == [[float(r)] * 8] * 4  # only the contiguous copy was summed
    assert out[0]["bits"] == out[1]["bits"] == out[2]["bits"]  # rank order on every rank



@pytest.mark.parametrize("native", [False, True], ids=["python", "cpp"])
def test_shm_all_reduce_with_a_dead_peer_fails_at_once(native):
    if native and not layer_op.available():
        pytest.skip("the C++ decoder layer's library does not build here")
    address = GroupAddress.free_loopback()
    proc = mp.get_context("spawn").Process(target=ranks.member_process,
                                           args=(1, 2, address.host, address.port, "shm_die"), daemon=True)
    proc.start()
    try:
        group = ProcessGroup(0, 2, address, timeout_s=60)
        shm = ShmAllReduce(group)
        if native:  # its wait sleeps on a futex: still woken to look at the peer's pid
            shm.attach(layer_op.shm_sums(shm))
        assert shm.all_reduce(torch.ones(4)).tolist() == [2.0] * 4
        proc.join(60)
        assert proc.exitcode == 3
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match=r"rank 0 of 2: all_reduce failed: rank 1 \(pid \d+\) is gone"):
            shm.all_reduce(torch.ones(4))
        assert time.monotonic() - t0 < 30  # its pid was checked: not the group's 60 s timeout
    finally:
        proc.kill()
        proc.join()


def test_a_group_on_one_host_meets_in_a_private_store_file(tmp_path):
    """The rendezvous store tells ranks where their peers' gloo listens: one
    that others could write (a TCPStore on loopback) lets any local process
    put itself between the ranks. Launched groups meet in a 0700 folder's
    file, and a folder open to others is refused."""
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o755)
    open_folder.chmod(0o755)
    with pytest.raises(ValueError, match="open to other users"):
        GroupAddress.in_folder(open_folder)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert GroupAddress.in_folder(private).store_file == str(private / "group-store")
    out = launch(ranks.collectives, 2, timeout_s=60, deadline_s=120)
    assert len(out) == 2
