"""The transfer agent of one engine core: both halves of disaggregation.

Decode side: ``ReceiveOrder``s register transfers with the ``KVReceiver``;
verified ones come back as ``finished_loading`` with the prefill core's
first token (and its seeded generator's state, handed to the runner when the
request is first scheduled here); failed ones as ``failed_loading``.

Prefill side: for a step with ``StreamOrder``s, ``begin_step`` returns a
``StepTransfer`` that travels with the step's attention metadata (never a
global). The model calls ``layer_done(i)`` as soon as layer ``i`` wrote its
KV; that only queues a job, so the forward pass goes on to layer ``i + 1``
while the sender thread gathers layer ``i``'s blocks and writes them through
the link (overlapping transfer with compute). With a draft model (method
"draft") its layers follow as layers L.. of the same transfer, queued as
soon as the draft ran (before the target's forward pass). After sampling,
``StepTransfer.finish`` queues the ``KVTransferDone``: first token, output
ids (the penalties' counts), generator state, and with method "head" the
hidden state the decode core's head drafts from. Each layer's chunk carries
its own checksum, taken as the layer is sent and verified by the decode
core as it lands, so Done adds no hashing at the end. Jobs run in order, so
Done follows every write.

Tensor parallelism (``tp_size`` ranks, each an agent over its own pool of
K / tp_size KV heads): every rank sends its own heads, on its own links,
to each decode rank that holds some of them (``heads.head_slices``; rank to
rank when both pools have the same size), straight into that rank's pool in
shared memory, or as framed bytes to the decode core's one socket (rank 0's
receiver, which copies each piece into its rank's pool). Only rank 0
samples, so only rank 0 sends the Done (with the rank count); the other
ranks' part of a transfer ends with their last layer. Only rank 0 has a
receiver: it verifies every rank's pieces and reports what arrived.

Pipeline parallelism (``stage``: this stage's layers of the model's): every
stage runs its own agent over its layers and sends them under the model's
layer numbers; stage 0 sends the Done (``num_ranks``: every sender) and
alone receives, into every stage's pool (``StageLayers.receive_layers``;
kvferry.engine.kv_connector.stage_transfer). With both, each of the
``T x P`` ranks sends its heads of its stage's layers, and stage 0's TP
rank 0 leads: it sends the Done and receives into every rank's pool.

Leases: a prefill core reports ``finished_sending`` (its blocks are freed)
on the decode core's acknowledgement, or ``lease_s`` after it first sent,
whichever comes first; it never writes into a decode core's shared memory
past that core's deadline. An aborted prefill sends a Done with an error so
the decode core gives up at once rather than at its deadline.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from kvferry.config import KVTransferConfig
from kvferry.core.outputs import KVOrders, StreamOrder
from kvferry.disagg.heads import HeadSlice, head_slices
from kvferry.disagg.transport import (
    KVReceiver, KVTransport, Received, SharedKVPool, ShmTransport, TcpTransport, hidden_state_checksum,
    rank_pool_name,
)
from kvferry.messages import KVTransferDone

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StageLayers:
    """A pipeline stage's place in the transfer: stage ``rank`` of ``size``
    holds layers ``[start, end)`` of the model's ``num_layers``; on stage 0
    (its TP rank 0), ``receive_layers``: per TP rank of a stage, that rank's
    pool layers of every stage in the model's order (in shared memory),
    which its receiver fills."""

    rank: int
    size: int
    start: int
    end: int
    num_layers: int = 0  # the model's (0: end)
    receive_layers: list[list[torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        self.num_layers = self.num_layers or self.end


@dataclass(slots=True)
class _Stream:
    """Sender-thread state of one outgoing transfer."""

    request_id: str
    link: KVTransport
    lease_end: float  # local clock: free the blocks by then, acked or not
    shm_deadline: float  # the decode core's deadline (same host: same clock)
    done_sent: bool = False
    error: str = ""


class StepTransfer:
    """One step's outgoing KV, called by the model between layers."""

    def __init__(self, jobs: queue.SimpleQueue, orders: list[StreamOrder], num_layers: int = 0,
                 num_draft_layers: int = 0) -> None:
        self._jobs = jobs
        self.orders = orders
        self.num_layers = num_layers  # the target's
        self.num_draft_layers = num_draft_layers
        # A pipeline stage's draft model drafts after the step's sampling (pp_runner.py): its layers
        # must go before this rank's end of the transfer, so ``finish`` waits for ``release``.
        self.hold_finish = False
        self._held: tuple | None = None

    def layer_done(self, layer: int) -> None:
        """Layer ``layer`` wrote this step's KV: queue its blocks (returns at once)."""
        for order in self.orders:
            if order.src_block_ids:
                self._jobs.put(("layer", order, layer))

    def draft_done(self) -> None:
        """The draft model wrote this step's KV (it runs before the target's
        forward pass): queue its layers, numbered after the target's."""
        for i in range(self.num_draft_layers):
            self.layer_done(self.num_layers + i)

    def finish(self, sampled: dict[str, list[int]], generators: dict[str, torch.Generator | None],
               hidden: dict[str, torch.Tensor] | None = None) -> None:
        """After sampling: close every transfer whose prompt ended this step.
        ``hidden``: method "head", each request's last hidden state [H]."""
        if self.hold_finish:
            self._held = (sampled, generators, hidden)
            return
        for order in self.orders:
            if order.last:
                gen = generators.get(order.request_id)
                state = gen.get_state().numpy().tobytes() if gen is not None else b""
                h = (hidden or {}).get(order.request_id)
                self._jobs.put(("done", order, list(sampled.get(order.request_id, [])), state, h))


    def release(self) -> None:
        """A held ``finish``, now (once the draft's layers are queued)."""
        held, self._held, self.hold_finish = self._held, None, False
        if held is not None:
            self.finish(*held)


