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

The stages after the first run no store orders (``StagePoolWorker``):
stage 0's I/O thread reads and writes their layers. It reads a block's
layers only after the step that wrote them (stage 0's step ends when the
last stage's output arrives, after every stage's layers of it), and a load
completes before the scheduler lets any stage read its blocks.
"""
from __future__ import annotations

import torch

from kvferry.core.outputs import KVOrders
from kvferry.disagg.blocks import SharedKVPool
from kvferry.engine.kv_connector.base import KVCompletions, KVConnectorWorker
from kvferry.engine.kv_connector.stage_transfer import stage_pool_name
from kvferry.parallel.pipeline import PPStage, pp_layer_range


class StagePools:
    """This stage's pool moved into shared memory (and on stage 0 every
    other stage's, which it creates), owned until ``close``. ``pool_name``:
    stage 0's segment (a later stage passes it; stage 0 passes "")."""

    def __init__(self, kv_cache: torch.Tensor, stage: PPStage, num_layers: int, pool_name: str = "") -> None:
        shape, dtype = tuple(kv_cache.shape), kv_cache.dtype  # [stage layers, 2, blocks, bs, H, D]
        self.others: list[SharedKVPool] = []
        if stage.rank == 0:
            self.pool = SharedKVPool.create(shape, dtype)
            for s in range(1, stage.size):
                start, end = pp_layer_range(num_layers, s, stage.size)
                self.others.append(SharedKVPool.create((end - start, *shape[1:]), dtype,
                                                       name=stage_pool_name(self.pool.name, s)))
        else:
            self.pool = SharedKVPool.attach(stage_pool_name(pool_name, stage.rank),
                                            (shape[0], shape[1], *shape[3:]), dtype)
        self.pool_name = self.pool.name
        self.kv_cache = self.pool.tensor
        self.stage_caches = [p.tensor for p in self.others]

    def close(self) -> None:
        self.kv_cache, self.stage_caches = None, []
        for pool in (self.pool, *self.others):
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
