"""Moving one layer of KV blocks from a prefill core's pool into a decode
core's pool, and the decode core's receiving end.

The pool layout is the project's one layout,
``kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
so a layer's blocks travel as ``[2, n, block_size, num_kv_heads, head_dim]``
with no reshaping on either side.

Every link has a control channel: a ZeroMQ DEALER on the prefill side
connected to the decode core's ROUTER (its ``KVDestination.address``).
The messages on it are ``messages.KVWire``: a ``KVLayerChunk`` per layer
written, then one ``KVTransferDone``; the decode core answers one
``KVTransferAck``.

Transports (``KVTransport``, the sending half):

* ``ShmTransport``: the decode core's pool lives in a named shared-memory
  segment (``SharedKVPool``); the prefill core maps it and copies each layer
  straight into the destination blocks, then says so on the control
  channel. One host only.
* ``TcpTransport``: each layer's bytes follow its ``KVLayerChunk`` as a
  second frame; the decode core's receiver thread copies them into its pool.

Every message on a control channel starts with a token frame
(``peer_auth.token(KV_TRANSFER)``, from the secret both cores inherit from
the front end that started them, or derive from the same cache secret
file): the receiver drops a message without it unread, so no other process
can write into the pool or fail a transfer. The receiving socket caps each
frame at what a transfer can need (``max_frame_bytes``: one whole layer of
its pool, or a header); libzmq drops a larger frame, and the connection
that sent it, before allocating it.

What a stranger on the transfer port gets: nothing. KV only ever flows
from a prefill core's DEALER into the decode core's ROUTER, and the ROUTER
sends only an acknowledgement, only to the peer that sent an authenticated
``KVTransferDone``; a message without the token is dropped before it is
decoded. The decode core binds the interface of its
``--kv-transfer-address`` only; a wildcard address (0.0.0.0, ::) is
refused unless ``--kv-transfer-bind-any`` (``bind_address``). Over shared
memory the KV crosses no socket; the pool's segment is created 0600, so
only its user maps it. The TCP frames are not encrypted: across an
untrusted network, run the link inside one (a VPN, an IPsec or WireGuard
tunnel), since a sniffer of the link reads the KV and the token.

Seam for NIXL or Mooncake's Transfer Engine: a third ``KVTransport`` whose
constructor registers both pools with the engine (NIXL ``register_memory``
/ Mooncake ``register_memory`` of the pool tensor, with D's descriptors
exchanged once, e.g. in ``KVDestination`` as an opaque blob beside
``shm_name``), whose ``write_layer`` posts one RDMA write per block
(``src block b -> dst block dst_block_ids[i]``, addresses computed from the
layout above) without waiting, and whose ``send_done`` first waits for the
writes' completion notifications, then sends ``KVTransferDone`` on the
control channel. The receiver, the checksum and the lease rules stay as they
are: D verifies its own pool, whatever wrote it. Such a transport on
Mooncake's Transfer Engine over its TCP transport was built and measured
(commit 5899e5a, BENCHMARKS.md): no faster than ``TcpTransport`` on one
host, since the pool's layer-major blocks make one small write per block
per layer (6 KiB, 30-50 us each); its case is RDMA.
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch
import xxhash
import zmq

from kvferry import peer_auth
from kvferry.messages import KVLayerChunk, KVTransferAck, KVTransferDone, KVWire, decode, encode
from kvferry.model.kv_cache_dtype import index_copy_into
from kvferry.shm_segments import unlink_dead_segments

logger = logging.getLogger(__name__)

_POLL_MS = 50
# A header frame holds at most a list of block ids (msgpack: at most 9
# bytes an id) besides a bounded rest: a few tokens, a generator state
# (5 KB on CPU), one hidden-state vector.
_HEADER_BYTES_PER_BLOCK = 9
_HEADER_SLACK_BYTES = 4 << 20
# What a prefill core accepts back: acknowledgements, a few hundred bytes.
_MAX_ACK_BYTES = 1 << 20
_SHM_DIR = Path("/dev/shm")
_POOL_PREFIX = "kvferry-kvpool-"


def chunk_checksum(data: torch.Tensor, num_blocks: int) -> int:
    """xxh3-64 of the first ``num_blocks`` blocks of a gathered layer
    ``data: [2, n, block_size, H, D]`` (contiguous): K of each block, then V
    of each. Two hash calls over contiguous memory, on the sender while the
    gathered bytes are still in cache."""
    h = xxhash.xxh3_64()
    for kv in data[:, :num_blocks]:  # [num_blocks, bs, H, D], contiguous
        h.update(_as_bytes(kv))
    return h.intdigest()


def pool_checksum(pool_layer: torch.Tensor, block_ids: list[int]) -> int:
    """``chunk_checksum`` of blocks ``block_ids`` read in place from a pool
    layer ``[2, num_blocks, bs, H, D]``: one hash update per contiguous run
    of blocks, with no gather copy."""
    if pool_layer.device.type != "cpu":
        index = torch.tensor(block_ids, dtype=torch.int64, device=pool_layer.device)
        return chunk_checksum(pool_layer.index_select(1, index).cpu(), len(block_ids))
    runs = block_runs(block_ids)
    h = xxhash.xxh3_64()
    for kv in pool_layer.view(torch.uint8).numpy():  # [num_blocks, bs, H, D * elem], bytes
        for _, first, count in runs:
            h.update(kv[first : first + count])
    return h.intdigest()


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids: ``(position in block_ids, first id,
    count)``; a run of blocks is one contiguous range of a pool layer."""
    return [(pos, block_ids[pos], count) for pos, count in _run_bounds(np.asarray(block_ids, dtype=np.int64))]


