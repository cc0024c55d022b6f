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
import socket
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import xxhash
import zmq

from kvferry import peer_auth
from kvferry.disagg.blocks import (  # noqa: F401 - the pool's helpers, importable from here as before
    _MAX_RUN_COPIES, SharedKVPool, _as_bytes, block_runs, chunk_checksum, gather_blocks, gather_heads, paired_runs,
    pool_checksum, rank_pool_name, remove_stale_pools, write_blocks,
)
from kvferry.disagg.heads import HeadSlice, covers, dst_rank_of
from kvferry.spec import shipped
from kvferry.messages import KVLayerChunk, KVTransferAck, KVTransferDone, KVWire, decode, encode

logger = logging.getLogger(__name__)

_POLL_MS = 50
# A header frame holds at most a list of block ids (msgpack: at most 9
# bytes an id) besides a bounded rest: a few tokens, a generator state
# (5 KB on CPU), one hidden-state vector.
_HEADER_BYTES_PER_BLOCK = 9
_HEADER_SLACK_BYTES = 4 << 20
# What a prefill core accepts back: acknowledgements, a few hundred bytes.
_MAX_ACK_BYTES = 1 << 20


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
                    dst_block_ids: list[int], num_final_blocks: int, piece: HeadSlice | None = None) -> None:
        """Send blocks ``src_block_ids`` of ``src_layer: [2, num_blocks,
        block_size, kv_heads, head_dim]`` (this core's pool) into the decode
        core's ``dst_block_ids`` of layer ``layer``. The first
        ``num_final_blocks`` are final: checksummed here (while the bytes are
        in cache) and verified by the decode core as they land. ``piece``:
        only those KV heads, into the decode rank that holds them (pools of
        different tensor-parallel sizes, kvferry.disagg.heads); None: the
        whole layer into a one-rank pool."""

    def write_framed(self, transfer_id: str, layer: int, src_layer: torch.Tensor, src_block_ids: list[int],
                     dst_block_ids: list[int], num_final_blocks: int, piece: HeadSlice | None = None) -> None:
        """``write_layer`` with the bytes as a second frame after the chunk
        header (zero-copy), whatever the link: the TCP transport, and a
        draft model's layers, whose pool is not in shared memory."""
        if piece is None:
            payload = gather_blocks(src_layer, src_block_ids).cpu()  # [2, n, bs, H, D]
        else:
            payload = gather_heads(src_layer, src_block_ids, piece.src_lo, piece.src_hi).cpu()  # [2, n, bs, h, D]
        header = KVLayerChunk(transfer_id=transfer_id, layer=layer, block_ids=dst_block_ids, has_payload=True,
                              num_final_blocks=num_final_blocks, checksum=chunk_checksum(payload, num_final_blocks),
                              **_heads(piece))
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


def _heads(piece: HeadSlice | None) -> dict[str, int]:
    """A chunk header's head range: the piece's global heads, or 0, 0 (all)."""
    return {} if piece is None else {"head_start": piece.start, "head_stop": piece.stop}


class TcpTransport(KVTransport):
    """Layer bytes as a second frame after the chunk header (zero-copy)."""

    def write_layer(self, transfer_id: str, layer: int, src_layer: torch.Tensor, src_block_ids: list[int],
                    dst_block_ids: list[int], num_final_blocks: int, piece: HeadSlice | None = None) -> None:
        self.write_framed(transfer_id, layer, src_layer, src_block_ids, dst_block_ids, num_final_blocks, piece)


