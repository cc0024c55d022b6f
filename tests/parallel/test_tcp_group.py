"""TcpGroup (the ranks' collectives across nodes) and the CURVE guard on the
ranks' tcp:// sockets, over real ZeroMQ sockets: sums and gathers agree on
every rank, bit for bit, in rank order; a peer without the socket secret
(a foreign CURVE key, or plain tcp) gets no frame through to rank 0, and
the group's result is untouched by it; a member that never answers fails
the collective in time, naming it."""
from __future__ import annotations

import threading

import pytest
import torch
import zmq

from kvferry.parallel import CollectiveError
from kvferry.parallel.rank_sockets import RankKeys
from kvferry.parallel.tcp_group import TcpGroup


def _members(hub: TcpGroup, world: int, body) -> dict:
    results, errors = {}, []

    def run(rank: int) -> None:
        group = TcpGroup.member(rank, world, hub.address, hub.timeout_s)
        try:
            results[rank] = body(group)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)
        finally:
            group.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(1, world)]
    for t in threads:
        t.start()
    results[0] = body(hub)
    for t in threads:
        t.join(30)
    assert not errors, errors
    return results


def _collectives(group: TcpGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(group.rank)
    x = torch.randn(3, 257)
    summed = group.all_reduce(x.clone())
    biggest = group.all_reduce(torch.tensor([float(group.rank)]), op="max")
    gathered = group.all_gather(torch.full((2, 1), float(group.rank)), dim=1)
    return summed, biggest, gathered


def test_sums_and_gathers_agree_bit_for_bit_in_rank_order():
    hub = TcpGroup.hub(3, "127.0.0.1", 30)
    try:
        results = _members(hub, 3, _collectives)
    finally:
        hub.close()
    parts = []
    for r in range(3):
        torch.manual_seed(r)
        parts.append(torch.randn(3, 257))
    expected = parts[0].clone().add_(parts[1]).add_(parts[2])
    for rank, (summed, biggest, gathered) in results.items():
        assert torch.equal(summed, expected), rank
        assert biggest.tolist() == [2.0]
        assert gathered.tolist() == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]


def test_a_peer_without_the_socket_secret_gets_nothing_through():
    hub = TcpGroup.hub(2, "127.0.0.1", 30)
    ctx = zmq.Context()
    try:
        public, secret = zmq.curve_keypair()  # a foreign key pair that knows rank 0's public key
        foreign = ctx.socket(zmq.DEALER)
        foreign.curve_secretkey, foreign.curve_publickey = secret, public
        foreign.curve_serverkey = RankKeys.of_tree().public
        plain = ctx.socket(zmq.DEALER)  # no CURVE at all
        for sock in (foreign, plain):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, b"1")  # posing as rank 1
            sock.connect(hub.address)
            sock.send_multipart([b"\x80\x04N.", torch.full((4,), 1e9).numpy()])
        results = _members(hub, 2, lambda g: g.all_reduce(torch.ones(4)))
        assert all(r.tolist() == [2.0] * 4 for r in results.values()), results
    finally:
        hub.close()
        ctx.destroy(linger=0)


def test_a_silent_member_fails_the_collective_in_time():
    hub = TcpGroup.hub(2, "127.0.0.1", 1.0)
    try:
        with pytest.raises(CollectiveError, match="all_reduce"):
            hub.all_reduce(torch.ones(2))
    finally:
        hub.close()