def paired_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs where both ``src_ids`` and ``dst_ids`` are consecutive:
    ``(first src id, first dst id, count)``, each one contiguous copy."""
    src, dst = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    return [(src_ids[pos], dst_ids[pos], count) for pos, count in _run_bounds(src, dst)]


def _run_bounds(*ids: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of the maximal stretches where every array steps by
    one (vectorized: called per layer, so a Python loop over blocks would
    cost a third of a shared-memory transfer)."""
    n = len(ids[0])
    if n == 0:
        return []
    step = np.ones(n - 1, dtype=bool)
    for a in ids:
        step &= np.diff(a) == 1
    starts = [0, *(np.flatnonzero(~step) + 1).tolist()]
    return [(start, end - start) for start, end in zip(starts, [*starts[1:], n])]


def gather_blocks(pool_layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """[2, n, bs, H, D], contiguous, from a pool layer [2, num_blocks, bs, H, D]."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=pool_layer.device)
    return pool_layer.index_select(1, index)


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


# Per-run copies (and per-run hash updates) beat a gather-scatter kernel
# while the blocks form a few contiguous ranges, the usual case in a pool
# that is not fragmented; past this many runs, gather once.
_MAX_RUN_COPIES = 8


# -- the decode core's pool in shared memory -------------------------------------------
class SharedKVPool:
    """A KV pool tensor over a named shared-memory segment.

    The decode core creates it (and unlinks it on ``close``); a prefill core
    on the same host attaches by name and writes into it. A pool made with
    ``create`` is zero-filled (fresh shared memory is)."""

    def __init__(self, tensor: torch.Tensor, name: str, shm: shared_memory.SharedMemory | None = None,
                 mapping: mmap.mmap | None = None) -> None:
        self.tensor = tensor  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.name = name
        self._shm = shm  # set on the creating side, which unlinks it
        self._mapping = mapping  # set on an attaching side

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype) -> "SharedKVPool":
        """A new segment named after this process (``kvferry-kvpool-<pid>-<random>``),
        after unlinking the segments of pools whose creator is gone."""
        remove_stale_pools()
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        name = f"{_POOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        return cls(torch.frombuffer(shm.buf, dtype=dtype).view(shape), shm.name, shm=shm)

    @classmethod
    def attach(cls, name: str, block_shape: tuple[int, ...], dtype: torch.dtype) -> "SharedKVPool":
        """Map another core's pool; ``block_shape`` is
        ``(num_layers, 2, block_size, kv_heads, head_dim)`` (both cores serve
        one model, so only the block count differs). Mapped from /dev/shm
        directly: ``SharedMemory(name)`` would also register the segment with
        Python's resource tracker (< 3.13), which unlinks it when this
        process exits, though it is the decode core's."""
        with open(f"/dev/shm/{name.lstrip('/')}", "r+b") as f:
            mapping = mmap.mmap(f.fileno(), 0)
        elem = torch.empty((), dtype=dtype).element_size()
        per_block = int(np.prod(block_shape)) * elem
        num_blocks = len(mapping) // per_block
        layers, two, *rest = block_shape
        flat = torch.frombuffer(mapping, dtype=dtype, count=num_blocks * per_block // elem)
        return cls(flat.view(layers, two, num_blocks, *rest), name, mapping=mapping)

    def close(self) -> None:
        self.tensor = None  # drop the view before the buffer goes
        try:
            if self._shm is not None:
                self._shm.unlink()  # first: close() refuses while a view is alive
                self._shm.close()
            elif self._mapping is not None:
                self._mapping.close()
        except BufferError:
            pass  # a view is still alive somewhere; the OS unmaps at exit
        except FileNotFoundError:
            pass


def remove_stale_pools(directory: Path = _SHM_DIR) -> list[str]:
    """Unlink the pool segments of decode cores that are gone without
    cleaning up (SIGKILL, OOM: a ``close`` that never ran)."""
    removed = unlink_dead_segments(directory, _POOL_PREFIX)
    if removed:
        logger.warning("removed %d KV pool segment(s) left by dead processes: %s", len(removed), removed)
    return removed


# -- sending half ------------------------------------------------------------------------
class KVTransport(ABC):
    """The prefill side of one link to a decode core.

    Contract: calls come from one thread (the agent's sender thread),
    ``close`` included (the socket is a ZeroMQ DEALER), in transfer order.
    ``write_layer`` may return before the bytes land, but everything a link
    wrote is in the destination pool before the decode core handles the
    ``KVTransferDone`` that ``send_done`` sends next. ``write_layer`` reads
    the source blocks before it returns (the caller may reuse them
    afterwards). ``poll_acks`` never blocks."""

    def __init__(self, ctx: zmq.Context, address: str, token: bytes | None = None) -> None:
        self.address = address
        # Presented with every message (None: this process tree's).
        self.token = peer_auth.token(peer_auth.KV_TRANSFER) if token is None else token
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, _MAX_ACK_BYTES)
        if _is_ipv6(address):
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.connect(address)

    @abstractmethod
    def write_layer(self, transfer_id: str, layer: int, src_layer: torch.Tensor, src_block_ids: list[int],
                    dst_block_ids: list[int], num_final_blocks: int) -> None:
        """Send blocks ``src_block_ids`` of ``src_layer: [2, num_blocks,
        block_size, kv_heads, head_dim]`` (this core's pool) into the decode
        core's ``dst_block_ids`` of layer ``layer``. The first
        ``num_final_blocks`` are final: checksummed here (while the bytes are
        in cache) and verified by the decode core as they land."""

    def write_framed(self, transfer_id: str, layer: int, src_layer: torch.Tensor, src_block_ids: list[int],
                     dst_block_ids: list[int], num_final_blocks: int) -> None:
        """``write_layer`` with the bytes as a second frame after the chunk
        header (zero-copy), whatever the link: the TCP transport, and a
        draft model's layers, whose pool is not in shared memory."""
        payload = gather_blocks(src_layer, src_block_ids).cpu()  # [2, n, bs, H, D]
        header = KVLayerChunk(transfer_id=transfer_id, layer=layer, block_ids=dst_block_ids, has_payload=True,
                              num_final_blocks=num_final_blocks, checksum=chunk_checksum(payload, num_final_blocks))
        # Zero-copy: the frame keeps ``payload`` alive until ZeroMQ sent it
        # (the numpy view holds the tensor).
        self.sock.send_multipart([self.token, encode(header), _as_bytes(payload)], copy=False)

    def send_message(self, message: KVLayerChunk | KVTransferDone) -> None:
        """One message with no payload frame, after the token."""
        self.sock.send_multipart([self.token, encode(message)])

    def send_done(self, done: KVTransferDone) -> None:
        self.send_message(done)

    def poll_acks(self) -> list[KVTransferAck]:
        acks = []
        while self.sock.poll(0):
            message = decode(self.sock.recv(), KVWire)
            if isinstance(message, KVTransferAck):
                acks.append(message)
        return acks

    def close(self) -> None:
        self.sock.close(linger=0)


class TcpTransport(KVTransport):
    """Layer bytes as a second frame after the chunk header (zero-copy)."""

    def write_layer(self, transfer_id: str, layer: int, src_layer: torch.Tensor, src_block_ids: list[int],
                    dst_block_ids: list[int], num_final_blocks: int) -> None:
        self.write_framed(transfer_id, layer, src_layer, src_block_ids, dst_block_ids, num_final_blocks)


class ShmTransport(KVTransport):
    """Copies each layer straight into the decode core's pool (same host):
    one ``copy_`` per run of blocks consecutive on both sides, or, for a
    fragmented request, one gather here and one scatter there."""

    def __init__(self, ctx: zmq.Context, address: str, pool: SharedKVPool, token: bytes | None = None) -> None:
        super().__init__(ctx, address, token)
        self.pool = pool

    def write_layer(self, transfer_id: str, layer: int, src_layer: torch.Tensor, src_block_ids: list[int],
                    dst_block_ids: list[int], num_final_blocks: int) -> None:
        dst_layer = self.pool.tensor[layer]  # [2, num_blocks, bs, H, D], the decode core's
        runs = paired_runs(src_block_ids, dst_block_ids)
        if len(runs) <= _MAX_RUN_COPIES:
            checksum = pool_checksum(src_layer, src_block_ids[:num_final_blocks])
            for s, d, n in runs:
                dst_layer[:, d : d + n].copy_(src_layer[:, s : s + n])
        else:
            data = gather_blocks(src_layer, src_block_ids)  # [2, n, bs, H, D]
            checksum = chunk_checksum(data, num_final_blocks)  # before the scatter: the bytes are hot
            write_blocks(dst_layer, dst_block_ids, data)
        self.send_message(KVLayerChunk(transfer_id=transfer_id, layer=layer, block_ids=dst_block_ids,
                                       num_final_blocks=num_final_blocks, checksum=checksum))

    def close(self) -> None:
        super().close()
        self.pool.close()


def write_blocks(pool_layer: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
    """pool_layer: [2, num_blocks, bs, H, D]; data: [2, n, bs, H, D] into
    blocks ``block_ids``: one copy per contiguous run of destination blocks
    while there are few runs, else one scatter."""
    runs = block_runs(block_ids)
    if len(runs) <= _MAX_RUN_COPIES:
        for pos, first, count in runs:
            pool_layer[:, first : first + count].copy_(data[:, pos : pos + count])
        return
    index = torch.tensor(block_ids, dtype=torch.int64, device=pool_layer.device)
    index_copy_into(pool_layer, 1, index, data.to(pool_layer.device))


# -- receiving half ----------------------------------------------------------------------
def max_frame_bytes(layers: list[torch.Tensor]) -> int:
    """The largest frame a transfer into pool ``layers`` (each ``[2,
    num_blocks, bs, H, D]``) can need: a layer's payload covers distinct
    blocks of the pool, so at most the whole layer; a header, at most every
    block id of the pool and a bounded rest."""
    layer_bytes = max((t.numel() * t.element_size() for t in layers), default=0)
    num_blocks = max((t.shape[1] for t in layers), default=0)
    return max(layer_bytes, _HEADER_BYTES_PER_BLOCK * num_blocks + _HEADER_SLACK_BYTES)


@dataclass(slots=True)
class _Expected:
    request_id: str
    block_ids: list[int]
    deadline: float
    # layer -> decode-core block ids whose final bytes landed and checked out
    verified: dict[int, set[int]] = field(default_factory=dict)
    error: str = ""  # the first chunk that failed its checksum


@dataclass(slots=True)
class Received:
    """What came with a transfer's Done: the prefill core's tokens and
    sampling state. Kept for a transfer whose KV failed verification too:
    they were computed from the prefill core's own intact KV, so the decode
    core recomputes only the prompt's KV and continues after them."""

    output_token_ids: list[int]
    generator_state: bytes
    # Method "head": the prefill core's last hidden state (raw bytes, dtype
    # name), verified against its checksum; b"" without one.
    hidden_state: bytes = b""
    hidden_state_dtype: str = ""


def hidden_state_checksum(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def bind_address(address: str, bind_any: bool) -> tuple[str, str]:
    """(where the receiving socket binds, what senders are told) for a
    transfer address. A tcp:// one binds its own host's interface; with
    ``bind_any`` every interface (``*``: dual-stack when the host is an IPv6
    one), while senders are still told the host given, or this host's name
    when that is a wildcard. A wildcard without ``bind_any`` is refused: a
    KV port open on every network is a decision, not a default."""
    if not address.startswith("tcp://"):
        return address, address
    host, _, port = address[len("tcp://"):].rpartition(":")
    wildcard = host in ("0.0.0.0", "::", "[::]", "*", "")
    if wildcard and not bind_any:
        raise ValueError(f"kv_transfer_address {address!r} listens on every interface: give this node's own "
                         "address, or pass --kv-transfer-bind-any to open it on all of them on purpose")
    if not bind_any:
        return address, address
    return f"tcp://*:{port}", f"tcp://{socket.gethostname() if wildcard else host}:{port}"


def _is_ipv6(address: str) -> bool:
    """tcp://[v6 address]:port or tcp://:::port: the socket needs ZMQ_IPV6."""
    return address.startswith(("tcp://[", "tcp://::"))


class KVReceiver:
    """The decode core's transfer socket (ROUTER) and a thread serving it.

    ``expect`` registers a transfer before its destination is published;
    chunks of unknown transfers are dropped unread (a transfer that timed
    out can never write again over TCP). Each chunk is verified as it lands
    (its final blocks' xxh3-64 equals the sender's: over the frame's bytes
    before they are copied in, for TCP; read back from the pool, for shared
    memory), on this thread while the sender writes the next layer, so a
    ``KVTransferDone`` only checks that every layer verified every block.
    ``take`` hands out verified and failed
    transfers once each; a transfer past its deadline (plus ``grace_s``, for
    a shared-memory write that began just before it) fails as "timeout".

    The socket is created and bound by the constructor, then used and
    closed by the thread only: a socket closed while the thread is inside
    ``poll`` aborts the process in libzmq (``pfd.revents & POLLIN``)."""

    def __init__(self, kv_cache: torch.Tensor, address: str, grace_s: float = 0.5,
                 draft_kv_cache: torch.Tensor | None = None, speculative: str = "",
                 token: bytes | None = None, bind_any: bool = False) -> None:
        """``address``: tcp://HOST:PORT (port 0 or *: a free one) or
        ipc://PATH. The socket binds to HOST's interface only; a wildcard
        HOST (0.0.0.0, ::, *) is refused unless ``bind_any``, which binds
        every interface and advertises HOST (this host's name for a
        wildcard) in ``address``."""
        self.kv_cache = kv_cache
        # Every layer a transfer fills, each [2, num_blocks, bs, H, D]: the
        # target's, then the draft model's (its own head count and size,
        # indexed by the same block ids).
        self.layers: list[torch.Tensor] = [*kv_cache, *(draft_kv_cache if draft_kv_cache is not None else [])]
        self.speculative = speculative  # this core's speculation signature
        self.grace_s = grace_s
        # What every sender must present (None: this process tree's).
        self.token = peer_auth.token(peer_auth.KV_TRANSFER) if token is None else token
        self.max_frame_bytes = max_frame_bytes(self.layers)
        self.num_refused = 0  # messages dropped for a missing or wrong token
        bind, advertised = bind_address(address, bind_any)  # ValueError before any socket exists
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Before bind: libzmq checks each frame's size in its header and
        # drops the connection of a peer that sends more, without reading it.
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        if _is_ipv6(address):
            self._sock.setsockopt(zmq.IPV6, 1)
        if bind.startswith("tcp://") and bind.rsplit(":", 1)[-1] in ("0", "*"):
            port = self._sock.bind_to_random_port(bind.rsplit(":", 1)[0])
            bind, advertised = (f"{a.rsplit(':', 1)[0]}:{port}" for a in (bind, advertised))
        else:
            self._sock.bind(bind)
        self.bound_address = bind  # the interface(s) listened on
        self.address = advertised  # what senders connect to (KVDestination.address)
        self._lock = threading.Lock()
        self._expected: dict[str, _Expected] = {}
        self._done: dict[str, Received] = {}  # request id ->
        self._failed: dict[str, str] = {}  # request id -> reason
        # request id -> tokens of a transfer whose KV failed verification
        self._failed_received: dict[str, Received] = {}
        self.num_blocks_written = 0  # block-layers written into the pool, all transfers
        self._event = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-receiver", daemon=True)
        self._thread.start()

    def expect(self, request_id: str, transfer_id: str, block_ids: list[int], deadline: float) -> None:
        with self._lock:
            self._expected[transfer_id] = _Expected(request_id, list(block_ids), deadline)

    def take(self) -> tuple[dict[str, Received], dict[str, str], dict[str, Received]]:
        """(verified, failed: reason, tokens that came with failed ones)."""
        now = time.monotonic()
        with self._lock:
            for tid, exp in list(self._expected.items()):
                if now > exp.deadline + self.grace_s:
                    del self._expected[tid]
                    self._failed[exp.request_id] = "timeout"
            done, self._done = self._done, {}
            failed, self._failed = self._failed, {}
            failed_received, self._failed_received = self._failed_received, {}
            self._event.clear()
        return done, failed, failed_received

    def wait(self, timeout_s: float) -> None:
        """Sleep until a transfer completes or fails, at most ``timeout_s``."""
        self._event.wait(timeout_s)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._expected)

    def _serve(self) -> None:
        try:
            self._serve_until_stopped()
        finally:
            self._sock.close(linger=0)  # on its one thread (see the class docstring)

    def _serve_until_stopped(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS):
                continue
            frames = self._sock.recv_multipart(copy=False)
            # [identity, token, header] or [identity, token, header, payload]
            if len(frames) < 3 or not peer_auth.check(frames[1].bytes, self.token):
                self._refuse(frames[0].bytes)
                continue
            identity, body = frames[0].bytes, frames[2].bytes
            try:
                message = decode(body, KVWire)
                if isinstance(message, KVLayerChunk):
                    self._on_chunk(message, frames[3].buffer if message.has_payload else None)
                elif isinstance(message, KVTransferDone):
                    ack = self._on_done(message)
                    self._sock.send_multipart([identity, encode(ack)])
            except Exception:  # a bad peer must not take the decode core down
                logger.exception("dropped a malformed KV transfer message")

    def _refuse(self, identity: bytes) -> None:
        """A message without the transfer token: dropped unread, counted."""
        self.num_refused += 1
        level = logging.WARNING if self.num_refused == 1 or self.num_refused % 1000 == 0 else logging.DEBUG
        logger.log(level, "dropped a KV transfer message without a valid token (peer %s; %d so far)",
                   identity.hex(), self.num_refused)

    def _on_chunk(self, chunk: KVLayerChunk, payload: memoryview | None) -> None:
        with self._lock:
            exp = self._expected.get(chunk.transfer_id)
            if (exp is None or exp.error or not 0 <= chunk.layer < len(self.layers)
                    or not set(chunk.block_ids) <= set(exp.block_ids)):
                return  # unknown, expired, failed, or not this transfer's layers and blocks
        # Outside the lock: the copy and the hash must not stall ``take``.
        pool_layer = self.layers[chunk.layer]  # [2, num_blocks, bs, H, D]
        final = chunk.block_ids[:chunk.num_final_blocks]
        if payload is not None:
            shape = (2, len(chunk.block_ids), *pool_layer.shape[2:])
            data = torch.frombuffer(payload, dtype=pool_layer.dtype).view(shape)  # [2, n, bs, H, D]
            # The bytes as they came off the wire, hashed contiguously before
            # the copy into the pool reads them (still in cache).
            ok = chunk_checksum(data, len(final)) == chunk.checksum
            if ok:
                write_blocks(pool_layer, chunk.block_ids, data)
        else:  # written in place by the sender: read back what landed
            ok = not final or pool_checksum(pool_layer, final) == chunk.checksum
        with self._lock:
            if not ok:
                exp.error = exp.error or f"checksum mismatch in layer {chunk.layer}"
            exp.verified.setdefault(chunk.layer, set()).update(final)
            self.num_blocks_written += len(chunk.block_ids)

    def _on_done(self, done: KVTransferDone) -> KVTransferAck:
        with self._lock:
            exp = self._expected.pop(done.transfer_id, None)
        if exp is None:
            return KVTransferAck(transfer_id=done.transfer_id, ok=False, reason="unknown or expired transfer")
        reason = self._verify(exp, done)
        with self._lock:
            if reason:
                self._failed[exp.request_id] = reason
                if not done.error and done.output_token_ids:
                    self._failed_received[exp.request_id] = Received(list(done.output_token_ids),
                                                                     done.generator_state)
            else:
                self._done[exp.request_id] = Received(list(done.output_token_ids), done.generator_state,
                                                      done.hidden_state, done.hidden_state_dtype)
            self._event.set()
        return KVTransferAck(transfer_id=done.transfer_id, ok=not reason, reason=reason)

    def _verify(self, exp: _Expected, done: KVTransferDone) -> str:
        """'' when the pool holds exactly what the sender computed (each
        chunk was checked as it landed)."""
        if done.error:
            return f"the prefill core gave up: {done.error}"
        if done.speculative != self.speculative:
            return (f"speculative configurations differ: the prefill core runs {done.speculative or 'none'!r}, "
                    f"this core {self.speculative or 'none'!r} (start both with the same --speculative-config)")
        if exp.error:
            return exp.error
        if done.hidden_state and hidden_state_checksum(done.hidden_state) != done.hidden_state_checksum:
            return "checksum mismatch in the hidden state"
        num_layers = len(self.layers)
        if done.num_layers != num_layers or done.block_ids != exp.block_ids:
            return "the transfer does not match its destination"
        want = set(exp.block_ids)
        if any(exp.verified.get(layer) != want for layer in range(num_layers)):
            return "incomplete: a layer is missing blocks"
        if not done.output_token_ids:
            return "incomplete: no first token"
        return ""

    def close(self) -> None:
        """Stop the thread, which closes the socket as it exits. If it is
        stuck (a long copy into the pool), it closes it when it gets out;
        closing it from here could abort the process."""
        self._stop.set()
        self._thread.join(_POLL_MS / 1000 + 2)
        if self._thread.is_alive():
            logger.warning("KV receiver thread did not stop within %.1f s", _POLL_MS / 1000 + 2)
