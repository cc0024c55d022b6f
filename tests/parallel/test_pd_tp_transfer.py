"""The KV transfer between pools of different tensor-parallel sizes, on real
sockets and real shared memory: prefill "ranks" (one link each, as each
rank's sender has its own) send a decode core of N ranks (rank 0's
receiver, every rank's pool in shared memory) exactly the heads each rank
holds. The decode core completes a transfer, and acknowledges it, only once
every head of every block of every layer landed, even when rank 0's Done
overtakes another rank's chunks; a piece that is not one rank's heads is
dropped, and a rank that never sends fails the transfer at its deadline."""
from __future__ import annotations

import time

import pytest
import torch
import zmq

from kvferry.disagg.heads import covers, dst_rank_of, head_slices, rank_heads
from kvferry.disagg.transport import (
    KVReceiver, KVTransport, SharedKVPool, ShmTransport, TcpTransport, rank_pool_name,
)
from kvferry.messages import KVLayerChunk, KVTransferDone, encode

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 8, 4, 4, 2
SRC_IDS, DST_IDS = [1, 3, 4, 6], [2, 3, 5, 7]


@pytest.mark.parametrize("heads,a,b", [(4, 1, 1), (4, 2, 1), (4, 1, 2), (4, 2, 2), (8, 2, 4), (8, 4, 2), (8, 1, 8)])
def test_pieces_tile_every_decode_rank_once(heads, a, b):
    pieces = [(p, s) for p in range(a) for s in head_slices(heads, p, a, b)]
    for d in range(b):
        lo, hi = rank_heads(heads, d, b)
        mine = sorted((s.start, s.stop) for _, s in pieces if s.dst_rank == d)
        assert mine[0][0] == lo and mine[-1][1] == hi and all(x[1] == y[0] for x, y in zip(mine, mine[1:]))
        for p, s in pieces:
            if s.dst_rank == d:  # local ranges match the global ones on both sides
                assert (s.src_lo + rank_heads(heads, p, a)[0], s.dst_lo + lo) == (s.start, s.start)
                assert dst_rank_of(heads, b, s.start, s.stop) == d
    if a == b:  # rank to rank: one piece each, every head on both sides
        assert all(s.dst_rank == p and s.src_lo == 0 and s.num_heads == heads // a for p, s in pieces)


def test_covers():
    assert covers([(2, 4), (0, 2)], 4) and covers([(0, 3), (1, 4)], 4)
    assert not covers([(0, 1), (2, 4)], 4) and not covers([(0, 3)], 4) and not covers([], 1)


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="do not split"):
        head_slices(6, 0, 4, 1)
    assert dst_rank_of(4, 2, 1, 3) is None  # spans ranks 0 and 1


@pytest.fixture
def full() -> torch.Tensor:
    """Every head of the model's KV: [layers, 2, blocks, bs, heads, dim]."""
    return torch.randn(LAYERS, 2, BLOCKS, BS, HEADS, DIM, generator=torch.Generator().manual_seed(0))


