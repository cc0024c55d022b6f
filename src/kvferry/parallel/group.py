"""A group of rank processes on one host and its collectives.

It wraps torch.distributed's gloo process group, built as an object
(``ProcessGroupGloo(store, rank, size, timeout)``), not as torch's
process-wide default group: an engine core can then hold a TP group and an
EP group side by side, and tests can build groups in any process. Gloo
moves CPU tensors over TCP between the ranks (loopback here); a CUDA build
would put NCCL behind the same methods.

The rendezvous store is where the ranks learn each other's gloo addresses,
so whoever can write it can put itself between them. Ranks on one host
therefore meet in a ``FileStore`` in their launcher's private folder (0700:
no other user reaches it); a ``TCPStore``, which any local process can
connect to, is only for ranks that do not share a folder.

Every collective is bounded by the group's ``timeout_s``: a rank that died
closes its sockets and its peers fail at once ("connection closed by
peer"); a rank that hangs (stopped, stuck) makes them fail when the timeout
expires. Either way the caller gets a ``CollectiveError`` naming the
collective and the rank, never a hang: a group lives and dies whole
(DESIGN.md), so its launcher (launch.py) then ends the other ranks.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}


class CollectiveError(RuntimeError):
    """A collective failed: a member of the group died, hung past the
    timeout, or the group could not form."""


@dataclass(frozen=True, slots=True)
class GroupAddress:
    """Where the group's rendezvous store is: a file (``store_file``, ranks
    on one host) or a TCP listener that rank 0 hosts (``host``, ``port``)."""
    host: str = ""
    port: int = 0
    store_file: str = ""

    @staticmethod
    def in_folder(folder: str | os.PathLike) -> GroupAddress:
        """A store file in ``folder``, which must be private to this user
        (a launcher's ``mkdtemp``) and empty of a previous group's store."""
        mode = os.stat(folder).st_mode
        if mode & 0o077:
            raise ValueError(f"group store folder {folder} is open to other users (mode {mode & 0o777:o})")
        return GroupAddress(store_file=os.path.join(folder, "group-store"))

    @staticmethod
    def free_loopback() -> GroupAddress:
        """An address on 127.0.0.1 whose port was free a moment ago (any
        local process can reach it: prefer ``in_folder`` on one host)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return GroupAddress("127.0.0.1", s.getsockname()[1])

    def describe(self) -> str:
        return self.store_file or f"{self.host}:{self.port}"


class ProcessGroup:
    """This process's membership of one group: ``rank`` of ``world_size``.

    Collectives act on CPU tensors and return their result; ``all_reduce``
    works in place (as torch's). Every rank must call the same collectives
    in the same order with tensors of the same shapes and dtype.
    """

    def __init__(self, rank: int, world_size: int, address: GroupAddress, timeout_s: float = 60.0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.rank, self.world_size, self.address, self.timeout_s = rank, world_size, address, timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if address.store_file:
                self._store = dist.FileStore(address.store_file, world_size)
                self._store.set_timeout(timeout)
            else:  # rank 0 listens; the others connect, each waiting up to the timeout
                self._store = dist.TCPStore(address.host, address.port, world_size, rank == 0, timeout=timeout)
            self._pg = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)
        except Exception as e:  # a rank that never came, a port already taken
            raise CollectiveError(f"rank {rank}: the group of {world_size} at {address.describe()} "
                                  f"did not form within {timeout_s:g}s: {e}") from e

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Every rank's ``tensor`` reduced elementwise (in place; also returned)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = _reduce_op(op)
        self._wait("all_reduce", self._pg.allreduce([tensor], opts))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order."""
        t = tensor.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._wait("all_gather", self._pg.allgather([parts], [t]))
        return torch.cat(parts, dim=dim)

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rows split evenly into ``world_size`` chunks; chunk j goes to rank j,
        and the result holds the chunks received, in rank order (EP's
        dispatch and combine)."""
        if tensor.shape[0] % self.world_size:
            raise ValueError(f"all_to_all: {tensor.shape[0]} rows do not split into {self.world_size} equal chunks")
        t = tensor.contiguous()
        out = torch.empty_like(t)
        self._wait("all_to_all", self._pg.alltoall_base(out, t, [], []))
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s tensor on every rank (in place; also returned)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._wait("broadcast", self._pg.broadcast([tensor], opts))
        return tensor

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        self.all_reduce(torch.zeros(1))

    def store_set(self, key: str, value: str) -> None:
        """A value every rank can read from the group's rendezvous store."""
        self._store.set(key, value)

    def store_get(self, key: str) -> str:
        """``key``'s value, waiting (up to the timeout) until some rank set it."""
        try:
            return self._store.get(key).decode()
        except Exception as e:
            raise CollectiveError(f"rank {self.rank} of {self.world_size}: no {key!r} in the group's store "
                                  f"within {self.timeout_s:g}s: {e}") from e

    def _wait(self, name: str, work: dist.Work) -> None:
        try:
            work.wait()
        except Exception as e:
            raise CollectiveError(f"rank {self.rank} of {self.world_size}: {name} failed (a member died or did "
                                  f"not answer within {self.timeout_s:g}s): {e}") from e


def _reduce_op(op: str) -> dist.ReduceOp:
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"op must be one of {', '.join(_OPS)}, got {op!r}") from None
