"""The node KV store, worker half: loads and saves between the device
pool and the store's shared-memory DRAM arena.

Every store call and every copy runs on one background thread, so neither
is on a step's critical path; ``execute`` only queues orders and
``take_finished`` only drains completions::

    step N     forward writes block b (full now)
    step N+1   execute: save order for b -> queue      forward ...
               thread:  reserve(key) -> slot s; arena[s] <- kv_cache[:, :, b]; commit
    step N+k   take_finished: finished_saving (b unpinned by the scheduler)

A load: ``begin_load`` (the store brings the blocks up to DRAM, from SSD or
the remote tier if need be), poll until its result, copy the leading run of
slots into the device blocks, ``release``. A result shorter than the order
(a block missing, corrupt, or the store gone) is reported with
``num_loaded_blocks``: the scheduler recomputes the rest.

Arena slot layout = one device block, ``[num_layers, 2, block_size,
num_kv_heads, head_dim]`` flattened to bytes; the pool holds blocks on dim 2
(``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``), hence
the permutes below.

The connector owns its link to the store (``NodeStore``: the two clients,
and offline a store process of its own), so the engine core knows nothing
of the store: it asks the connector for stats and purges through the
hooks every connector has (``KVConnectorWorker.report_stats``,
``purge_tenant``, ``drop_public``).
"""
from __future__ import annotations

import logging
import queue
import subprocess
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from kvferry.config import EngineConfig
from kvferry.core.outputs import KVOrders, TransferOrder
from kvferry.core.tier_source import block_owners
from kvferry.engine.kv_connector.base import KVCompletions, KVConnectorWorker
from kvferry.kvstore.client import KVStoreClient
from kvferry.kvstore.launch import start_store
from kvferry.model.kv_cache_dtype import index_copy_into
from kvferry.types.stats import SchedulerStats

logger = logging.getLogger(__name__)

# How often the thread polls the store while loads are outstanding.
_POLL_INTERVAL_S = 0.0005
# How often the thread refreshes the store's own counters (for /metrics).
_STATS_INTERVAL_S = 1.0


class LoadDone(Protocol):
    """A finished load as the store reports it: the arena slots filled, in
    key order (fewer than asked: the rest is missing or corrupt)."""

    ticket: int
    slots: Sequence[int]


class StoreIO(Protocol):
    """What the worker half asks of the node's store: the calls of
    ``kvstore.client.KVStoreClient`` that its I/O thread makes. Every call
    may fail or answer empty while the store is away; the worker treats
    that as a miss, never as an error of the request."""

    @property
    def connected(self) -> bool:
        """Whether the store answers (reconnecting if need be)."""

    def arena(self) -> np.ndarray:
        """The store's shared-memory slots, uint8 ``[num_slots, block_nbytes]``."""

    def begin_load(self, keys: list[bytes], owners: list[Any]) -> int:
        """Start bringing ``keys`` into pinned arena slots: a ticket."""

    def poll_loads(self) -> Sequence[LoadDone]:
        """Loads finished since the last poll, each once."""

    def release(self, ticket: int) -> None:
        """Unpin a finished load's slots."""

    def reserve(self, keys: list[bytes], owners: list[Any]) -> list[int | None]:
        """A slot to write for each key (None: held already, or refused)."""

    def commit(self, keys: list[bytes], slots: list[int]) -> None:
        """Publish written slots under their keys."""

    def abandon(self, slots: list[int]) -> None:
        """Give back reserved slots that were not written."""

    def stats(self) -> Any:
        """The store's own counters (``kvstore.protocol.StoreStats``)."""

    def close(self) -> None: ...


@dataclass(slots=True)
class NodeStore:
    """This core's link to the node's KV store: ``index``, the scheduler
    half's client (lookups, retentions, purges, on the step's thread), and
    ``io``, the worker half's (loads and saves, on its I/O thread); with
    ``process``, a store of this core's own (offline), stopped with it."""

    address: str
    index: KVStoreClient
    io: StoreIO
    process: subprocess.Popen | None = None

    @classmethod
    def connect(cls, config: EngineConfig, block_nbytes: int) -> NodeStore:
        """Clients of the node's KV store (its address from the config, or a
        store started here). A store that is down at start is no error: the
        clients reconnect, and until then every lookup misses."""
        tiers = config.kv_tiers
        if not config.cache.enable_prefix_caching:
            raise ValueError("kv_store needs enable_prefix_caching (blocks are found by their prefix hashes)")
        process = None
        address = tiers.kv_store
        if not address:  # offline: a store of this process's own (it exits with it)
            process, address = start_store(tiers, block_nbytes=block_nbytes)
        # Loads and saves run on the runner's I/O thread with a client of
        # their own; that thread also notices a store going away and coming
        # back, and the scheduler's lookups (on the step's path) only go out
        # while it sees the store up.
        io = KVStoreClient(address, block_nbytes=block_nbytes)
        return cls(address, KVStoreClient(address, block_nbytes=block_nbytes), io, process)

    def close(self) -> None:
        for client in (self.index, self.io):
            client.close()
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)