class DecodeCore:
    """A decode core of ``size`` ranks: rank 0's pool and receiver, and the
    other ranks' pools, in shared memory as a tensor-parallel core has them."""

    def __init__(self, size: int) -> None:
        shape = (LAYERS, 2, BLOCKS, BS, HEADS // size, DIM)
        self.pools = [SharedKVPool.create(shape, torch.float32)]
        self.pools += [SharedKVPool.create(shape, torch.float32, name=rank_pool_name(self.pools[0].name, r))
                       for r in range(1, size)]
        self.receiver = KVReceiver(self.pools[0].tensor, "tcp://127.0.0.1:0",
                                   rank_pools=[p.tensor for p in self.pools[1:]])
        self.size = size

    def heads(self) -> torch.Tensor:
        return torch.cat([p.tensor for p in self.pools], dim=4)  # rank order is head order

    def close(self) -> None:
        self.receiver.close()
        for pool in self.pools:
            pool.close()


def _link(transport: str, core: DecodeCore) -> KVTransport:
    ctx = zmq.Context.instance()
    if transport == "tcp":
        return TcpTransport(ctx, core.receiver.address)
    shape = (LAYERS, 2, BS, HEADS // core.size, DIM)
    pools = [SharedKVPool.attach(rank_pool_name(core.pools[0].name, d), shape, torch.float32)
             for d in range(core.size)]
    return ShmTransport(ctx, core.receiver.address, pools)


def _send_layers(link: KVTransport, full: torch.Tensor, rank: int, size: int, dst_size: int) -> None:
    lo, hi = rank_heads(HEADS, rank, size)
    mine = full[..., lo:hi, :].contiguous()  # this prefill rank's pool
    for layer in range(LAYERS):
        for piece in head_slices(HEADS, rank, size, dst_size):
            link.write_layer("t", layer, mine[layer], SRC_IDS, DST_IDS, len(SRC_IDS), piece)


def _done(num_ranks: int) -> KVTransferDone:
    return KVTransferDone(transfer_id="t", num_layers=LAYERS, block_ids=DST_IDS, output_token_ids=[7],
                          num_ranks=num_ranks)


def _wait(predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("a,b", [(2, 1), (1, 2), (2, 2), (1, 4), (4, 2)])
def test_every_decode_rank_gets_its_heads_even_when_the_done_comes_first(transport, a, b, full):
    core = DecodeCore(b)
    links = [_link(transport, core) for _ in range(a)]
    try:
        core.receiver.expect("r", "t", DST_IDS, time.monotonic() + 60)
        _send_layers(links[0], full, 0, a, b)
        links[0].send_done(_done(a))  # before the other ranks sent anything
        if a > 1:
            time.sleep(0.3)
            assert links[0].poll_acks() == [] and core.receiver.take()[0] == {}  # not whole yet: no word
            for rank in range(1, a):
                _send_layers(links[rank], full, rank, a, b)
        acks = _wait(links[0].poll_acks)
        assert [(x.ok, x.reason) for x in acks] == [(True, "")]
        done, failed, _ = core.receiver.take()
        assert list(done) == ["r"] and not failed and done["r"].output_token_ids == [7]
        assert torch.equal(core.heads()[:, :, DST_IDS], full[:, :, SRC_IDS])
    finally:
        for link in links:
            link.close()
        core.close()


def test_a_rank_that_never_sends_fails_the_transfer_at_its_deadline(full):
    core = DecodeCore(1)
    links = [_link("shm", core) for _ in range(2)]
    try:
        core.receiver.grace_s = 0.0
        core.receiver.expect("r", "t", DST_IDS, time.monotonic() + 1.0)
        _send_layers(links[0], full, 0, 2, 1)  # rank 1's heads never come
        links[0].send_done(_done(2))
        assert _wait(lambda: core.receiver.take()[1], timeout_s=10) == {"r": "timeout"}
    finally:
        for link in links:
            link.close()
        core.close()


def test_pieces_that_are_not_one_ranks_heads_are_dropped(full):
    """Heads spanning two decode ranks, and a whole-pool chunk (no heads
    named) sent to a core of two ranks, land nowhere: the transfer stays
    incomplete, and a one-rank prefill's Done then fails it at once."""
    core = DecodeCore(2)
    link = TcpTransport(zmq.Context.instance(), core.receiver.address)
    try:
        core.receiver.expect("r", "t", DST_IDS, time.monotonic() + 60)
        before = core.heads().clone()
        for layer in range(LAYERS):
            link.write_framed("t", layer, full[layer, :, :, :, 1:3].contiguous(), SRC_IDS, DST_IDS, len(SRC_IDS))
            link.sock.send_multipart([link.token, encode(KVLayerChunk(
                transfer_id="t", layer=layer, block_ids=DST_IDS, has_payload=True, head_start=1, head_stop=3,
                num_final_blocks=len(SRC_IDS), checksum=0)), bytes(2 * 4 * BS * 2 * DIM * 4)])
        link.send_done(_done(1))
        acks = _wait(link.poll_acks)
        assert [(x.ok, x.reason) for x in acks] == [(False, "incomplete: a layer is missing blocks")]
        assert torch.equal(core.heads(), before)
    finally:
        link.close()
        core.close()

