"""``--kv-transport mooncake``: KV written straight into a decode core's pool
by Mooncake's Transfer Engine (imported only when this transport is chosen).

Both cores register their whole pool with an engine of their own
(``MooncakeEngine``, one per core, named ``HOST:PORT`` in the metadata
server of ``--kv-transfer-metadata``). The decode core publishes where its
pool lies (``MooncakePeer``: engine name, base address, strides) once, as
the opaque ``KVDestination.transport_desc`` beside ``shm_name``. The
prefill core's ``MooncakeTransport`` posts, per layer, asynchronous
batches of writes (one per run of blocks consecutive on both sides, K and V
apart) and moves on; it waits for the oldest batch only when the writes
posted to one decode core would pass ``_MAX_SLICES_IN_FLIGHT``, and once a
layer's last batch landed sends its ``KVLayerChunk`` (no payload: the
decode core reads its pool back and checks the sender's checksum, as for
shared memory). ``send_done`` waits for every
batch still posted, then sends ``KVTransferDone`` on the control channel. The
receiver, the checksums and the leases are the other transports'.

Small writes: over TCP each write costs the engine some 30-50 us whatever
its size, so a transfer whose blocks are scattered (a K or V write per
block, a few KiB each in this pool layout) is several times slower than
the framed TCP link. A transfer whose first layer's writes average under
``MooncakeEngine.min_write_bytes`` is therefore sent framed, as by
``TcpTransport``, over the control channel, all of it (a block written both
ways could land out of order); long runs of blocks go by the engine.

Protocol: Mooncake's TCP transport (this build has no RDMA device to use;
RDMA where a NIC exists is a later step: the protocol and device name
passed to ``initialize``). Its listener takes no token: any process that
reaches it and the metadata server can write a registered pool, so run it
on a trusted network only (the decode core still verifies every block it
uses against the prefill core's checksum, sent on the authenticated
control channel).

Late writes: a write is one-sided, so the decode core cannot drop it as it
drops a late TCP chunk. As over shared memory, no layer is posted past the
decode core's deadline, converted to this host's clock (``write_deadline``):
exactly when both cores share a boot (one host), else through both hosts'
wall clocks, which must agree to well under the receiver's grace (0.5 s),
as NTP keeps them.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from kvferry.disagg.transport import KVTransport, paired_runs, pool_checksum
from kvferry.messages import KVLayerChunk, KVTransferDone

logger = logging.getLogger(__name__)

_INSTALL_HINT = "pip install mooncake-transfer-engine (or mooncake-transfer-engine-non-cuda on a host without CUDA)"
# Mooncake's TCP transport cuts writes into 64 KiB slices and fails, rather
# than queues, what passes 1,024 queued per peer (its defaults): each link
# keeps at most this many posted and not yet landed, and no one write
# larger than _MAX_WRITE_BYTES (a long run of blocks is cut).
_SLICE_BYTES = 64 << 10
_MAX_SLICES_IN_FLIGHT = 512
_MAX_WRITE_BYTES = 64 * _SLICE_BYTES
# Below this mean write, the framed link was faster here (BENCHMARKS.md);
# an RDMA transport would want far less.
_MIN_WRITE_BYTES = 128 << 10
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# batch_transfer_async_write's "not posted": 0, or -1 as an unsigned id.
_NOT_POSTED = (0, (1 << 64) - 1, -1)


class MooncakePeer(msgspec.Struct, frozen=True):
    """Where a core's pool lies for a peer's engine (``transport_desc``)."""

    name: str  # the engine's segment name in the metadata server, HOST:PORT
    base: int  # address of kv_cache[0, 0, 0]
    num_layers: int
    num_blocks: int
    layer_stride: int  # bytes, kv_cache[l] -> kv_cache[l + 1]
    kv_stride: int  # bytes, K -> V of one layer
    block_bytes: int  # one block of K (or V) of one layer, contiguous
    boot_id: str  # equal on both sides: one host, one monotonic clock
    wall_minus_monotonic: float  # time.time() - time.monotonic() at registration


def load_transfer_engine() -> Any:
    """``mooncake.engine.TransferEngine``, or a ValueError naming the package."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # a dozen INFO lines per engine otherwise
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ValueError(f"kv_transport mooncake: mooncake.engine cannot load ({exc}): {_INSTALL_HINT}") from None
    return TransferEngine