class KVTransferAgent:
    def __init__(self, kv_cache: torch.Tensor, config: KVTransferConfig, pool: SharedKVPool | None,
                 draft_kv_cache: torch.Tensor | None = None, speculative: str = "", tp_rank: int = 0,
                 tp_size: int = 1, rank_pools: list[SharedKVPool] | None = None,
                 stage: StageLayers | None = None) -> None:
        """``draft_kv_cache``: method "draft", the draft model's pool (same
        block ids, its own shapes), sent and received as layers L.. after
        the target's L; ``speculative``: this core's speculation signature,
        sent with each Done and required of each received one. ``tp_rank``
        of ``tp_size``: this rank of a tensor-parallel core (rank 0 receives
        for every rank: ``rank_pools`` holds ranks 1..N-1's pools). ``stage``:
        this pipeline stage's place (``kv_cache`` holds its layers alone;
        stage 0 receives into every stage's and sends the Done)."""
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.stage = stage or StageLayers(0, 1, 0, kv_cache.shape[0])
        # The leader (rank 0 of stage 0) receives, samples' Done and acks are its.
        self.leads = tp_rank == 0 and self.stage.rank == 0
        self.rank_pools = list(rank_pools or [])
        # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.kv_cache = kv_cache
        # [draft_layers, 2, num_blocks, block_size, draft_kv_heads, draft_head_dim] or None
        self.draft_kv_cache = draft_kv_cache
        self.num_draft_layers = draft_kv_cache.shape[0] if draft_kv_cache is not None else 0
        self.speculative = speculative
        self.config = config
        self.pool = pool
        # Global KV heads: this rank holds [tp_rank * H, (tp_rank + 1) * H) of them.
        self.num_kv_heads = kv_cache.shape[4] * tp_size
        self.receiver: KVReceiver | None = None
        self.address = ""
        if self.leads:
            layers, ranks = kv_cache, [p.tensor for p in self.rank_pools]
            if self.stage.receive_layers is not None:  # every stage's layers, per TP rank
                layers, *ranks = self.stage.receive_layers
            self.receiver = KVReceiver(layers, config.kv_transfer_address, draft_kv_cache=draft_kv_cache,
                                       speculative=speculative, bind_any=config.kv_transfer_bind_any,
                                       rank_pools=ranks)
            self.address = self.receiver.address
        self.shm_name = pool.name if pool is not None else ""
        self._ctx = zmq.Context.instance()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._finished_sending: list[str] = []
        self._event = threading.Event()
        self._streams: dict[str, _Stream] = {}  # transfer id -> (sender thread only)
        # (address, shm name) -> link. Sender thread only: it creates, uses
        # and closes each link's DEALER socket (a ZeroMQ socket is never
        # called from two threads; one closed under another thread's call
        # aborts the process) and writes through its mapping of the decode
        # core's pool (unmapped under a write, it would crash).
        self._links: dict[tuple[str, str], KVTransport] = {}
        self._streaming_rids: set[str] = set()  # step thread: requests with stream orders
        # Seeded generator states received with a prefill, until the runner
        # first schedules the request here.
        self.generator_states: dict[str, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send_loop, name="kv-sender", daemon=True)
        self._thread.start()

    # -- step thread --------------------------------------------------------------
    def expect(self, orders: KVOrders) -> None:
        """Decode side: register the step's receives with the receiver
        (rank 0's, which receives for every rank)."""
        if self.receiver is None:
            return
        for r in orders.receive:
            self.receiver.expect(r.request_id, r.transfer_id, r.block_ids, r.deadline)

    def begin_step(self, orders: KVOrders) -> StepTransfer | None:
        """Prefill side: the step's layer hooks when it streams KV."""
        if not orders.stream:
            return None
        self._streaming_rids.update(o.request_id for o in orders.stream)
        return StepTransfer(self._jobs, orders.stream, self.kv_cache.shape[0], self.num_draft_layers)

    def finished_requests(self, request_ids: list[str]) -> None:
        """The scheduler finished these: close any stream not closed yet."""
        for rid in request_ids:
            if rid in self._streaming_rids:
                self._streaming_rids.discard(rid)
                self._jobs.put(("close", rid))

    def take(self) -> tuple[dict[str, Received], dict[str, str], dict[str, Received], list[str]]:
        """(verified receives, failed receives, the tokens that came with
        failed ones, finished sends), each once."""
        done, failed, failed_received = self.receiver.take() if self.receiver is not None else ({}, {}, {})
        for rid, received in [*done.items(), *failed_received.items()]:
            if received.generator_state:
                self.generator_states[rid] = received.generator_state
        with self._lock:
            sent, self._finished_sending = self._finished_sending, []
        self._event.clear()
        return done, failed, failed_received, sent

    def wait(self, timeout_s: float) -> None:
        """Idle step: sleep until a send completes or a receive may have
        (no spinning while only transfers are outstanding)."""
        if self.receiver is not None and self.receiver.num_pending:
            self.receiver.wait(timeout_s)
        else:
            self._event.wait(timeout_s)

    def close(self) -> None:
        """Stop both threads; the sender closes its links as it exits (if a
        long write holds it past the join, it still does, afterwards)."""
        self._stop.set()
        self._thread.join(2)
        if self._thread.is_alive():
            logger.warning("KV sender thread did not stop within 2 s")
        if self.receiver is not None:
            self.receiver.close()
        for pool in [self.pool, *self.rank_pools]:
            if pool is not None:
                pool.close()

    # -- sender thread ------------------------------------------------------------
    def _send_loop(self) -> None:
        try:
            self._send_until_stopped()
        finally:
            for link in self._links.values():
                link.close()

    def _send_until_stopped(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.01)
            except queue.Empty:
                job = None
            try:
                if job is not None:
                    getattr(self, f"_job_{job[0]}")(*job[1:])
                self._collect_acks()
            except Exception:  # one bad link must not stop every transfer
                logger.exception("KV sender job %s failed", job[0] if job else "ack poll")
                if job is not None and job[0] in ("layer", "done"):
                    self._fail(job[1], "send failed")

    def _stream(self, order: StreamOrder) -> _Stream:
        stream = self._streams.get(order.transfer_id)
        if stream is None:
            stream = self._streams[order.transfer_id] = _Stream(
                order.request_id, self._link(order), time.monotonic() + order.lease_s,
                order.deadline if order.shm_name and self.config.kv_transport == "shm" else float("inf"))
        return stream

    def _link(self, order: StreamOrder) -> KVTransport:
        use_shm = self.config.kv_transport == "shm" and bool(order.shm_name) and self.kv_cache.device.type == "cpu"
        key = (order.address, order.shm_name if use_shm else "", order.dst_tp_size)
        link = self._links.get(key)
        if link is None:
            if use_shm:
                link = self._shm_link(order)
            link = link or TcpTransport(self._ctx, order.address)
            self._links[key] = link
        return link

    def _shm_link(self, order: StreamOrder) -> ShmTransport | None:
        """A link into the decode core's pools (one per rank), or None when
        one cannot be mapped (another host)."""
        n = order.dst_tp_size
        # (layers, 2, block_size, the decode rank's KV heads, head_dim): every layer of the model
        block_shape = (self.stage.num_layers, 2, self.kv_cache.shape[3], self.num_kv_heads // n,
                       self.kv_cache.shape[5])
        pools: list[SharedKVPool] = []
        try:
            for rank in range(n):
                pools.append(SharedKVPool.attach(rank_pool_name(order.shm_name, rank), block_shape,
                                                 self.kv_cache.dtype))
            return ShmTransport(self._ctx, order.address, pools)
        except (FileNotFoundError, OSError, ValueError):
            logger.warning("cannot map %s (another host?): sending over tcp", order.shm_name)
            for pool in pools:
                pool.close()
            return None

    def _pieces(self, order: StreamOrder) -> list[HeadSlice | None]:
        """What this rank sends of each layer: the whole layer between two
        one-rank pools, else its heads per decode rank that holds them."""
        if self.tp_size == 1 and order.dst_tp_size == 1:
            return [None]
        return list(head_slices(self.num_kv_heads, self.tp_rank, self.tp_size, order.dst_tp_size))

    def _job_layer(self, order: StreamOrder, layer: int) -> None:
        stream = self._stream(order)
        if stream.error or stream.done_sent:
            return
        if time.monotonic() >= stream.shm_deadline:
            self._fail(order, "lease over")
            return
        num_target = self.kv_cache.shape[0]
        if layer < num_target:
            for piece in self._pieces(order):  # the model's layer number: this stage's first is stage.start
                stream.link.write_layer(order.transfer_id, self.stage.start + layer, self.kv_cache[layer], order.src_block_ids,
                                        order.dst_block_ids, order.num_final_blocks, piece)
        else:  # a draft layer, numbered after the model's: framed bytes on any link (a decode core's
            # receiver copies it into its draft pool, which no sender maps)
            stream.link.write_framed(order.transfer_id, self.stage.num_layers + layer - num_target,
                                     self.draft_kv_cache[layer - num_target], order.src_block_ids,
                                     order.dst_block_ids, order.num_final_blocks)

    def _job_done(self, order: StreamOrder, tokens: list[int], generator_state: bytes,
                  hidden: torch.Tensor | None = None) -> None:
        stream = self._stream(order)
        if stream.error or stream.done_sent:
            return
        if not self.leads:  # rank 0 (of stage 0) sends the Done; this rank's part ended with its last layer
            stream.done_sent = True
            self._streams.pop(order.transfer_id, None)
            return
        hidden_bytes, hidden_dtype = b"", ""
        if hidden is not None:
            h = hidden.detach().contiguous().cpu()  # [H], the model's dtype
            hidden_bytes, hidden_dtype = h.view(torch.uint8).numpy().tobytes(), str(h.dtype).removeprefix("torch.")
        stream.link.send_done(KVTransferDone(
            transfer_id=order.transfer_id, num_layers=self.stage.num_layers + self.num_draft_layers,
            block_ids=order.all_dst_block_ids, output_token_ids=tokens, generator_state=generator_state,
            speculative=self.speculative, hidden_state=hidden_bytes, hidden_state_dtype=hidden_dtype,
            hidden_state_checksum=hidden_state_checksum(hidden_bytes) if hidden_bytes else 0,
            num_ranks=self.tp_size * self.stage.size))
        stream.done_sent = True

    def _job_close(self, request_id: str) -> None:
        """A finished request: a transfer it never completed ends now."""
        open_ = [(tid, s) for tid, s in self._streams.items() if s.request_id == request_id and not s.done_sent]
        if not any(s.request_id == request_id for s in self._streams.values()):
            self._finish_send(request_id)  # no job ever ran for it: nothing to wait for
        for tid, stream in open_:
            self._abandon(tid, stream, stream.error or "aborted")

    def _fail(self, order: StreamOrder, reason: str) -> None:
        stream = self._streams.get(order.transfer_id)
        if stream is not None and not stream.done_sent:
            self._abandon(order.transfer_id, stream, reason)

    def _abandon(self, transfer_id: str, stream: _Stream, reason: str) -> None:
        """Tell the decode core to give up now; our blocks are free to go."""
        stream.error = reason
        try:
            stream.link.send_done(KVTransferDone(transfer_id=transfer_id, num_layers=0, block_ids=[],
                                                 output_token_ids=[], error=reason))
        except zmq.ZMQError:
            pass
        stream.done_sent = True
        self._streams.pop(transfer_id, None)
        self._finish_send(stream.request_id)

    def _collect_acks(self) -> None:
        for link in self._links.values():
            for ack in link.poll_acks():
                stream = self._streams.pop(ack.transfer_id, None)
                if stream is None:
                    continue
                if not ack.ok:
                    logger.warning("decode core refused transfer %s: %s", ack.transfer_id, ack.reason)
                self._finish_send(stream.request_id)
        now = time.monotonic()
        for tid, stream in list(self._streams.items()):
            if now > stream.lease_end:
                logger.warning("transfer %s: no acknowledgement within its lease; freeing its blocks", tid)
                del self._streams[tid]
                self._finish_send(stream.request_id)

    def _finish_send(self, request_id: str) -> None:
        if not self.leads:
            return  # the leader's scheduler frees the blocks (on its Done's acknowledgement)
        with self._lock:
            self._finished_sending.append(request_id)
        self._event.set()