class ShmTransport(KVTransport):
    """Copies each layer straight into the decode core's pool (same host):
    one ``copy_`` per run of blocks consecutive on both sides, or, for a
    fragmented request, one gather here and one scatter there. A decode
    core of N tensor-parallel ranks has N pools (``pools[d]``: rank d's); a
    piece of heads is gathered here and scattered into its rank's pool."""

    def __init__(self, ctx: zmq.Context, address: str, pool: SharedKVPool | list[SharedKVPool],
                 token: bytes | None = None) -> None:
        super().__init__(ctx, address, token)
        self.pools = pool if isinstance(pool, list) else [pool]
        self.pool = self.pools[0]

    def write_layer(self, transfer_id: str, layer: int, src_layer: torch.Tensor, src_block_ids: list[int],
                    dst_block_ids: list[int], num_final_blocks: int, piece: HeadSlice | None = None) -> None:
        pool = self.pools[piece.dst_rank if piece is not None else 0]
        dst_layer = pool.tensor[layer]  # [2, num_blocks, bs, H_d, D], the decode rank's
        runs = paired_runs(src_block_ids, dst_block_ids)
        whole = piece is None or (piece.num_heads == src_layer.shape[3] == dst_layer.shape[3])
        if whole and len(runs) <= _MAX_RUN_COPIES:  # rank to rank: every head on both sides
            checksum = pool_checksum(src_layer, src_block_ids[:num_final_blocks])
            for s, d, n in runs:
                dst_layer[:, d : d + n].copy_(src_layer[:, s : s + n])
        elif whole:
            data = gather_blocks(src_layer, src_block_ids)  # [2, n, bs, H, D]
            checksum = chunk_checksum(data, num_final_blocks)  # before the scatter: the bytes are hot
            write_blocks(dst_layer, dst_block_ids, data)
        else:  # a range of heads: contiguous on neither side
            data = gather_heads(src_layer, src_block_ids, piece.src_lo, piece.src_hi)  # [2, n, bs, h, D]
            checksum = chunk_checksum(data, num_final_blocks)
            write_blocks(dst_layer[:, :, :, piece.dst_lo : piece.dst_hi], dst_block_ids, data)
        self.send_message(KVLayerChunk(transfer_id=transfer_id, layer=layer, block_ids=dst_block_ids,
                                       num_final_blocks=num_final_blocks, checksum=checksum, **_heads(piece)))

    def close(self) -> None:
        super().close()
        for pool in self.pools:
            pool.close()


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
    # (layer, first head, end head) -> decode-core block ids whose final
    # bytes of those global KV heads landed and checked out
    verified: dict[tuple[int, int, int], set[int]] = field(default_factory=dict)
    error: str = ""  # the first chunk that failed its checksum
    # A Done that came before some ranks' chunks (a prefill core of several
    # ranks): kept, with its sender's identity, until the last chunk lands.
    done: KVTransferDone | None = None
    identity: bytes = b""


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


_INCOMPLETE = "incomplete: a layer is missing blocks"