def _boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _free_port(host: str) -> int:
    """A port for the engine's name (the metadata server refuses a
    duplicate name; the engine picks its own listening ports)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        try:
            s.bind((host, 0))
        except OSError:  # a name this host does not listen on: any free port here
            s.bind(("", 0))
        return s.getsockname()[1]


class MooncakeEngine:
    """One core's Transfer Engine with its KV pool registered: the decode
    side's writable target and the prefill side's source, both at once."""

    def __init__(self, host: str, metadata: str, kv_cache: torch.Tensor, protocol: str = "tcp") -> None:
        """``host``: what peers reach this core at (its transfer address's
        host); ``kv_cache``: the whole pool, ``[num_layers, 2, num_blocks,
        block_size, kv_heads, head_dim]``, contiguous, on the CPU."""
        if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            raise ValueError("kv_transport mooncake: this build registers a contiguous CPU pool only")
        engine_class = load_transfer_engine()
        host = host.strip("[]") or "127.0.0.1"
        self.engine = engine_class()
        self.min_write_bytes = _MIN_WRITE_BYTES  # see the module docstring
        self.name = f"{host}:{_free_port(host)}"
        if self.engine.initialize(self.name, metadata, protocol, "") != 0:
            raise ValueError(f"kv_transport mooncake: the transfer engine {self.name} did not start with "
                             f"metadata server {metadata!r} (is it running? --kv-transfer-metadata)")
        self.kv_cache = kv_cache
        elem = kv_cache.element_size()
        self.base = kv_cache.data_ptr()
        self.nbytes = kv_cache.numel() * elem
        if self.engine.register_memory(self.base, self.nbytes) != 0:
            raise ValueError(f"kv_transport mooncake: could not register the {self.nbytes}-byte KV pool")
        self.peer = MooncakePeer(
            name=self.name, base=self.base, num_layers=kv_cache.shape[0], num_blocks=kv_cache.shape[2],
            layer_stride=kv_cache.stride(0) * elem, kv_stride=kv_cache.stride(1) * elem,
            block_bytes=kv_cache.stride(2) * elem, boot_id=_boot_id(),
            wall_minus_monotonic=time.time() - time.monotonic())
        self.descriptor = msgspec.msgpack.encode(self.peer)

    def close(self) -> None:
        """Before the pool's memory goes: no peer may write into it after."""
        if self.engine is not None:
            self.engine.unregister_memory(self.base)
            self.engine = None  # the engine's destructor stops its threads


@dataclass(slots=True)
class _Posted:
    batch_id: int
    num_slices: int
    transfer_id: str
    layer: int
    chunk: KVLayerChunk | None  # on a layer's last batch: sent once the layer landed


