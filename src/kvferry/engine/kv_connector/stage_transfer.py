"""Prefill/decode transfer over a pipeline-parallel core's stages.

Each stage holds only its layers' KV (``engine/pp_runner.py``). With a KV
transfer every stage's pool goes into shared memory: stage 0 creates them
all (``stage_pool_name``: stage s's is stage 0's name with ``-stage{s}``,
so the segments go with stage 0's process) and each later stage maps its
own, named in the pool shape rank 0 sends it (``tp_ranks.RunnerShape``).

    prefill core, stages of A                       decode core, stages of B
    stage s: layer i computed ─ layer start_s + i ─▶ stage 0's receiver: the model's layer j
             (its own agent, its own links)          lands in the pool of the stage holding j
    stage 0: the last stage's tokens ── Done ──────▶ (waits for every stage's chunks)

Every stage sends the layers it holds as it computes them, numbered as the
model's; stage 0 sends the Done once the last stage's tokens reach it, and
it alone hears acknowledgements (its scheduler frees the blocks). On the
decode side stage 0's receiver sees every stage's pool layers as one model,
so a chunk of layer j lands in the stage that holds j, whatever the prefill
core's split. A decode core of several stages announces no shared-memory
name: senders write over tcp into stage 0's receiver, which copies each
layer into its stage's pool.
"""
from __future__ import annotations

import torch

from kvferry.config import KVTransferConfig
from kvferry.core.kv_connector import KVTransferSettings
from kvferry.core.outputs import KVOrders
from kvferry.disagg.agent import KVTransferAgent, StageLayers, StepTransfer
from kvferry.disagg.blocks import SharedKVPool
from kvferry.engine.kv_connector.disagg import PDTransferWorker
from kvferry.parallel.pipeline import PPStage, pp_layer_range


def stage_pool_name(base: str, stage: int) -> str:
    """Stage ``stage``'s pool segment (stage 0's is ``base``)."""
    return base if stage == 0 else f"{base}-stage{stage}"


class StageTransferWorker(PDTransferWorker):
    """One stage's worker half: its pool in shared memory and its agent.
    ``pool_name``: stage 0's segment (a later stage maps its own from it;
    stage 0 passes "" and creates every stage's). ``step``: the step
    transfer ``begin_step`` made last (the stage runner hands it to the
    last micro-batch's layers)."""

    def __init__(self, kv_cache: torch.Tensor, config: KVTransferConfig, stage: PPStage, num_layers: int,
                 pool_name: str = "") -> None:
        shape, dtype = tuple(kv_cache.shape), kv_cache.dtype  # [stage layers, 2, blocks, bs, H, D]
        self.others: list[SharedKVPool] = []
        receive_layers = None
        if stage.rank == 0:
            pool = SharedKVPool.create(shape, dtype)
            for s in range(1, stage.size):
                start, end = pp_layer_range(num_layers, s, stage.size)
                self.others.append(SharedKVPool.create((end - start, *shape[1:]), dtype,
                                                       name=stage_pool_name(pool.name, s)))
            receive_layers = [*pool.tensor, *(layer for p in self.others for layer in p.tensor)]
        else:
            pool = SharedKVPool.attach(stage_pool_name(pool_name, stage.rank), (shape[0], shape[1], *shape[3:]),
                                       dtype)
        self.pool_name = pool.name
        self.config = config
        self.tp_size = 1
        self.agent = KVTransferAgent(pool.tensor, config, pool, stage=StageLayers(
            stage.rank, stage.size, stage.start, stage.end, num_layers, receive_layers))
        self.kv_cache = self.agent.kv_cache
        self.rank_caches = None
        # For a node store beside it (stage_pools.py): the other stages' pools on stage 0.
        self.stage_caches = [p.tensor for p in self.others]
        self.step: StepTransfer | None = None

    def settings(self) -> KVTransferSettings:
        """No shared-memory name: a sender writes over tcp, stage 0's receiver
        places each layer (one segment per stage, which no sender maps)."""
        c = self.config
        return KVTransferSettings(self.agent.address, "", c.kv_transfer_timeout_s,
                                  c.kv_transfer_failure == "recompute", tp_size=1)

    def begin_step(self, orders: KVOrders) -> StepTransfer | None:
        self.step = super().begin_step(orders)
        return self.step

    def close(self) -> None:
        super().close()
        for pool in self.others:
            pool.close()
