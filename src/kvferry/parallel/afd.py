"""The wire of attention/FFN disaggregation: one layer's hidden rows from an
attention core to an FFN worker and back (no model code).

    attention core (DEALER, one per FFN worker)        FFN worker j (ROUTER at ipc://FOLDER/ffn-G-j)
    send_rows(sock, (step, layer, mb), x)  ─────────▶  take_requests(sock): every request waiting,
                                                       from every attention core, in arrival order
    recv_rows(sock, ...) -> (tag, y)       ◀─────────  reply(sock, request, y)

A message is a small pickled header (tag, shape, dtype) and the rows' raw
bytes, sent without a copy, as the pipeline stages' (parallel/pipeline.py).
The sockets live in one 0700 folder, so only this user's processes reach
them (as every other local socket of the project); a worker that Ray
placed also takes cores of other nodes on tcp:// with CURVE
(rank_sockets.py), the same frames. ROUTER/DEALER keep each
attention core's requests apart, and the FFN worker answers each on the
connection it came in on; a reply carries its request's tag back, by
which the core matches it (the answers' order is the worker's batching's).
"""
from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq


def ffn_address(folder: str, index: int, generation: int = 0) -> str:
    """FFN worker ``index``'s socket, of the pool's ``generation`` (a resize
    or a restart starts the next one beside the last: engine/afd_pool.py)."""
    return f"ipc://{folder}/ffn-{generation}-{index}"


def _frames(tag: tuple[int, ...], tensor: torch.Tensor) -> list:
    t = tensor.detach().contiguous()
    header = pickle.dumps((tag, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
    return [header, t.view(torch.uint8).numpy()]  # bytes of any dtype (bf16 too)


def _tensor(header: zmq.Frame, data: zmq.Frame) -> tuple[tuple[int, ...], torch.Tensor]:
    tag, shape, dtype = pickle.loads(header.bytes)
    # bytearray: writable memory of our own, not the message's buffer
    return tag, torch.frombuffer(bytearray(data.buffer), dtype=getattr(torch, dtype)).view(shape)


def send_rows(sock: zmq.Socket, tag: tuple[int, int, int], rows: torch.Tensor) -> None:
    """``rows`` [T, hidden] (CPU) to the FFN worker behind ``sock`` (a DEALER)."""
    sock.send_multipart(_frames(tag, rows), copy=False)


def recv_rows(sock: zmq.Socket, timeout_ms: int, alive: Callable[[], None]) -> tuple[tuple[int, ...], torch.Tensor]:
    """The FFN worker's next answer: (its request's tag, rows). Waits in
    slices of ``timeout_ms``, calling ``alive()`` between them (it raises
    once an FFN worker is gone), so a dead worker never leaves the core
    hanging. Answers may come out of the order asked: the worker batches
    each layer's requests of every core (``take_requests``), so a core's
    request of layer i + 1 may be answered with another core's of that
    layer before its own of layer i."""
    while not sock.poll(timeout_ms):
        alive()
    return _tensor(*sock.recv_multipart(copy=False))


@dataclass(slots=True)
class FFNRequest:
    """One request an FFN worker took: who sent it, its tag (step, layer,
    micro-batch), its rows [T, hidden], and the socket it came in on (a
    worker placed by Ray has two: ipc, and tcp with CURVE)."""

    peer: bytes
    tag: tuple[int, int, int]
    rows: torch.Tensor
    sock: zmq.Socket | None = None

    @property
    def layer(self) -> int:
        return self.tag[1]


def take_requests(sock: zmq.Socket, limit: int = 256) -> list[FFNRequest]:
    """Every request waiting on the FFN worker's ROUTER (up to ``limit``), in arrival order."""
    out: list[FFNRequest] = []
    while len(out) < limit:
        try:
            peer, header, data = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            break
        tag, rows = _tensor(header, data)
        out.append(FFNRequest(peer.bytes, tag, rows, sock))
    return out


def reply(sock: zmq.Socket, request: FFNRequest, rows: torch.Tensor) -> None:
    """``rows``, the answer to ``request``, to the attention core that sent it."""
    sock.send_multipart([request.peer, *_frames(request.tag, rows)], copy=False)