def _gather_view(heads: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """[2, n, bs, h, D], contiguous: blocks ``block_ids`` of a head range of a pool layer."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=heads.device)
    return heads.index_select(1, index).contiguous()


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
    ``KVTransferDone`` only checks that every layer verified every block
    (every head of it). A decode core of N tensor-parallel ranks has N pools
    (``rank_pools``: ranks 1..N-1, in shared memory); each chunk names its
    global KV heads and lands in the rank that holds them. Over shared memory
    the prefill ranks wrote each rank's pool directly; over TCP this thread
    copies the payload into it (one socket per core: the ranks' control path
    is rank 0's). A prefill core of several ranks sends from each rank, so
    its Done may overtake another rank's chunks: the transfer then completes
    (and is acknowledged) with the last chunk. ``take`` hands out verified and failed
    transfers once each; a transfer past its deadline (plus ``grace_s``, for
    a shared-memory write that began just before it) fails as "timeout".

    The socket is created and bound by the constructor, then used and
    closed by the thread only: a socket closed while the thread is inside
    ``poll`` aborts the process in libzmq (``pfd.revents & POLLIN``)."""

    def __init__(self, kv_cache: torch.Tensor | list[torch.Tensor], address: str, grace_s: float = 0.5,
                 draft_kv_cache: torch.Tensor | None = None, speculative: str = "",
                 token: bytes | None = None, bind_any: bool = False,
                 rank_pools: list[torch.Tensor] | list[list[torch.Tensor]] | None = None) -> None:
        """``rank_pools``: the pools of this core's tensor-parallel ranks
        1..N-1 (``kv_cache`` is rank 0's), each as ``kv_cache`` (a core of
        pipeline stages too: each rank's layers of every stage, in order).
        ``address``: tcp://HOST:PORT (port 0 or *: a free one) or
        ipc://PATH. The socket binds to HOST's interface only; a wildcard
        HOST (0.0.0.0, ::, *) is refused unless ``bind_any``, which binds
        every interface and advertises HOST (this host's name for a
        wildcard) in ``address``."""
        self.kv_cache = kv_cache
        # Every layer a transfer fills, each [2, num_blocks, bs, H, D]: the
        # target's, then the draft model's (its own head count and size,
        # indexed by the same block ids).
        self.layers: list[torch.Tensor] = [*kv_cache, *(draft_kv_cache if draft_kv_cache is not None else [])]
        # Per tensor-parallel rank, its target layers (rank 0's first).
        self.rank_layers: list[list[torch.Tensor]] = [list(kv_cache), *(list(p) for p in rank_pools or [])]
        self.tp_size = len(self.rank_layers)
        self.num_target_layers = len(kv_cache)  # a tensor, or the layers of a core's pipeline stages in order
        # Heads a layer holds over every rank (a draft layer: its own pool's).
        self.layer_heads = [t.shape[3] * (self.tp_size if i < self.num_target_layers else 1)
                            for i, t in enumerate(self.layers)]
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
                    ack = self._on_done(message, identity)
                    if ack is not None:  # None: it completes with a later chunk
                        self._sock.send_multipart([identity, encode(ack)])
            except Exception:  # a bad peer must not take the decode core down
                logger.exception("dropped a malformed KV transfer message")

    def _refuse(self, identity: bytes) -> None:
        """A message without the transfer token: dropped unread, counted."""
        self.num_refused += 1
        level = logging.WARNING if self.num_refused == 1 or self.num_refused % 1000 == 0 else logging.DEBUG
        logger.log(level, "dropped a KV transfer message without a valid token (peer %s; %d so far)",
                   identity.hex(), self.num_refused)

    def _target(self, chunk: KVLayerChunk) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]] | None:
        """(the rank's pool layer, the chunk's heads of it, the verified key)
        of a chunk, or None when its layer or heads are not this pool's."""
        layer, start, stop = chunk.layer, chunk.head_start, chunk.head_stop
        if not 0 <= layer < len(self.layers):
            return None
        if (start, stop) == (0, 0):  # every head: a one-rank pool (or a draft layer)
            if self.tp_size > 1 and layer < self.num_target_layers:
                return None
            pool_layer = self.layers[layer]
            return pool_layer, pool_layer, (layer, 0, self.layer_heads[layer])
        if layer >= self.num_target_layers:
            return None
        rank = dst_rank_of(self.layer_heads[layer], self.tp_size, start, stop)
        if rank is None:
            return None
        pool_layer = self.rank_layers[rank][layer]  # [2, num_blocks, bs, H / N, D]
        lo = start - rank * pool_layer.shape[3]
        return pool_layer, pool_layer[:, :, :, lo : lo + stop - start], (layer, start, stop)

    def _on_chunk(self, chunk: KVLayerChunk, payload: memoryview | None) -> None:
        target = self._target(chunk)
        with self._lock:
            exp = self._expected.get(chunk.transfer_id)
            if exp is None or exp.error or target is None or not set(chunk.block_ids) <= set(exp.block_ids):
                return  # unknown, expired, failed, or not this transfer's layers, heads and blocks
        # Outside the lock: the copy and the hash must not stall ``take``.
        pool_layer, heads, key = target  # heads: [2, num_blocks, bs, h, D], a view of the rank's layer
        final = chunk.block_ids[:chunk.num_final_blocks]
        if payload is not None:
            shape = (2, len(chunk.block_ids), *heads.shape[2:])
            data = torch.frombuffer(payload, dtype=pool_layer.dtype).view(shape)  # [2, n, bs, h, D]
            # The bytes as they came off the wire, hashed contiguously before
            # the copy into the pool reads them (still in cache).
            ok = chunk_checksum(data, len(final)) == chunk.checksum
            if ok:
                write_blocks(heads, chunk.block_ids, data)
        elif heads.shape[3] == pool_layer.shape[3]:  # written in place, every head: read back what landed
            ok = not final or pool_checksum(pool_layer, final) == chunk.checksum
        else:  # a range of heads written in place: gathered to hash as the sender did
            ok = not final or chunk_checksum(_gather_view(heads, final), len(final)) == chunk.checksum
        with self._lock:
            if not ok:
                exp.error = exp.error or f"checksum mismatch in layer {chunk.layer}"
            exp.verified.setdefault(key, set()).update(final)
            self.num_blocks_written += len(chunk.block_ids)
            pending = exp.done
        if pending is not None:  # the Done came first: this chunk may complete the transfer
            reason = self._verify(exp, pending)
            if reason != _INCOMPLETE:
                ack = self._complete(exp, pending, reason)
                self._sock.send_multipart([exp.identity, encode(ack)])

    def _on_done(self, done: KVTransferDone, identity: bytes = b"") -> KVTransferAck | None:
        with self._lock:
            exp = self._expected.get(done.transfer_id)
        if exp is None:
            return KVTransferAck(transfer_id=done.transfer_id, ok=False, reason="unknown or expired transfer")
        reason = self._verify(exp, done)
        if reason == _INCOMPLETE and done.num_ranks > 1 and not done.error:
            with self._lock:  # other ranks' chunks are still on their way: the last one completes it
                exp.done, exp.identity = done, identity
            return None
        return self._complete(exp, done, reason)

    def _complete(self, exp: _Expected, done: KVTransferDone, reason: str) -> KVTransferAck:
        """Hand the transfer to ``take`` (verified, or failed with ``reason``)."""
        with self._lock:
            if self._expected.get(done.transfer_id) is not exp:  # expired meanwhile (``take``)
                return KVTransferAck(transfer_id=done.transfer_id, ok=False, reason="unknown or expired transfer")
            del self._expected[done.transfer_id]
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
        chunk was checked as it landed); ``_INCOMPLETE`` while a head of a
        block of a layer has not landed."""
        if done.error:
            return f"the prefill core gave up: {done.error}"
        if shipped(done.speculative) != shipped(self.speculative):
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
        whole: list[list[tuple[int, int]]] = [[] for _ in range(num_layers)]
        with self._lock:
            for (layer, start, stop), blocks in exp.verified.items():
                if blocks == want:
                    whole[layer].append((start, stop))
        if not all(covers(whole[layer], self.layer_heads[layer]) for layer in range(num_layers)):
            return _INCOMPLETE
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
