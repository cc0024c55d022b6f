"""The transfer link on its own: a real ``KVReceiver`` (its socket and
thread) over a real shared-memory pool, fed by ``ShmTransport`` /
``TcpTransport`` from a source pool in this process. Every byte lands where
the block ids say, and a chunk whose bytes differ from its checksum fails
the transfer."""
from __future__ import annotations

import os
import time

import pytest
import torch
import zmq

from kvferry.disagg.transport import (
    KVReceiver, SharedKVPool, ShmTransport, TcpTransport, block_runs, chunk_checksum, gather_blocks, paired_runs,
    pool_checksum,
)
from kvferry.messages import KVLayerChunk, KVTransferDone

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 40, 4, 2, 8
BLOCK_SHAPE = (LAYERS, 2, BS, HEADS, DIM)


@pytest.fixture
def link_pair():
    """(source pool, destination pool, receiver, links by name)."""
    src = torch.randn(LAYERS, 2, BLOCKS, BS, HEADS, DIM).to(torch.bfloat16)
    pool = SharedKVPool.create((LAYERS, 2, BLOCKS, BS, HEADS, DIM), torch.bfloat16)
    receiver = KVReceiver(pool.tensor, "tcp://127.0.0.1:0")
    ctx = zmq.Context.instance()
    links = {"shm": ShmTransport(ctx, receiver.address, SharedKVPool.attach(pool.name, BLOCK_SHAPE, torch.bfloat16)),
             "tcp": TcpTransport(ctx, receiver.address)}
    yield src, pool, receiver, links
    for link in links.values():
        link.close()
    receiver.close()
    pool.close()


def await_ack(link, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        acks = link.poll_acks()
        if acks:
            return acks[0]
        link.sock.poll(10)
    raise AssertionError("no acknowledgement")


def test_runs():
    assert block_runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert paired_runs([1, 2, 3, 7], [10, 11, 20, 21]) == [(1, 10, 2), (3, 20, 1), (7, 21, 1)]


def test_pool_checksum_equals_the_gathered_one():
    layer = torch.randn(2, BLOCKS, BS, HEADS, DIM).to(torch.bfloat16)
    ids = [3, 4, 5, 9, 1, 2]
    gathered = gather_blocks(layer, ids)
    assert pool_checksum(layer, ids[:4]) == chunk_checksum(gathered, 4)
    assert pool_checksum(layer, ids) != pool_checksum(layer, list(reversed(ids)))


# Contiguous: one run (copied run by run); scattered: more runs than the
# shared-memory link copies one by one (gathered, then scattered).
LAYOUTS = {"contiguous": (list(range(2, 14)), list(range(20, 32))),
           "scattered": (list(range(1, 24, 2)), list(range(2, 26, 2))[::-1])}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_transfer_lands_verified(link_pair, transport, layout):
    src, pool, receiver, links = link_pair
    src_ids, dst_ids = LAYOUTS[layout]
    receiver.expect("r", "t1", dst_ids, time.monotonic() + 10)
    link = links[transport]
    for layer in range(LAYERS):
        link.write_layer("t1", layer, src[layer], src_ids, dst_ids, len(dst_ids))
    link.send_done(KVTransferDone(transfer_id="t1", num_layers=LAYERS, block_ids=dst_ids, output_token_ids=[7]))
    ack = await_ack(link)
    assert ack.ok, ack.reason
    s, d = torch.tensor(src_ids), torch.tensor(dst_ids)
    assert torch.equal(pool.tensor[:, :, d], src[:, :, s])
    done, failed, _ = receiver.take()
    assert done["r"].output_token_ids == [7] and not failed


def test_partial_block_is_verified_when_sent_whole(link_pair):
    """A step that computed half of its last block sends it non-final; the
    next step sends it again, final: the transfer verifies."""
    src, pool, receiver, links = link_pair
    link = links["shm"]
    receiver.expect("r", "t2", [5, 6, 7], time.monotonic() + 10)
    partial = src.clone()
    partial[:, :, 11] = 0  # what P's block 11 held after the first step
    for layer in range(LAYERS):
        link.write_layer("t2", layer, partial[layer], [10, 11], [5, 6], 1)
    for layer in range(LAYERS):
        link.write_layer("t2", layer, src[layer], [11, 12], [6, 7], 2)
    link.send_done(KVTransferDone(transfer_id="t2", num_layers=LAYERS, block_ids=[5, 6, 7], output_token_ids=[1]))
    assert await_ack(link).ok
    assert torch.equal(pool.tensor[:, :, 5:8], src[:, :, 10:13])


def test_wrong_checksum_fails_the_transfer(link_pair):
    src, pool, receiver, links = link_pair
    link = links["shm"]
    receiver.expect("r", "t3", [1, 2], time.monotonic() + 10)
    for layer in range(LAYERS):
        link.write_layer("t3", layer, src[layer], [3, 4], [1, 2], 2)
    # Layer 1 again, claiming bytes the pool does not hold.
    link.send_message(KVLayerChunk(transfer_id="t3", layer=1, block_ids=[1, 2], num_final_blocks=2,
                                   checksum=12345))
    link.send_done(KVTransferDone(transfer_id="t3", num_layers=LAYERS, block_ids=[1, 2], output_token_ids=[1]))
    ack = await_ack(link)
    assert not ack.ok and ack.reason == "checksum mismatch in layer 1"
    _, failed, failed_received = receiver.take()
    assert failed == {"r": "checksum mismatch in layer 1"}
    assert failed_received["r"].output_token_ids == [1]  # P's own first token stays usable


def test_missing_layer_is_incomplete(link_pair):
    src, pool, receiver, links = link_pair
    link = links["tcp"]
    receiver.expect("r", "t4", [1, 2], time.monotonic() + 10)
    for layer in range(LAYERS - 1):
        link.write_layer("t4", layer, src[layer], [3, 4], [1, 2], 2)
    link.send_done(KVTransferDone(transfer_id="t4", num_layers=LAYERS, block_ids=[1, 2], output_token_ids=[1]))
    ack = await_ack(link)
    assert not ack.ok and "missing blocks" in ack.reason


def test_pools_of_dead_decode_cores_are_removed(tmp_path):
    """A decode core killed with SIGKILL never unlinks its pool: the next
    pool created on the host removes it, and leaves live ones alone."""
    import subprocess
    import sys
    from pathlib import Path

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(child.stdout)
    stale = Path(f"/dev/shm/kvferry-kvpool-{dead_pid}-deadbeef0000")
    stale.write_bytes(b"\0" * 4096)
    live = SharedKVPool.create((1, 2, 2, BS, HEADS, DIM), torch.float32)
    try:
        assert not stale.exists()
        assert Path(f"/dev/shm/{live.name}").exists() and live.name.startswith(f"kvferry-kvpool-{os.getpid()}-")
        again = SharedKVPool.create((1, 2, 2, BS, HEADS, DIM), torch.float32)  # sweeps, keeps ours
        assert Path(f"/dev/shm/{live.name}").exists()
        again.close()
    finally:
        stale.unlink(missing_ok=True)
        live.close()
    assert not Path(f"/dev/shm/{live.name}").exists()
