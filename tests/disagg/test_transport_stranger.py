"""A stranger on a decode core's KV transfer port: raw ZeroMQ peers that
forge frames (no token, a wrong one, a token-sized guess, a bare Done) and
one that only listens, plus a raw TCP client, get nothing out and put
nothing in; a real transfer afterwards lands, verified. And the socket
binds the interface it is given: a wildcard address is refused unless
asked for. Real receiver thread, real sockets."""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import zmq

from kvferry import peer_auth
from kvferry.config import EngineArgs, KVTransferConfig
from kvferry.disagg.transport import KVReceiver, TcpTransport, bind_address
from kvferry.messages import KVLayerChunk, KVTransferDone, encode
from tests.disagg.test_transport_auth import LAYERS, SHAPE, await_ack, send_transfer


def silent_for(sock: zmq.Socket, seconds: float) -> bool:
    """True when nothing arrives on ``sock`` for ``seconds``."""
    return not sock.poll(int(seconds * 1000))


def forged(transfer_id: str, dst_ids: list[int], payload: bytes) -> list[list[bytes]]:
    """Messages a stranger may try, each with what it hopes passes for a token."""
    chunk = encode(KVLayerChunk(transfer_id=transfer_id, layer=0, block_ids=dst_ids, has_payload=True,
                                num_final_blocks=len(dst_ids), checksum=0))
    done = encode(KVTransferDone(transfer_id=transfer_id, num_layers=LAYERS, block_ids=dst_ids,
                                 output_token_ids=[1]))
    guess = os.urandom(peer_auth.TOKEN_BYTES)
    return [
        [chunk, payload],                      # no token frame at all: the header where the token goes
        [guess, chunk, payload],               # a token-sized guess
        [b"", chunk, payload],                 # an empty token
        [peer_auth.token(peer_auth.KV_TRANSFER)[:-1], done],  # a truncated token (a prefix of the real one)
        [guess, done],                         # a bare Done: would end the transfer, and earn an ack
        [done],
        [b"garbage"],
    ]


def test_a_stranger_can_neither_inject_nor_read_and_a_real_transfer_lands_after(tmp_path):
    pool = torch.zeros(SHAPE, dtype=torch.bfloat16)
    receiver = KVReceiver(pool, "tcp://127.0.0.1:0")
    ctx = zmq.Context.instance()
    injector, listener = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock in (injector, listener):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(receiver.address)
    raw = socket.create_connection(("127.0.0.1", int(receiver.address.rsplit(":", 1)[1])), timeout=2)
    right = TcpTransport(ctx, receiver.address)
    try:
        src_ids, dst_ids = [3, 4, 5], [10, 11, 12]
        receiver.expect("r", "t1", dst_ids, time.monotonic() + 30)
        layer_bytes = pool[0][:, dst_ids].numel() * pool.element_size()
        messages = forged("t1", dst_ids, b"\xff" * layer_bytes)
        for frames in messages:
            injector.send_multipart(frames)
        listener.send_multipart([os.urandom(peer_auth.TOKEN_BYTES), messages[4][1]])  # a Done, to earn an ack
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\xff" * 4096)  # not even ZeroMQ
        deadline = time.monotonic() + 10
        while receiver.num_refused < len(messages) + 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert receiver.num_refused == len(messages) + 1  # each forged message, dropped unread
        # Nothing landed, nothing failed, nothing answered: the transfer still waits for its sender.
        assert not pool.any()
        done, failed, _ = receiver.take()
        assert not done and not failed and receiver.num_pending == 1
        assert silent_for(injector, 0.3) and silent_for(listener, 0.3)

        # The real sender's transfer lands, verified, while the strangers listen.
        src = torch.randn(SHAPE).to(torch.bfloat16)
        send_transfer(right, src, "t1", src_ids, dst_ids)
        ack = await_ack(right)
        assert ack is not None and ack.ok, ack
        assert torch.equal(pool[:, :, dst_ids], src[:, :, src_ids])
        done, failed, _ = receiver.take()
        assert done["r"].output_token_ids == [7] and not failed
        # Neither ZeroMQ stranger saw a byte of it, nor its acknowledgement.
        assert silent_for(injector, 0.3) and silent_for(listener, 0.3)
        # The raw client got at most ZeroMQ's greeting (64 bytes), then was dropped: no KV.
        raw.settimeout(3)
        seen = b""
        try:
            while chunk := raw.recv(65536):
                seen += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        assert len(seen) <= 64, seen
        assert src[:, :, src_ids].view(torch.uint8).numpy().tobytes()[:16] not in seen
        # A second real transfer over the same link still works.
        receiver.expect("r2", "t2", [20, 21], time.monotonic() + 30)
        send_transfer(right, src, "t2", [6, 7], [20, 21])
        ack = await_ack(right)
        assert ack is not None and ack.ok and torch.equal(pool[:, :, [20, 21]], src[:, :, [6, 7]])
    finally:
        raw.close()
        for sock in (injector, listener):
            sock.close(linger=0)
        right.close()
        receiver.close()


