"""KV connectors as the engine core sees them: each one a pair of halves,
made in order (the worker half inside the runner, over the KV pool; then
the scheduler half, which may read its worker half's live state: both live
in the engine core's process).

Built in: ``PDTransferConnector`` (prefill/decode transfer), ``HostSwapConnector``
(preemption swap), ``NodeStoreConnector`` (the node KV store). ``for_engine``
composes what a configuration asks for, plus a connector from outside the
package (``--kv-connector module:Class``), with ``MultiKVConnector``.

A connector of one's own subclasses ``KVConnector``; its constructor takes
the ``EngineConfig``.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

from kvferry.config import EngineConfig
from kvferry.core.kv_connector import (
    HostSwapScheduler,
    KVConnectorScheduler,
    MultiKVConnectorScheduler,
    PDTransferScheduler,
    TierKVScheduler,
)
from kvferry.core.swap_space import HostSwapSpace
from kvferry.core.tier_source import StoreKVSource
from kvferry.engine.kv_connector.base import KVConnectorWorker
from kvferry.engine.kv_connector.disagg import PDTransferWorker
from kvferry.engine.kv_connector.multi import MultiKVConnectorWorker
from kvferry.engine.kv_connector.rank_pools import RankPools, RankPoolWorker
from kvferry.engine.kv_connector.stage_pools import StagePools, StagePoolWorker
from kvferry.engine.kv_connector.stage_transfer import StageTransferWorker
from kvferry.engine.kv_connector.store import NodeStore, NodeStoreWorker
from kvferry.engine.kv_connector.swap import HostSwapWorker
from kvferry.model.layers.parallel import TPShard
from kvferry.parallel.pipeline import PPStage


@dataclass(slots=True)
class WorkerContext:
    """What a worker half is built over."""

    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache: torch.Tensor
    block_size: int
    # Speculative method "draft": the draft model's pool (same block ids,
    # its own shapes), else None.
    draft_kv_cache: torch.Tensor | None = None
    # This core's speculation signature (``kvferry.spec.speculation_signature``).
    speculative: str = ""
    # The runner's rank of a tensor-parallel core (each rank's runner makes
    # its own worker half over its own KV heads; its group formed; rank 0 of
    # 1 without tensor parallelism), or None (a model without one).
    shard: TPShard | None = None
    # The pool is in shared memory over tensor-parallel ranks (a connector
    # before moved it, rank_pools.py): on rank 0 the other ranks' pools in
    # rank order, on a worker rank []; None: not moved.
    rank_caches: list[torch.Tensor] | None = None
    # The runner's pipeline stage (each stage's runner makes its own worker
    # half over its own layers' pool, ``[stage layers, 2, ...]``), or None
    # (one stage); ``num_layers``: the model's; ``stage_pool``: stage 0's
    # pool segment, which a later stage maps its own after (stage_pools.py).
    stage: PPStage | None = None
    num_layers: int = 0
    stage_pool: str = ""
    # The pools are in shared memory over pipeline stages (the P/D transfer
    # moved them, stage_transfer.py): on stage 0 the other stages' pools in
    # stage order, on a later stage []; None: not moved.
    stage_caches: list[torch.Tensor] | None = None


@dataclass(slots=True)
class SchedulerContext:
    block_size: int
    num_kv_blocks: int


class KVConnector(ABC):
    """A KV connector's two halves."""

    # Whether its worker half may move the pool (into shared memory, where
    # other processes reach it): such halves are made first (MultiKVConnector).
    moves_pool = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def worker_half(self, ctx: WorkerContext) -> KVConnectorWorker:
        """Made first, by the runner, over its KV pool."""

    @abstractmethod
    def scheduler_half(self, ctx: SchedulerContext) -> KVConnectorScheduler:
        """Made after the worker half."""


class HostSwapConnector(KVConnector):
    def worker_half(self, ctx: WorkerContext) -> KVConnectorWorker:
        return HostSwapWorker(ctx.kv_cache, self.config.cache.num_swap_blocks)

    def scheduler_half(self, ctx: SchedulerContext) -> KVConnectorScheduler:
        return HostSwapScheduler(HostSwapSpace(self.config.cache.num_swap_blocks))


