"""Pipeline-parallel stages: which contiguous layers each of N stages holds,
and how a stage's activations travel to the next (no model code).

    pp_layer_range(num_layers, rank, size)   [start, end) of stage ``rank``, as vLLM's get_pp_indices:
                                             L // N layers each, the remainder one more each to the
                                             stages just before the last (the last also runs the lm_head)
    PPStage(rank, size, start, end)          one process's place: ``first`` embeds, ``last`` norms,
                                             projects and samples
    send_tensor(sock, seq, t) / recv_tensor(sock)
                                             one [T, hidden] tensor over a ZeroMQ socket (ipc://): a small
                                             header (step, micro-batch, shape, dtype) and the raw bytes,
                                             sent without a copy
"""
from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq


def pp_layer_range(num_layers: int, rank: int, size: int) -> tuple[int, int]:
    """Layers [start, end) of stage ``rank`` of ``size``; ValueError when a stage would get none."""
    if not 0 <= rank < size:
        raise ValueError(f"pipeline stage {rank} of {size} is not a valid place")
    if num_layers < size:
        raise ValueError(f"pipeline_parallel_size {size}: the model has only {num_layers} layers "
                         "(each stage needs at least one)")
    parts = [num_layers // size] * size
    for i in range(2, num_layers % size + 2):  # the remainder to the stages before the last
        parts[-i] += 1
    start = sum(parts[:rank])
    return start, start + parts[rank]


@dataclass(frozen=True, slots=True)
class PPStage:
    """This process's stage: layers [start, end) of the model's, stage ``rank`` of ``size``."""

    rank: int = 0
    size: int = 1
    start: int = 0
    end: int = 0
    # The last stage holds the token embedding too where a draft head drafts
    # there (it looks up each draft it feeds back).
    head_embeds: bool = False

    @staticmethod
    def of(num_layers: int, rank: int, size: int) -> PPStage:
        return PPStage(rank, size, *pp_layer_range(num_layers, rank, size))

    @property
    def first(self) -> bool:
        """Holds the token embedding (and takes token ids)."""
        return self.rank == 0

    @property
    def embeds(self) -> bool:
        """Holds the token embedding (the first stage; the last with a draft head)."""
        return self.first or self.head_embeds

    @property
    def last(self) -> bool:
        """Holds the final norm and the lm_head (and samples)."""
        return self.rank == self.size - 1

    def owns(self, layer: int) -> bool:
        return self.start <= layer < self.end


def send_tensor(sock: zmq.Socket, tag: tuple[int, int], tensor: torch.Tensor) -> None:
    """``tensor`` (CPU) to the peer; ``tag``: (step, micro-batch), checked on receipt.
    The bytes go without a copy: pyzmq keeps the array alive until sent."""
    t = tensor.detach().contiguous()
    header = pickle.dumps((tag, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
    sock.send_multipart([header, t.view(torch.uint8).numpy()], copy=False)  # bytes of any dtype (bf16 too)


def recv_tensor(sock: zmq.Socket, tag: tuple[int, int], timeout_ms: int,
                alive: Callable[[], None] | None = None) -> torch.Tensor:
    """The next tensor from the peer, which must carry ``tag``. Waits in
    slices of ``timeout_ms``, calling ``alive()`` between them (it raises
    when the group has failed), so a dead peer never leaves it hanging."""
    while not sock.poll(timeout_ms):
        if alive is not None:
            alive()
    header, data = sock.recv_multipart(copy=False)
    got, shape, dtype = pickle.loads(header.bytes)
    if got != tag:
        raise RuntimeError(f"pipeline stages out of step: expected micro-batch {tag}, received {got}")
    # bytearray: writable memory of our own, not the message's buffer
    return torch.frombuffer(bytearray(data.buffer), dtype=getattr(torch, dtype)).view(shape)
