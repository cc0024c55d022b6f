"""Who may write into a decode core's pool, and how much: a sender without
the transfer token is refused (its chunks and its Done are dropped unread,
the transfer it aimed at still completes for the right sender), and a
frame larger than any transfer can need is dropped by the socket without
the receiving process growing, while the receiver keeps serving. Real
receiver threads and processes, real sockets, real shared memory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import zmq

from kvferry import peer_auth
from kvferry.disagg.transport import KVReceiver, SharedKVPool, ShmTransport, TcpTransport, max_frame_bytes
from kvferry.messages import KVLayerChunk, KVTransferDone, encode

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 40, 4, 2, 8
SHAPE = (LAYERS, 2, BLOCKS, BS, HEADS, DIM)
BLOCK_SHAPE = (LAYERS, 2, BS, HEADS, DIM)
MIB = 1 << 20


def await_ack(link, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        acks = link.poll_acks()
        if acks:
            return acks[0]
        link.sock.poll(10)
    return None


def send_transfer(link, src, transfer_id, src_ids, dst_ids):
    for layer in range(LAYERS):
        link.write_layer(transfer_id, layer, src[layer], src_ids, dst_ids, len(dst_ids))
    link.send_done(KVTransferDone(transfer_id=transfer_id, num_layers=LAYERS, block_ids=dst_ids,
                                  output_token_ids=[7]))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_sender_without_the_token_is_refused_and_the_right_one_still_lands(transport):
    src = torch.randn(SHAPE).to(torch.bfloat16)
    pool = SharedKVPool.create(SHAPE, torch.bfloat16)
    receiver = KVReceiver(pool.tensor, "tcp://127.0.0.1:0")
    ctx = zmq.Context.instance()

    def link(token=None):
        if transport == "shm":
            return ShmTransport(ctx, receiver.address, SharedKVPool.attach(pool.name, BLOCK_SHAPE, torch.bfloat16),
                                token=token)
        return TcpTransport(ctx, receiver.address, token=token)

    wrong = link(token=b"\0" * peer_auth.TOKEN_BYTES)
    other_purpose = TcpTransport(ctx, receiver.address, token=peer_auth.token(peer_auth.KVSTORE))
    right = link()
    try:
        src_ids, dst_ids = [3, 4, 5], [10, 11, 12]
        receiver.expect("r", "t1", dst_ids, time.monotonic() + 30)
        # An intruder claims the transfer (bytes over tcp; over shm it can
        # only say what it wrote), then tries to end it early: neither the
        # chunks nor the Done are read, so the transfer neither verifies
        # from them nor fails.
        garbage = torch.randn(SHAPE).to(torch.bfloat16)
        send_transfer(wrong, garbage, "t1", src_ids, dst_ids)
        other_purpose.send_done(KVTransferDone(transfer_id="t1", num_layers=0, block_ids=[], output_token_ids=[],
                                               error="aborted"))
        assert await_ack(wrong, 1.0) is None and await_ack(other_purpose, 0.2) is None
        assert receiver.num_refused >= LAYERS + 2
        done, failed, _ = receiver.take()
        assert not done and not failed and receiver.num_pending == 1
        if transport == "tcp":  # nothing of the intruder's bytes reached the pool
            assert not pool.tensor.any()
        # The right sender's transfer completes, verified.
        send_transfer(right, src, "t1", src_ids, dst_ids)
        ack = await_ack(right)
        assert ack is not None and ack.ok, ack
        assert torch.equal(pool.tensor[:, :, dst_ids], src[:, :, src_ids])
        done, failed, _ = receiver.take()
        assert done["r"].output_token_ids == [7] and not failed
    finally:
        for l in (wrong, other_purpose, right):
            l.close()
        receiver.close()
        pool.close()


def test_the_frame_cap_is_what_a_transfer_can_need():
    target = torch.zeros(SHAPE, dtype=torch.bfloat16)
    layer_bytes = 2 * BLOCKS * BS * HEADS * DIM * 2
    assert max_frame_bytes(list(target)) == 9 * BLOCKS + (4 << 20)  # a small pool: a header bounds it
    big = torch.zeros(2, 2, 5000, 16, 8, 64, dtype=torch.bfloat16)  # 2 layers of 5000 blocks of 16 tokens
    assert max_frame_bytes(list(big)) == 2 * 5000 * 16 * 8 * 64 * 2  # one whole layer of the pool
    receiver = KVReceiver(target, "tcp://127.0.0.1:0")
    try:
        assert receiver.max_frame_bytes == max(layer_bytes, 9 * BLOCKS + (4 << 20))
    finally:
        receiver.close()


_RECEIVER = """
import json, sys, time, torch
from kvferry.disagg.transport import KVReceiver
shape = {shape!r}
pool = torch.zeros(shape, dtype=torch.bfloat16)
receiver = KVReceiver(pool, "tcp://127.0.0.1:0")
receiver.expect("r", "t", [1, 2], time.monotonic() + 120)
print(receiver.address, flush=True)
deadline = time.monotonic() + 120
done = failed = {{}}
while time.monotonic() < deadline and not (done or failed):
    receiver.wait(0.1)
    done, failed, _ = receiver.take()
expected = (torch.arange(pool[:, :, :2].numel()) % 251).to(torch.bfloat16).view(pool[:, :, :2].shape)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({{"done": sorted(done), "failed": failed, "peak_kb": int(status["VmHWM"].split()[0]),
                  "landed": bool(torch.equal(pool[:, :, 1:3], expected))}}), flush=True)
receiver.close()
"""


def peak_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return int(status["VmHWM"].split()[0])


def test_an_oversized_frame_is_dropped_without_the_receiver_growing_and_it_keeps_serving():
    peer_auth.socket_secret()  # the receiver process inherits it, as a core does from its front end
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_RECEIVER.format(shape=SHAPE))],
                             stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context.instance()
    try:
        address = child.stdout.readline().strip()
        time.sleep(0.5)  # the receiver's thread and imports settle: its peak now is its baseline
        before = peak_kb(child.pid)
        # A sender with the right token and a plausible header, whose
        # payload frame is 256 MiB (zeros: free to send from here).
        big = TcpTransport(ctx, address)
        header = KVLayerChunk(transfer_id="t", layer=0, block_ids=[1, 2], has_payload=True, num_final_blocks=2)
        frame = np.zeros(256 * MIB, dtype=np.uint8)
        big.sock.send_multipart([big.token, encode(header), memoryview(frame)], copy=False)
        time.sleep(2.0)  # long enough to have read it all, had it been read
        assert peak_kb(child.pid) - before < 64 * 1024, "the receiver allocated the oversized frame"
        big.close()
        # The receiver keeps serving: a right-sized transfer lands, verified.
        src = torch.zeros(SHAPE, dtype=torch.bfloat16)
        src[:, :, 5:7] = (torch.arange(src[:, :, 5:7].numel()) % 251).to(torch.bfloat16).view(src[:, :, 5:7].shape)
        link = TcpTransport(ctx, address)
        send_transfer(link, src, "t", [5, 6], [1, 2])
        ack = await_ack(link, 30)
        link.close()
        assert ack is not None and ack.ok, ack
        result = json.loads(child.stdout.readline())
        assert result["done"] == ["r"] and not result["failed"] and result["landed"]
        assert result["peak_kb"] - before < 64 * 1024
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
