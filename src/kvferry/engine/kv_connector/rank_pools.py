"""A tensor-parallel core's KV pools in shared memory, so that rank 0's
connectors reach every rank's KV heads.

Each rank's runner holds only its own heads (``[r K/N, (r+1) K/N)``). A
connector that moves whole blocks (the node KV store) or receives them for
every rank (prefill/decode transfer) runs on rank 0, so the pools go into
shared memory when such a connector is built: rank 0 creates every rank's
segment (``rank_pool_name``: rank r's is rank 0's name with ``-rank{r}``,
so the segments go with rank 0) and publishes the name through the group's
store; rank r, whose runner is built after rank 0's (tp_ranks.RunnerShape),
maps its own. Rank 0 then holds ``rank_caches``: ranks 1..N-1's pool
tensors, in rank order, each ``[layers, 2, blocks, block_size, K/N, head_dim]``
over the same block ids as its own.
"""
from __future__ import annotations

import torch

from kvferry.core.outputs import KVOrders
from kvferry.disagg.blocks import SharedKVPool, rank_pool_name
from kvferry.engine.kv_connector.base import KVCompletions, KVConnectorWorker
from kvferry.model.layers.parallel import TPShard

# The group store's key for rank 0's pool name (one core per group).
_POOL_KEY = "kv_transfer_pool"


def shared_rank_pools(kv_cache: torch.Tensor, shard: TPShard) -> tuple[SharedKVPool, list[SharedKVPool]]:
    """(this rank's pool in shared memory, and on rank 0 ranks 1..N-1's,
    which it creates): every rank's pool has rank 0's shape (the same
    blocks, K / N heads each)."""
    shape, dtype = tuple(kv_cache.shape), kv_cache.dtype
    group = getattr(shard.group, "group", shard.group)  # ShmAllReduce wraps the ProcessGroup
    if shard.rank == 0:
        pool = SharedKVPool.create(shape, dtype)
        others = [SharedKVPool.create(shape, dtype, name=rank_pool_name(pool.name, r)) for r in range(1, shard.size)]
        group.store_set(_POOL_KEY, pool.name)
        return pool, others
    name = rank_pool_name(group.store_get(_POOL_KEY), shard.rank)
    block_shape = (shape[0], shape[1], *shape[3:])  # (layers, 2, block_size, kv_heads, head_dim)
    return SharedKVPool.attach(name, block_shape, dtype), []


class RankPools:
    """This rank's pool moved into shared memory (and on rank 0 the others'),
    owned until ``close``."""

    def __init__(self, kv_cache: torch.Tensor, shard: TPShard) -> None:
        self.pool, self.others = shared_rank_pools(kv_cache, shard)
        self.kv_cache = self.pool.tensor
        self.rank_caches = [p.tensor for p in self.others]

    def close(self) -> None:
        self.kv_cache, self.rank_caches = None, []
        for pool in (self.pool, *self.others):
            pool.close()


class RankPoolWorker(KVConnectorWorker):
    """A worker rank's stand-in for a connector that runs on rank 0 only
    (the node KV store): no orders of its own, its pool moved into shared
    memory where rank 0 reads and writes its heads. ``pools`` None: the
    pool was moved already (a connector before it did)."""

    # Rank 0's orders reach every rank with the step; they are rank 0's to run.
    order_kinds = frozenset({"load", "save"})

    def __init__(self, kv_cache: torch.Tensor, pools: RankPools | None) -> None:
        self.pools = pools
        self.kv_cache = kv_cache if pools is None else pools.kv_cache

    def run_orders(self, orders: KVOrders) -> None:
        pass  # rank 0's half runs them, over this rank's pool too

    def take_finished(self, idle: bool = False) -> KVCompletions:
        return KVCompletions()

    def close(self) -> None:
        if self.pools is not None:
            self.pools.close()
