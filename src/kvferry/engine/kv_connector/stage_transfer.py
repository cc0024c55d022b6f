"""Prefill/decode transfer over a pipeline-parallel core's stages (and,
with ``-tp T`` too, each stage's T tensor-parallel ranks).

Each stage holds only its layers' KV (``engine/pp_runner.py``), each of its
TP ranks only its KV heads of them. With a KV transfer every rank's pool
goes into shared memory: stage 0's TP rank 0 creates them all
(``stage_pools.StagePools``: rank (s, t)'s segment is stage 0's name with
``-stage{s}`` and ``-rank{t}``, so the segments go with rank 0's process)
and every other rank maps its own, named in the pool shape rank 0 sends it
(``tp_ranks.RunnerShape``).

    prefill core, stages of A (x T ranks)           decode core, stages of B (x U ranks)
    rank (s, t): layer i computed ─ layer start_s + i, its heads per decode TP rank ─▶
                 (its own agent, its own links)      rank (0, 0)'s receiver: the model's layer j,
                                                     heads [h0, h1) land in the pool of the rank
                                                     holding j and those heads
    rank (0, 0): the last stage's tokens ── Done ──▶ (waits for every rank's chunks)

Every rank sends the layers it holds as it computes them, numbered as the
model's, each cut into the heads each decode TP rank holds
(``disagg.heads``: its TP rank against the decode core's TP size, whatever
either side's stages); stage 0's TP rank 0 sends the Done once the last
stage's tokens reach it, and it alone hears acknowledgements (its scheduler
frees the blocks). On the decode side rank (0, 0)'s receiver sees, per TP
rank, every stage's pool layers as one model, so a chunk of layer j, heads
[h0, h1) lands in the stage that holds j, in the TP rank that holds those
heads, whatever the prefill core's layout. A decode core of several stages
announces no shared-memory name: senders write over tcp into rank (0, 0)'s
receiver, which copies each piece into its rank's pool.
"""
from __future__ import annotations

import torch

from kvferry.config import KVTransferConfig
from kvferry.core.kv_connector import KVTransferSettings
from kvferry.core.outputs import KVOrders
from kvferry.disagg.agent import KVTransferAgent, StageLayers, StepTransfer
from kvferry.engine.kv_connector.disagg import PDTransferWorker
from kvferry.engine.kv_connector.stage_pools import StagePools
from kvferry.model.layers.parallel import TPShard
from kvferry.parallel.pipeline import PPStage


class StageTransferWorker(PDTransferWorker):
    """One rank's worker half: its pool in shared memory and its agent.
    ``pool_name``: stage 0's segment (another rank maps its own from it;
    stage 0's TP rank 0 passes "" and creates every rank's). ``shard``: this
    rank of its stage's tensor-parallel group (None: one rank a stage).
    ``step``: the step transfer ``begin_step`` made last (the stage runner
    hands it to the last micro-batch's layers). ``speculative``: the core's
    speculation signature, which stage 0 sends with each Done and requires
    of each received one (a draft head's hidden state rides in the Done)."""

    def __init__(self, kv_cache: torch.Tensor, config: KVTransferConfig, stage: PPStage, num_layers: int,
                 pool_name: str = "", shard: TPShard | None = None, speculative: str = "",
                 draft_kv_cache: torch.Tensor | None = None) -> None:
        tp_rank, tp = (shard.rank, shard.size) if shard is not None else (0, 1)
        self.pools = StagePools(kv_cache, stage, num_layers, pool_name, tp_rank, tp, draft_kv_cache)
        # Method "draft": its pool in shared memory, where stage 0's receiver writes the draft's
        # layers of a received prompt and the last stage drafts (and sends them from, as a prefill core).
        self.draft_kv_cache = self.pools.draft_kv_cache
        creator = stage.rank == 0 and tp_rank == 0  # it receives, into every rank's pool
        self.pool_name = self.pools.pool_name
        self.config = config
        self.tp_size = tp
        self.agent = KVTransferAgent(self.pools.kv_cache, config, None, self.draft_kv_cache, speculative=speculative,
                                     tp_rank=tp_rank,
                                     tp_size=tp,
                                     stage=StageLayers(stage.rank, stage.size, stage.start, stage.end, num_layers,
                                                       self.pools.rank_layers() if creator else None))
        self.kv_cache = self.agent.kv_cache
        self.rank_caches = None
        # For a node store beside it (stage_pools.py): on the creator, every other rank's pool in rank order.
        self.stage_caches = self.pools.stage_caches
        self.step: StepTransfer | None = None

    def settings(self) -> KVTransferSettings:
        """No shared-memory name: a sender writes over tcp, rank (0, 0)'s
        receiver places each piece (one segment per rank, which no sender
        maps); the TP size, by which senders cut each layer's heads."""
        c = self.config
        return KVTransferSettings(self.agent.address, "", c.kv_transfer_timeout_s,
                                  c.kv_transfer_failure == "recompute", tp_size=self.tp_size)

    def begin_step(self, orders: KVOrders) -> StepTransfer | None:
        self.step = super().begin_step(orders)
        if self.step is not None and self.draft_kv_cache is not None and not self.agent.leads:
            # The last stage: its draft model runs after the step's sampling (pp_runner.py,
            # ``_draft_ahead``); this rank's part of the transfer ends after the draft's layers
            self.step.hold_finish = True
        return self.step

    def close(self) -> None:
        super().close()  # the agent's threads first: its sender reads the pool
        self.pools.close()
