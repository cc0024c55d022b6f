"""Collectives for ranks on different nodes (a TP group that Ray spread),
over ZeroMQ tcp:// with CURVE (rank_sockets.py): the cluster transport
where shared memory and a host-local gloo rendezvous cannot reach.

    hub = TcpGroup.hub(world_size, host, timeout_s, alive)   # rank 0: binds tcp://host:*; hub.address
    group = TcpGroup.member(rank, world_size, hub.address, timeout_s)   # ranks 1..N-1 connect

A star through rank 0, as the ranks are few (CPU TP 2..4): each rank sends
its tensor to rank 0, which reduces them in rank order and sends the
result back, so every rank gets the same bits whatever the tensor's shape
(as ShmAllReduce: x = t0 + t1 + ...). ``all_gather`` concatenates in rank
order the same way. Every call carries its sequence number: a reply to an
earlier call is an error, never a wrong sum.

Bounded like ProcessGroup: rank 0 calls ``alive()`` (its leader's check:
it raises once a rank is gone) between slices of its wait, and every rank
fails with CollectiveError once ``timeout_s`` passes.
"""
from __future__ import annotations

import pickle
import time
from collections.abc import Callable

import torch
import zmq

from kvferry.parallel.group import CollectiveError
from kvferry.parallel.rank_sockets import RankKeys

_SLICE_MS = 200
_OPS = {"sum": torch.Tensor.add_, "max": lambda a, b: torch.maximum(a, b, out=a),
        "min": lambda a, b: torch.minimum(a, b, out=a), "product": torch.Tensor.mul_}


class TcpGroup:
    """This rank's membership; ``all_reduce`` and ``all_gather`` as ProcessGroup's."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, alive: Callable[[], None] | None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.rank, self.world_size, self.timeout_s, self._alive = rank, world_size, timeout_s, alive
        self._ctx = zmq.Context()
        self._keys = RankKeys.of_tree()
        self._guard = None
        self._seq = 0
        self.address = ""

    @classmethod
    def hub(cls, world_size: int, host: str, timeout_s: float, alive: Callable[[], None] | None = None) -> TcpGroup:
        self = cls(0, world_size, timeout_s, alive)
        self._guard = self._keys.guard(self._ctx)
        self._sock = self._keys.server(self._ctx.socket(zmq.ROUTER))
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        return self

    @classmethod
    def member(cls, rank: int, world_size: int, address: str, timeout_s: float) -> TcpGroup:
        self = cls(rank, world_size, timeout_s, None)
        self._sock = self._keys.client(self._ctx.socket(zmq.DEALER))
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IDENTITY, str(rank).encode())
        self._sock.connect(address)
        self.address = address
        return self

    # -- collectives -------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        try:
            combine = _OPS[op]
        except KeyError:
            raise ValueError(f"op must be one of {', '.join(_OPS)}, got {op!r}") from None

        def reduce(parts: list[torch.Tensor]) -> torch.Tensor:
            out = parts[0].clone()
            for part in parts[1:]:  # rank order: the same result on every rank
                combine(out, part)
            return out

        result = self._exchange("all_reduce", tensor.contiguous(), reduce)
        tensor.copy_(result.view(tensor.shape))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._exchange("all_gather", tensor.contiguous(), lambda parts: torch.cat(parts, dim=dim))

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._guard is not None:
            self._guard.stop()
        self._ctx.term()

    # -- the star ----------------------------------------------------------------------
    def _exchange(self, name: str, t: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        self._seq += 1
        header = pickle.dumps((name, self._seq))
        if self.rank != 0:
            self._sock.send_multipart([header, _bytes(t)], copy=False)
            (got, result), data = self._recv(name)
            return _tensor(data, t.dtype, result)
        parts: list[torch.Tensor | None] = [t] + [None] * (self.world_size - 1)
        while any(p is None for p in parts):
            peer, (got, _), data = self._recv(name)
            rank = int(peer)
            if not 0 < rank < self.world_size or parts[rank] is not None:
                raise CollectiveError(f"rank 0 of {self.world_size}: {name}: unexpected part from rank {rank}")
            parts[rank] = _tensor(data, t.dtype, tuple(t.shape))
        out = combine(parts).contiguous()  # type: ignore[arg-type]
        reply = pickle.dumps((self._seq, tuple(out.shape)))
        for rank in range(1, self.world_size):
            self._sock.send_multipart([str(rank).encode(), reply, _bytes(out)], copy=False)
        return out

    def _recv(self, name: str):  # noqa: ANN202 - (peer?, header, data)
        deadline = time.monotonic() + self.timeout_s
        while not self._sock.poll(_SLICE_MS):
            if self._alive is not None:
                self._alive()
            if time.monotonic() > deadline:
                raise CollectiveError(f"rank {self.rank} of {self.world_size}: {name} failed (a member did not "
                                      f"answer within {self.timeout_s:g}s)")
        frames = self._sock.recv_multipart()
        peer, (header, data) = (frames[0], frames[1:]) if self.rank == 0 else (None, frames)
        got = pickle.loads(header)  # from a CURVE-authenticated peer only (rank_sockets.py)
        seq = got[1] if self.rank == 0 else got[0]
        if seq != self._seq:
            raise CollectiveError(f"rank {self.rank} of {self.world_size}: {name} #{self._seq} got call #{seq}'s data")
        if self.rank == 0:
            return peer.decode(), got, data
        return got, data


def _bytes(t: torch.Tensor):  # noqa: ANN202 - a numpy view, sent without a copy
    return t.view(torch.uint8).numpy() if t.dtype != torch.bool else t.numpy()


def _tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