class NodeStoreConnector(KVConnector):
    """The node's KV store, self-contained: it connects (offline: starts a
    store of its own, ``NodeStore.connect``) and owns both clients, ``index``
    for the scheduler's lookups and retentions, ``io`` for the worker's
    loads and saves (each on its own thread); the worker half closes them."""

    moves_pool = True

    def __init__(self, config: EngineConfig, block_nbytes: int | None) -> None:
        """``block_nbytes`` None: a whole block's bytes are known once the
        worker half has the pools (pipeline stages: every stage's layers)."""
        super().__init__(config)
        self.store = None if block_nbytes is None else NodeStore.connect(config, block_nbytes)
        self.worker: NodeStoreWorker | None = None

    def worker_half(self, ctx: WorkerContext) -> KVConnectorWorker:
        """Over a tensor-parallel core, rank 0's half moves whole blocks:
        every rank's heads, read from and written to their pools in shared
        memory (so a block is stored whole, or not at all); over pipeline
        stages, stage 0's moves every stage's layers the same way."""
        if ctx.stage is not None and ctx.stage.size > 1:
            tp = ctx.shard.size if ctx.shard is not None else 1  # -tp T too: every stage's T ranks' heads
            pools = (None if ctx.stage_caches is not None
                     else StagePools(ctx.kv_cache, ctx.stage, ctx.num_layers, tp_size=tp))
            kv_cache, stage_caches = (ctx.kv_cache, ctx.stage_caches) if pools is None else (pools.kv_cache,
                                                                                          pools.stage_caches)
            nbytes = sum(c[:, :, 0].nbytes for c in (kv_cache, *stage_caches))  # a slot: every rank's part
            self.store = NodeStore.connect(self.config, nbytes)
            self.worker = NodeStoreWorker(kv_cache, self.store.io, node_store=self.store, stage_caches=stage_caches,
                                          rank_pools=pools, stage_tp=tp)
            return self.worker
        pools, kv_cache, rank_caches = None, ctx.kv_cache, ctx.rank_caches
        if rank_caches is None and ctx.shard is not None and ctx.shard.size > 1:
            pools = RankPools(kv_cache, ctx.shard)
            kv_cache, rank_caches = pools.kv_cache, pools.rank_caches
        self.worker = NodeStoreWorker(kv_cache, self.store.io, node_store=self.store, rank_caches=rank_caches,
                                      rank_pools=pools)
        return self.worker

    def scheduler_half(self, ctx: SchedulerContext) -> KVConnectorScheduler:
        worker = self.worker
        assert worker is not None, "the worker half is made first"
        # Lookups run on the step's path: they only go out while the
        # worker's I/O thread (which owns reconnecting) sees the store up.
        source = StoreKVSource(self.store.index, ctx.block_size, self.config.kv_tiers.max_load_tokens,
                               is_up=lambda: worker.store_up)
        return TierKVScheduler(source, write_down=True)


class RankPoolConnector(KVConnector):
    """A worker rank's part of a connector that runs on rank 0 alone (the
    node KV store): its pool in shared memory, where rank 0 reaches it."""

    moves_pool = True

    def worker_half(self, ctx: WorkerContext) -> KVConnectorWorker:
        moved = ctx.rank_caches is not None or ctx.shard is None or ctx.shard.size == 1
        return RankPoolWorker(ctx.kv_cache, None if moved else RankPools(ctx.kv_cache, ctx.shard))

    def scheduler_half(self, ctx: SchedulerContext) -> KVConnectorScheduler:
        raise RuntimeError("a worker rank has no scheduler")


class StagePoolConnector(KVConnector):
    """A pipeline-parallel core's rank other than rank 0 (a later stage, or
    with -tp a stage's TP rank): its part of the node store's connector,
    which runs on rank 0: its pool in shared memory, where rank 0 reaches it."""

    moves_pool = True

    def worker_half(self, ctx: WorkerContext) -> KVConnectorWorker:
        assert ctx.stage is not None, "a pipeline stage's runner"
        if ctx.stage_caches is not None:  # mapped already (the P/D transfer's)
            return StagePoolWorker(None, ctx.kv_cache)
        tp_rank, tp = (ctx.shard.rank, ctx.shard.size) if ctx.shard is not None else (0, 1)
        return StagePoolWorker(StagePools(ctx.kv_cache, ctx.stage, ctx.num_layers, ctx.stage_pool, tp_rank, tp))

    def scheduler_half(self, ctx: SchedulerContext) -> KVConnectorScheduler:
        raise RuntimeError("a later pipeline stage has no scheduler")


