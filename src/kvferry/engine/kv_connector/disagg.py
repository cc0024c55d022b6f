"""Prefill/decode transfer, worker half: the runner's end of
``kvferry.disagg`` (the transfer agent, its receiver and sender threads).

On CPU the KV pool moves into shared memory first, so that a prefill core
on this host writes a decode core's blocks in place; on a GPU it stays
where it is. A draft model's pool (speculative method "draft") travels with
the target's, as layers after them.

Tensor parallelism: each rank's runner makes its own worker half over its
own pool (its KV heads). Rank 0 creates every rank's pool in shared memory
(``rank_pools.py``: rank r's name is rank 0's with ``-rank{r}``, so a peer
needs one name and the rank count) and rank r maps its own. Rank 0
holds the transfer socket and receives for every rank; every rank sends
its own heads (kvferry.disagg.agent).
"""
from __future__ import annotations

import torch

from kvferry.config import KVTransferConfig
from kvferry.core.kv_connector import KVTransferSettings
from kvferry.core.outputs import KVOrders
from kvferry.disagg.agent import KVTransferAgent, StepTransfer
from kvferry.disagg.transport import SharedKVPool
from kvferry.engine.kv_connector.base import KVCompletions, KVConnectorWorker
from kvferry.engine.kv_connector.rank_pools import shared_rank_pools
from kvferry.model.layers.parallel import TPShard


class PDTransferWorker(KVConnectorWorker):
    order_kinds = frozenset({"receive", "stream"})

    def __init__(self, kv_cache: torch.Tensor, config: KVTransferConfig,
                 draft_kv_cache: torch.Tensor | None = None, speculative: str = "",
                 shard: TPShard | None = None) -> None:
        """``shard``: this rank of a tensor-parallel core (None: one rank)."""
        rank, size = (shard.rank, shard.size) if shard is not None else (0, 1)
        pool, rank_pools = None, []
        if kv_cache.device.type == "cpu":
            pool, rank_pools = shared_rank_pools(kv_cache, shard) if size > 1 else (
                SharedKVPool.create(tuple(kv_cache.shape), kv_cache.dtype), [])
            kv_cache = pool.tensor
        self.config = config
        self.tp_size = size
        self.agent = KVTransferAgent(kv_cache, config, pool, draft_kv_cache, speculative, tp_rank=rank,
                                     tp_size=size, rank_pools=rank_pools)
        self.kv_cache = self.agent.kv_cache
        # Moved into shared memory over ranks: rank 0's views of the other
        # ranks' pools (a worker rank's: none), for the connectors after this one.
        self.rank_caches = [p.tensor for p in rank_pools] if pool is not None and size > 1 else None

    def settings(self) -> KVTransferSettings:
        """What the scheduler half announces to prefill cores."""
        c = self.config
        return KVTransferSettings(self.agent.address, self.agent.shm_name, c.kv_transfer_timeout_s,
                                  c.kv_transfer_failure == "recompute", tp_size=self.tp_size)

    def run_orders(self, orders: KVOrders) -> None:
        self.agent.expect(orders)

    def begin_step(self, orders: KVOrders) -> StepTransfer | None:
        return self.agent.begin_step(orders) if orders.stream else None

    def finished_requests(self, request_ids: list[str]) -> None:
        self.agent.finished_requests(request_ids)

    def take_finished(self, idle: bool = False) -> KVCompletions:
        if idle:
            self.agent.wait(0.005)  # only transfers outstanding: no spinning
        received, failed, failed_received, sent = self.agent.take()
        done = KVCompletions(finished_sending=sent, failed_loading=dict(failed))
        for rid, r in received.items():
            done.finished_loading.append(rid)
            done.kv_received[rid] = r.output_token_ids
            done.payloads[rid] = r
        for rid, r in failed_received.items():
            done.kv_received[rid] = r.output_token_ids
        return done

    def close(self) -> None:
        self.agent.close()