@dataclass(slots=True)
class _Load:
    order: TransferOrder
    ticket: Any
    started: float


@dataclass(slots=True)
class StoreIOStats:
    blocks_loaded: int = 0
    blocks_saved: int = 0  # committed to the store
    blocks_skipped: int = 0  # already held by the store (or refused by it)
    failed_loads: int = 0  # loads that came back short
    load_seconds: float = 0.0  # order -> device blocks filled, summed
    save_seconds: float = 0.0  # background time spent saving, summed


@dataclass(slots=True)
class _Outbox:
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: KVCompletions = field(default_factory=KVCompletions)
    num_loaded_blocks: dict[str, int] = field(default_factory=dict)


class NodeStoreWorker(KVConnectorWorker):
    """Loads and saves through a ``KVStoreClient``. Completions come back
    through ``take_finished``; every order completes (a failed save
    completes as not saved, a failed load as loaded short), so nothing
    waits forever."""

    order_kinds = frozenset({"load", "save"})

    def __init__(self, kv_cache: torch.Tensor, store: StoreIO, load_timeout_s: float = 10.0,
                 node_store: NodeStore | None = None, rank_caches: list[torch.Tensor] | None = None,
                 rank_pools: Any = None, stage_caches: list[torch.Tensor] | None = None, stage_tp: int = 1) -> None:
        """``rank_caches``: on rank 0 of a tensor-parallel core, ranks
        1..N-1's pools (shared memory, the same block ids, their heads): a
        slot holds a whole block, every rank's heads in rank order, as one
        rank's pool would, so cores of any TP size share the store's
        blocks. ``stage_caches``: the same on stage 0 of a pipeline-parallel
        core, stages 1..P-1's pools (their layers; stage_pools.py): a slot
        holds every stage's layers in order; with ``stage_tp`` T > 1
        (``-tp T -pp P``) ``stage_caches`` are the core's ranks 1..T x P - 1
        (stage-major), and a slot holds each stage's layers with its T
        ranks' heads in rank order. ``rank_pools``: what owns those
        segments (closed with this)."""
        # kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = kv_cache
        self._pools = [kv_cache, *(rank_caches or stage_caches or [])]
        # Each pool's part of a block: (its first layer, its first head). The pools are a grid of
        # stages x TP ranks, rank r = stage r // T, TP rank r % T: layers (pool and block dim 0)
        # over stages, heads (pool dim 4, block dim 3) over the TP ranks of a stage.
        tp = len(self._pools) if rank_caches else stage_tp
        layer_starts = [0]
        for stage_pool in self._pools[::tp]:
            layer_starts.append(layer_starts[-1] + stage_pool.shape[0])
        self._parts = [(pool, layer_starts[r // tp], r % tp * pool.shape[4]) for r, pool in enumerate(self._pools)]
        self._rank_pools = rank_pools
        self.pool_name = getattr(rank_pools, "pool_name", "")  # stage 0's segment: where each stage maps its own
        self.store = store
        # The link this worker's connector made (closed with the worker;
        # its index client purges tenants). None: a store the caller owns.
        self.node_store = node_store
        self.load_timeout_s = load_timeout_s
        self.stats = StoreIOStats()
        self._block_shape = (layer_starts[-1], kv_cache.shape[1], kv_cache.shape[3], tp * kv_cache.shape[4],
                             kv_cache.shape[5])
        self._inbox: queue.Queue[tuple[str, TransferOrder, Any] | None] = queue.Queue()
        self._outbox = _Outbox()
        # Set when a completion lands in the outbox: an idle step waits on it
        # rather than polling (a resumed request starts the step its load ends).
        self._completed = threading.Event()
        self._loads: list[_Load] = []
        # The store's StoreStats as last fetched (None before the first),
        # so that reading metrics never waits on the store.
        self.store_stats: Any = None
        self._reported_store_stats: Any = None  # what report_stats last put in the core's stats
        self._stats_due = 0.0
        # Whether the store answered this thread's last health check (read
        # by the scheduler to skip lookups while the store is away).
        self.store_up = bool(store.connected)
        self._cuda = kv_cache.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv_cache.device) if self._cuda else None
        self._thread = threading.Thread(target=self._run, name="kvferry-kv-store-io", daemon=True)
        self._thread.start()

    # -- the step's side (cheap) --------------------------------------------
    def run_orders(self, orders: KVOrders) -> None:
        # On CUDA the thread's stream waits for what the device has queued so
        # far (the blocks to save were written by the previous step).
        event = None
        if self._cuda and (orders.save or orders.load):
            event = torch.cuda.Event()
            event.record()
        for order in orders.save:
            self._inbox.put(("save", order, event))
        for order in orders.load:
            self._inbox.put(("load", order, event))

    def take_finished(self, idle: bool = False) -> KVCompletions:
        with self._outbox.lock:
            done, self._outbox.done = self._outbox.done, KVCompletions()
            partial, self._outbox.num_loaded_blocks = self._outbox.num_loaded_blocks, {}
        done.num_loaded_blocks = partial
        return done

    def wait_for_io(self, timeout_s: float) -> bool:
        """Block an idle step until a load or save completes, at most ``timeout_s``."""
        if self._completed.wait(timeout_s):
            self._completed.clear()
        return True

    def report_stats(self, stats: SchedulerStats) -> None:
        store_stats = self.store_stats
        self._reported_store_stats = store_stats
        if store_stats is not None:
            stats.kv_tiers, stats.kv_tier_tenants = tier_stats(store_stats)
            stats.kv_store_id = str(getattr(self.store, "address", ""))

    def stats_changed(self) -> bool:
        """The store's counters were refreshed since the last report (the
        store keeps counting while this core idles)."""
        return self.store_stats is not self._reported_store_stats

    def purge_tenant(self, tenant: str) -> int:
        """Drop the tenant's private blocks from every tier of the store."""
        return self.node_store.index.drop_tenant(tenant) if self.node_store is not None else 0

    def drop_public(self, keys: list[bytes]) -> int:
        """Drop a deleted public prefix's own blocks from the store's tiers
        on this node (DRAM, disk); shared tiers keep theirs."""
        return self.node_store.index.drop_public(keys) if self.node_store is not None and keys else 0

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=5.0)
        if self.node_store is not None:
            self.node_store.close()
        if self._rank_pools is not None:
            self._pools, self._parts = [], []
            self._rank_pools.close()

    # -- the I/O thread -------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode(), (torch.cuda.stream(self._stream) if self._stream else nullcontext()):
            while True:
                try:
                    item = self._inbox.get(timeout=_POLL_INTERVAL_S if self._loads else _STATS_INTERVAL_S)
                except queue.Empty:
                    item = ()
                if time.monotonic() >= self._stats_due:
                    self._refresh_store_stats()
                if item is None:
                    return
                if item:
                    self._handle(*item)
                    self.store_up = bool(self.store.connected)  # a failed call dropped the connection
                if self._loads:
                    self._poll_loads()

    def _refresh_store_stats(self) -> None:
        """Health check (reconnecting here, off the step's path) and counters."""
        self._stats_due = time.monotonic() + _STATS_INTERVAL_S
        try:
            self.store_up = bool(self.store.connected)
            if not self.store_up:
                return
            stats = self.store.stats()
        except Exception:
            logger.debug("reading the KV store's stats failed", exc_info=True)
            return
        if self.store_stats is None or stats != self.store_stats:
            self.store_stats = stats  # a new object: the core reports it once

    def _handle(self, kind: str, order: TransferOrder, event: Any) -> None:
        if event is not None:
            self._stream.wait_event(event)
        if kind == "save":
            start = time.perf_counter()
            try:
                self._save(order)
            except Exception:  # the store is a cache: a failed save loses nothing
                logger.warning("KV write-down of %d blocks failed", len(order.keys), exc_info=True)
            self.stats.save_seconds += time.perf_counter() - start
            with self._outbox.lock:
                self._outbox.done.finished_saving.append(order.request_id)
            self._completed.set()
            return
        try:
            owners = block_owners(order.tenant, order.num_public_blocks, 0, len(order.keys))
            ticket = self.store.begin_load(list(order.keys), owners)
        except Exception:
            logger.warning("KV load of %d blocks could not start", len(order.keys), exc_info=True)
            ticket = None
        load = _Load(order, ticket, time.perf_counter())
        if ticket is None:
            self._finish_load(load, [])
        else:
            self._loads.append(load)

    def _save(self, order: TransferOrder) -> None:
        owners = block_owners(order.tenant, order.num_public_blocks, 0, len(order.keys))
        slots = self.store.reserve(list(order.keys), owners)
        todo = [i for i, slot in enumerate(slots) if slot is not None]
        self.stats.blocks_skipped += len(order.keys) - len(todo)
        if not todo:
            return
        taken = [slots[i] for i in todo]
        try:
            self._copy_out([order.device_block_ids[i] for i in todo], taken)
        except Exception:
            self.store.abandon(taken)
            raise
        self.store.commit([order.keys[i] for i in todo], taken)
        self.stats.blocks_saved += len(todo)

    def _poll_loads(self) -> None:
        try:
            # The client reports a load lost to a dead store as an empty result.
            results = self.store.poll_loads()
        except Exception:
            logger.warning("polling KV loads failed", exc_info=True)
            results = []
        by_ticket = {r.ticket: r for r in results}
        now = time.perf_counter()
        pending = []
        for load in self._loads:
            result = by_ticket.get(load.ticket)
            if result is not None:
                self._finish_load(load, list(result.slots))
            elif now - load.started > self.load_timeout_s:
                # A store that never answers: recompute instead.
                self._finish_load(load, [])
            else:
                pending.append(load)
        self._loads = pending

    def _finish_load(self, load: _Load, slots: list[int]) -> None:
        order = load.order
        n = min(len(slots), len(order.device_block_ids))
        try:
            if n:
                self._copy_in(order.device_block_ids[:n], slots[:n])
        except Exception:
            logger.warning("copying %d loaded KV blocks failed", n, exc_info=True)
            n = 0
        self.stats.blocks_loaded += n
        self.stats.load_seconds += time.perf_counter() - load.started
        with self._outbox.lock:
            if n < len(order.device_block_ids):
                self.stats.failed_loads += 1
                self._outbox.num_loaded_blocks[order.request_id] = n
            self._outbox.done.finished_loading.append(order.request_id)
        self._completed.set()
        # The blocks are in the device pool: unpin the slots, off the
        # request's path (the completion is already out).
        if load.ticket is not None:
            try:
                self.store.release(load.ticket)
            except Exception:
                logger.warning("releasing a KV load failed", exc_info=True)

    def _copy_out(self, block_ids: list[int], slots: list[int]) -> None:
        arena = torch.from_numpy(self.store.arena())  # [num_slots, block_nbytes] uint8
        if not self._cuda:
            # One pass per block, straight into its slot (no staging copy).
            for block_id, slot in zip(block_ids, slots):
                for heads, pool in self._rank_heads(self._slot(arena, slot)):
                    heads.copy_(pool[:, :, block_id])
            return
        blocks = torch.tensor(block_ids, device=self.kv_cache.device)
        # [L, 2, n, bs, H, D] -> [n, L, 2, bs, H, D] -> bytes [n, block_nbytes] on the host (one transfer)
        data = self.kv_cache.index_select(2, blocks).permute(2, 0, 1, 3, 4, 5).contiguous()
        data = data.cpu().reshape(len(block_ids), -1).view(torch.uint8)
        arena.index_copy_(0, torch.tensor(slots), data)

    def _copy_in(self, block_ids: list[int], slots: list[int]) -> None:
        arena = torch.from_numpy(self.store.arena())  # [num_slots, block_nbytes] uint8
        if not self._cuda:
            # One pass per block, straight from its slot: a gather into a
            # staging tensor and a scatter out of it cost twice the memory
            # traffic, and the load is on the resumed request's TTFT.
            for block_id, slot in zip(block_ids, slots):
                for heads, pool in self._rank_heads(self._slot(arena, slot)):
                    pool[:, :, block_id].copy_(heads)
            return
        n = len(slots)
        # bytes [n, block_nbytes] -> [n, L, 2, bs, H, D] -> [L, 2, n, bs, H, D] (one transfer)
        data = arena.index_select(0, torch.tensor(slots)).view(self.kv_cache.dtype).reshape(n, *self._block_shape)
        data = data.permute(1, 2, 0, 3, 4, 5).to(self.kv_cache.device, non_blocking=True)
        index_copy_into(self.kv_cache, 2, torch.tensor(block_ids, device=self.kv_cache.device), data)
        self._stream.synchronize()  # in the device blocks before the completion is reported

    def _rank_heads(self, block: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(the block's part rank or stage r holds: its heads or its layers,
        and r's pool) for each (one pool: the whole block and the pool)."""
        if len(self._pools) == 1:
            return [(block, self.kv_cache)]
        return [(block.narrow(0, layer, pool.shape[0]).narrow(3, head, pool.shape[4]), pool)
                for pool, layer, head in self._parts]

    def _slot(self, arena: torch.Tensor, slot: int) -> torch.Tensor:
        """Slot bytes as one block: [L, 2, bs, H, D]."""
        return arena[slot].view(self.kv_cache.dtype).view(self._block_shape)


_TIER_FIELDS = ("hits", "misses", "bytes_read", "bytes_written", "quarantined", "refused_writes", "num_blocks",
                "num_bytes", "load_seconds")


def tier_stats(store_stats: Any) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, list[int]]]]:
    """The store's StoreStats as plain data for SchedulerStats: per tier
    counters, and per tier per tenant [hits, misses]."""
    tiers = {name: {f: getattr(t, f) for f in _TIER_FIELDS} for name, t in store_stats.tiers.items()}
    tenants = {name: {tenant: [s.hits, s.misses] for tenant, s in t.per_tenant.items()}
               for name, t in store_stats.tiers.items()}
    return tiers, tenants