class MooncakeTransport(KVTransport):
    """The prefill side of a link whose layers travel by Mooncake writes
    (see the module docstring); control messages as for the others."""

    def __init__(self, ctx: zmq.Context, address: str, engine: MooncakeEngine, transport_desc: bytes,
                 token: bytes | None = None) -> None:
        try:  # before the socket exists: a bad descriptor leaves nothing to close
            peer = msgspec.msgpack.decode(transport_desc, type=MooncakePeer)
        except msgspec.MsgspecError as exc:
            raise ValueError(f"unreadable mooncake descriptor: {exc}") from None
        own = engine.peer
        if peer.block_bytes != own.block_bytes or peer.num_layers != own.num_layers:
            raise ValueError(f"the decode core's pool ({peer.num_layers} layers, blocks of {peer.block_bytes} "
                             f"bytes) does not match this core's ({own.num_layers}, {own.block_bytes})")
        super().__init__(ctx, address, token)
        self.engine = engine
        self.peer = peer
        self._posted: deque[_Posted] = deque()
        self._slices_in_flight = 0
        self._framed: dict[str, bool] = {}  # transfer id -> sent framed (decided at its first layer)
        self._failed: dict[str, str] = {}  # transfer id -> the first write that did not land

    def write_deadline(self, deadline: float) -> float:
        """The decode core's ``deadline`` (its monotonic clock) on ours."""
        if self.peer.boot_id and self.peer.boot_id == self.engine.peer.boot_id:
            return deadline
        return deadline + self.peer.wall_minus_monotonic - (time.time() - time.monotonic())

    def write_layer(self, transfer_id: str, layer: int, src_layer: torch.Tensor, src_block_ids: list[int],
                    dst_block_ids: list[int], num_final_blocks: int) -> None:
        if not 0 <= layer < self.peer.num_layers or max(dst_block_ids, default=0) >= self.peer.num_blocks:
            raise ValueError(f"layer {layer} / blocks beyond the decode core's pool")
        runs = paired_runs(src_block_ids, dst_block_ids)
        framed = self._framed.get(transfer_id)
        if framed is None:
            mean_write = len(src_block_ids) * self.peer.block_bytes / max(1, len(runs))
            framed = self._framed[transfer_id] = mean_write < self.engine.min_write_bytes
        if framed:
            self.write_framed(transfer_id, layer, src_layer, src_block_ids, dst_block_ids, num_final_blocks)
            return
        # A block rewritten by a later step (it was partly computed) must not
        # race its earlier write: land every batch of this layer first.
        while any(p.layer == layer and p.transfer_id == transfer_id for p in self._posted):
            self._land_oldest()
        elem = src_layer.element_size()
        src_base, src_kv, src_block = src_layer.data_ptr(), src_layer.stride(0) * elem, src_layer.stride(1) * elem
        assert src_block == self.peer.block_bytes, "the pool's blocks must be contiguous"
        dst_base = self.peer.base + layer * self.peer.layer_stride
        per_write = max(1, _MAX_WRITE_BYTES // src_block)  # blocks
        writes = []  # (source address, target address, bytes)
        for s, d, n in runs:
            for kv in (0, 1):
                for i in range(0, n, per_write):
                    writes.append((src_base + kv * src_kv + (s + i) * src_block,
                                   dst_base + kv * self.peer.kv_stride + (d + i) * src_block,
                                   min(per_write, n - i) * src_block))
        # Final blocks never change on this core again: hashed here, in place.
        checksum = pool_checksum(src_layer, src_block_ids[:num_final_blocks])
        chunk = KVLayerChunk(transfer_id=transfer_id, layer=layer, block_ids=dst_block_ids,
                             num_final_blocks=num_final_blocks, checksum=checksum)
        batch: list[tuple[int, int, int]] = []
        slices = 0
        for i, write in enumerate(writes):
            batch.append(write)
            slices += -(-write[2] // _SLICE_BYTES)
            last = i == len(writes) - 1
            if last or slices + -(-writes[i + 1][2] // _SLICE_BYTES) > _MAX_SLICES_IN_FLIGHT // 2:
                self._post(batch, slices, transfer_id, layer, chunk if last else None)
                batch, slices = [], 0
        if not writes:  # nothing to write (no blocks): the chunk alone
            self.send_message(chunk)

    def _post(self, writes: list[tuple[int, int, int]], num_slices: int, transfer_id: str, layer: int,
              chunk: KVLayerChunk | None) -> None:
        """One asynchronous batch, after landing the oldest ones while the
        peer's queue could not take it."""
        while self._posted and self._slices_in_flight + num_slices > _MAX_SLICES_IN_FLIGHT:
            self._land_oldest()
        sources, targets, lengths = (list(column) for column in zip(*writes))
        batch_id = self.engine.engine.batch_transfer_async_write(self.peer.name, sources, targets, lengths)
        if batch_id in _NOT_POSTED:
            raise RuntimeError(f"mooncake: could not post writes to {self.peer.name}")
        self._posted.append(_Posted(batch_id, num_slices, transfer_id, layer, chunk))
        self._slices_in_flight += num_slices

    def _land_oldest(self) -> None:
        """Wait for the oldest batch; once a layer's last one landed, tell
        the decode core (it verifies the layer then). After a failed batch
        its transfer sends no more chunks: its Done then finds layers
        missing and the decode core recomputes (keeping the first token)."""
        posted = self._posted.popleft()
        self._slices_in_flight -= posted.num_slices
        tid = posted.transfer_id
        # Blocks (spinning, without the GIL) until landed, failed or timed out.
        if self.engine.engine.get_batch_transfer_status([posted.batch_id]) != 0 and tid not in self._failed:
            logger.warning("transfer %s: mooncake write of layer %d to %s failed", tid, posted.layer, self.peer.name)
            self._failed[tid] = f"layer {posted.layer}"
        if posted.chunk is not None and tid not in self._failed:
            self.send_message(posted.chunk)

    def send_done(self, done: KVTransferDone) -> None:
        """After every posted write landed (or failed): never a Done while a
        write may still land in the decode core's pool."""
        while self._posted:
            self._land_oldest()
        self._failed.pop(done.transfer_id, None)
        self._framed.pop(done.transfer_id, None)
        self.send_message(done)

    def close(self) -> None:
        try:
            while self._posted:  # our blocks may be freed once we return
                self._land_oldest()
        except zmq.ZMQError:
            pass
        super().close()