def _non_loopback_ip() -> str | None:
    """An address of this host on another interface (none in a bare sandbox)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def test_the_socket_binds_only_the_interface_it_is_given():
    pool = torch.zeros(SHAPE, dtype=torch.bfloat16)
    for address in ("tcp://0.0.0.0:0", "tcp://[::]:0", "tcp://*:0"):
        with pytest.raises(ValueError, match="--kv-transfer-bind-any"):
            KVReceiver(pool, address)
        with pytest.raises(ValueError, match="--kv-transfer-bind-any"):
            KVTransferConfig(kv_transfer_address=address.replace(":0", ":5600"))
    with pytest.raises(ValueError, match="--kv-transfer-bind-any"):
        EngineArgs(kv_transfer_address="tcp://0.0.0.0:5600")
    with pytest.raises(ValueError, match="tcp://host:port"):
        KVTransferConfig(kv_transfer_address="tcp://10.0.0.5")
    assert KVTransferConfig(kv_transfer_address="tcp://0.0.0.0:5600", kv_transfer_bind_any=True)
    assert EngineArgs(kv_transfer_address="tcp://0.0.0.0:5600", kv_transfer_bind_any=True)
    # bind-any binds every interface, and tells senders the host given (or this host's name)
    assert bind_address("tcp://10.0.0.5:5600", True) == ("tcp://*:5600", "tcp://10.0.0.5:5600")
    assert bind_address("tcp://0.0.0.0:5600", True) == ("tcp://*:5600", f"tcp://{socket.gethostname()}:5600")
    assert bind_address("tcp://10.0.0.5:5600", False) == ("tcp://10.0.0.5:5600",) * 2
    assert bind_address("ipc:///tmp/x", False) == ("ipc:///tmp/x",) * 2

    other = _non_loopback_ip()
    loopback = KVReceiver(pool, "tcp://127.0.0.1:0")
    anywhere = KVReceiver(pool, "tcp://0.0.0.0:0", bind_any=True)
    try:
        port, any_port = (int(r.address.rsplit(":", 1)[1]) for r in (loopback, anywhere))
        assert anywhere.bound_address == f"tcp://*:{any_port}"
        assert anywhere.address == f"tcp://{socket.gethostname()}:{any_port}"
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        socket.create_connection(("127.0.0.1", any_port), timeout=2).close()
        if other is not None:  # the loopback-bound port is closed on the host's other interface
            with pytest.raises(OSError):
                socket.create_connection((other, port), timeout=2).close()
            socket.create_connection((other, any_port), timeout=2).close()
        # a transfer through the wildcard-bound socket lands
        src = torch.randn(SHAPE).to(torch.bfloat16)
        anywhere.expect("r", "t", [1, 2], time.monotonic() + 30)
        link = TcpTransport(zmq.Context.instance(), f"tcp://127.0.0.1:{any_port}")
        try:
            send_transfer(link, src, "t", [8, 9], [1, 2])
            ack = await_ack(link)
            assert ack is not None and ack.ok, ack
        finally:
            link.close()
    finally:
        loopback.close()
        anywhere.close()


def test_a_shared_memory_pool_is_readable_by_its_owner_only():
    """Over shm the KV never crosses a socket; the segment is the pool, so
    another user of the host must not be able to map it."""
    from kvferry.disagg.transport import SharedKVPool

    pool = SharedKVPool.create(SHAPE, torch.bfloat16)
    try:
        mode = os.stat(f"/dev/shm/{pool.name.lstrip('/')}").st_mode & 0o777
        assert mode == 0o600, oct(mode)
    finally:
        pool.close()