class PDTransferConnector(KVConnector):
    moves_pool = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker: PDTransferWorker | None = None

    def worker_half(self, ctx: WorkerContext) -> KVConnectorWorker:
        if ctx.stage is not None and ctx.stage.size > 1:  # every rank sends its own layers' heads (stage_transfer.py)
            self.worker = StageTransferWorker(ctx.kv_cache, self.config.kv_transfer, ctx.stage, ctx.num_layers,
                                              ctx.stage_pool, ctx.shard, ctx.speculative, ctx.draft_kv_cache)
            return self.worker
        self.worker = PDTransferWorker(ctx.kv_cache, self.config.kv_transfer, ctx.draft_kv_cache, ctx.speculative,
                                       ctx.shard)
        return self.worker

    def scheduler_half(self, ctx: SchedulerContext) -> KVConnectorScheduler:
        assert self.worker is not None, "the worker half is made first"
        return PDTransferScheduler(self.worker.settings())


class MultiKVConnector(KVConnector):
    """Several connectors as one (see the two ``multi.py`` halves for the
    rules). Each worker half is built over the pool the one before left,
    those that move the pool (the prefill/decode transfer's shared memory,
    the node store's over ranks or stages) first."""

    def __init__(self, config: EngineConfig, connectors: list[KVConnector]) -> None:
        super().__init__(config)
        self.connectors = list(connectors)

    def worker_half(self, ctx: WorkerContext) -> KVConnectorWorker:
        """The halves that move the pool are made first (in order), the rest
        over the pool they left, the one the runner computes in: host swap
        made before the node store moved a tensor-parallel core's pool would
        copy a pool no step writes. The workers keep the connectors' order."""
        order = sorted(range(len(self.connectors)), key=lambda i: not self.connectors[i].moves_pool)
        workers: dict[int, KVConnectorWorker] = {}
        for i in order:
            worker = workers[i] = self.connectors[i].worker_half(ctx)
            ctx = replace(ctx, kv_cache=worker.kv_cache, rank_caches=getattr(worker, "rank_caches", ctx.rank_caches),
                          stage_caches=getattr(worker, "stage_caches", ctx.stage_caches))
        return MultiKVConnectorWorker([workers[i] for i in range(len(self.connectors))], ctx.kv_cache)

    def scheduler_half(self, ctx: SchedulerContext) -> KVConnectorScheduler:
        return MultiKVConnectorScheduler([c.scheduler_half(ctx) for c in self.connectors])


def load_connector(spec: str) -> type[KVConnector]:
    """The class named by ``module:Class`` (ValueError naming the flag when
    it cannot be imported or is not a KVConnector)."""
    module_name, _, class_name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"kv_connector {spec!r} cannot be loaded: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, KVConnector)):
        raise ValueError(f"kv_connector {spec!r} is not a kvferry.engine.kv_connector.KVConnector")
    return cls


def for_engine(config: EngineConfig, block_nbytes: int = 0, rank: int = 0, stage: int = 0) -> KVConnector | None:
    """The connector a configuration asks for (None: the device pool alone).
    ``block_nbytes``: one device block's bytes (the node store's slot size:
    times the tensor-parallel ranks, as the store holds whole blocks);
    ``rank``, ``stage``: a tensor-parallel worker rank's, a later pipeline
    stage's (> 0: no store of its own, its pool where rank 0 reaches it)."""
    connectors: list[KVConnector] = []
    par = config.parallel
    if config.kv_transfer.kv_transfer_address:
        connectors.append(PDTransferConnector(config))  # first: it moves the pool into shared memory
    swap = [HostSwapConnector(config)] if config.cache.num_swap_blocks else []
    store: list[KVConnector] = []
    if config.kv_tiers.enabled:
        # Pipeline stages: the slot's size comes with stage 0's pools of every stage (worker_half).
        whole = None if par.pipeline_parallel_size > 1 else block_nbytes * par.tensor_parallel_size
        store = [NodeStoreConnector(config, whole) if rank == 0 and stage == 0
                 else StagePoolConnector(config) if par.pipeline_parallel_size > 1 else RankPoolConnector(config)]
    connectors += swap + store  # host swap first: preemption's first choice (MultiKVConnectorScheduler)
    if config.kv_connector:
        connectors.append(load_connector(config.kv_connector)(config))
    if len(connectors) > 1:
        return MultiKVConnector(config, connectors)
    return connectors[0] if connectors else None
