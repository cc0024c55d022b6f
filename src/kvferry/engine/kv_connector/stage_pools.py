"""A pipeline-parallel core's KV pools in shared memory, so that stage 0's
node-store connector reaches every stage's layers.

Each stage's runner holds only its own layers' KV (``engine/pp_runner.py``).
With a KV store, stage 0 creates every stage's pool segment
(``stage_pool_name``: stage s's is stage 0's name with ``-stage{s}``, so the
segments go with stage 0's process) and names its own in the pool shape it
sends the stages (``tp_ranks.RunnerShape.kv_pool``); stage s maps its own.
Stage 0 then holds ``stage_caches``: stages 1..P-1's pools in stage order,
each ``[its layers, 2, blocks, block_size, kv_heads, head_dim]`` over the
same block ids as its own, so a store slot holds a whole block, every
stage's layers in order, as a PP 1 core's pool would:

    slot:  [ layers of stage 0 | layers of stage 1 | ... ][2][block_size][kv_heads][head_dim]

With ``-tp T`` too, each stage is T ranks, each holding its layers' KV
heads ``[t K/T, (t+1) K/T)``: stage 0's TP rank 0 (the core) creates all
``T x P`` segments (``tp_stage_pool_name``), and a slot holds stage s's
layers with every TP rank's heads in rank order, the layout of one
process's pool again, so a block is whole only when every rank's shard is
in it.

The stages after the first run no store orders (``StagePoolWorker``):
stage 0's I/O thread reads and writes their layers. It reads a block's
layers only after the step that wrote them (stage 0's step ends when the
last stage's output arrives, after every stage's layers of it), and a load
completes before the scheduler lets any stage read its blocks.
"""
from __future__ import annotations

import torch

from kvferry.core.outputs import KVOrders
from kvferry.disagg.blocks import SharedKVPool, rank_pool_name
from kvferry.engine.kv_connector.base import KVCompletions, KVConnectorWorker
from kvferry.parallel.pipeline import PPStage, pp_layer_range


def stage_pool_name(base: str, stage: int) -> str:
    """Stage ``stage``'s pool segment (stage 0's is ``base``)."""
    return base if stage == 0 else f"{base}-stage{stage}"


def draft_pool_name(base: str) -> str:
    """The draft model's pool segment (method "draft", on the last stage's TP rank 0)."""
    return f"{base}-draft"


def tp_stage_pool_name(base: str, stage: int, tp_rank: int = 0) -> str:
    """The segment of stage ``stage``'s TP rank ``tp_rank`` (stage 0's TP
    rank 0 is ``base``; without TP, ``stage_pool_name``'s)."""
    return rank_pool_name(stage_pool_name(base, stage), tp_rank)


class StagePools:
    """This rank's pool moved into shared memory (and on stage 0's TP rank 0
    every other rank's, which it creates), owned until ``close``.
    ``pool_name``: stage 0's segment (another rank passes it; stage 0's TP
    rank 0 passes ""). ``tp_rank``, ``tp_size``: this rank's place in its
    stage's tensor-parallel group (every stage has ``tp_size`` ranks).
    ``draft_kv_cache``: method "draft" beside a KV transfer, on the creator
    (a tensor of the draft pool's shape, never read: it receives into the
    segment) and on the rank that drafts (the last stage's TP rank 0, which
    maps it and drafts in it); ``draft_kv_cache`` is then the mapping."""

    def __init__(self, kv_cache: torch.Tensor, stage: PPStage, num_layers: int, pool_name: str = "",
                 tp_rank: int = 0, tp_size: int = 1, draft_kv_cache: torch.Tensor | None = None) -> None:
        shape, dtype = tuple(kv_cache.shape), kv_cache.dtype  # [stage layers, 2, blocks, bs, H/T, D]
        self.others: list[SharedKVPool] = []
        self.tp_size = tp_size
        if stage.rank == 0 and tp_rank == 0:
            self.pool = SharedKVPool.create(shape, dtype)
            # Stage-major, TP rank minor: the order of the core's ranks (rank = stage x T + TP rank).
            for s in range(stage.size):
                start, end = pp_layer_range(num_layers, s, stage.size)
                for t in range(tp_size):
                    if s or t:
                        self.others.append(SharedKVPool.create((end - start, *shape[1:]), dtype,
                                                               name=tp_stage_pool_name(self.pool.name, s, t)))
        else:
            self.pool = SharedKVPool.attach(tp_stage_pool_name(pool_name, stage.rank, tp_rank),
                                            (shape[0], shape[1], *shape[3:]), dtype)
        self.pool_name = self.pool.name
        self.draft: SharedKVPool | None = None
        if draft_kv_cache is not None:
            d = tuple(draft_kv_cache.shape)
            self.draft = (SharedKVPool.create(d, draft_kv_cache.dtype, name=draft_pool_name(self.pool.name))
                          if stage.rank == 0 and tp_rank == 0 else
                          SharedKVPool.attach(draft_pool_name(pool_name), (d[0], d[1], *d[3:]), draft_kv_cache.dtype))
        self.draft_kv_cache = self.draft.tensor if self.draft is not None else None
        self.kv_cache = self.pool.tensor
        # On the creator: every other rank's pool, in rank order (stage 0's TP ranks 1.., then stage 1's ...).
        self.stage_caches = [p.tensor for p in self.others]

    def rank_layers(self) -> list[list[torch.Tensor]]:
        """On the creator: per TP rank t, its pool layers of every stage in the
        model's layer order (stage 0's TP rank t's, then stage 1's ...), each
        ``[2, blocks, block_size, kv_heads / T, head_dim]``: where a layer's
        heads land, whichever stage and TP rank hold them."""
        pools = [self.kv_cache, *self.stage_caches]  # rank r = stage x T + TP rank
        num_stages = len(pools) // self.tp_size
        return [[layer for s in range(num_stages) for layer in pools[s * self.tp_size + t]]
                for t in range(self.tp_size)]

    def close(self) -> None:
        self.kv_cache, self.stage_caches, self.draft_kv_cache = None, [], None
        for pool in (self.pool, *self.others, *([self.draft] if self.draft is not None else [])):
            pool.close()


class StagePoolWorker(KVConnectorWorker):
    """A later stage's stand-in for stage 0's node-store connector: no
    orders of its own, its pool in shared memory where stage 0 reads and
    writes its layers."""

    # Stage 0's orders reach every stage with the step; they are stage 0's to run.
    order_kinds = frozenset({"load", "save"})

    def __init__(self, pools: StagePools | None, kv_cache: torch.Tensor | None = None) -> None:
        """``pools`` None: the pool is in shared memory already (the P/D
        transfer's), ``kv_cache``."""
        self.pools = pools
        self.kv_cache = kv_cache if pools is None else pools.kv_cache
        self.step = None  # StageRunner's hook slot (no stream over this connector)

    def run_orders(self, orders: KVOrders) -> None:
        pass  # stage 0's half runs them, over this stage's pool too

    def take_finished(self, idle: bool = False) -> KVCompletions:
        return KVCompletions()

    def close(self) -> None:
        if self.pools is not None:
            self.pools.close()
