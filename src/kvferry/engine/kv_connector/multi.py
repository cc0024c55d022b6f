"""Several connectors as one, worker half: every order goes to the worker
that executes its kind, completions are gathered in the workers' order,
and the layer hooks of the (one) worker that streams are the step's."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvferry.core.outputs import KVOrders
from kvferry.engine.kv_connector.base import KVCompletions, KVConnectorWorker, _W
from kvferry.types.stats import SchedulerStats

if TYPE_CHECKING:
    import torch


class MultiKVConnectorWorker(KVConnectorWorker):
    def __init__(self, workers: list[KVConnectorWorker], kv_cache: torch.Tensor | None = None) -> None:
        """``kv_cache``: the pool the runner computes in, where the workers
        that move it left it (default: the last worker's; each was built
        over the pool the one before left)."""
        if not workers:
            raise ValueError("a multi-connector needs at least one connector")
        self.workers = list(workers)
        self.order_kinds = frozenset().union(*(w.order_kinds for w in self.workers))
        self.kv_cache = self.workers[-1].kv_cache if kv_cache is None else kv_cache
        # Where a later pipeline stage maps its pool (the part that moved it there, if any).
        self.pool_name = next((name for w in self.workers if (name := getattr(w, "pool_name", ""))), "")

    def run_orders(self, orders: KVOrders) -> None:
        for worker in self.workers:
            worker.run_orders(orders)

    def begin_step(self, orders: KVOrders) -> Any:
        hooks = None
        for worker in self.workers:
            hooks = worker.begin_step(orders) or hooks
        self.step = hooks  # where a pipeline stage's runner reads them (as StageTransferWorker.step)
        return hooks

    def finished_requests(self, request_ids: list[str]) -> None:
        for worker in self.workers:
            worker.finished_requests(request_ids)

    def take_finished(self, idle: bool = False) -> KVCompletions:
        done = KVCompletions()
        for worker in self.workers:
            done.extend(worker.take_finished(idle))
        return done

    def wait_for_io(self, timeout_s: float) -> bool:
        return any(worker.wait_for_io(timeout_s) for worker in self.workers)

    def report_stats(self, stats: SchedulerStats) -> None:
        for worker in self.workers:
            worker.report_stats(stats)

    def stats_changed(self) -> bool:
        return any(worker.stats_changed() for worker in self.workers)

    def purge_tenant(self, tenant: str) -> int:
        return sum(worker.purge_tenant(tenant) for worker in self.workers)

    def drop_public(self, keys: list[bytes]) -> int:
        return sum(worker.drop_public(keys) for worker in self.workers)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()

    def find(self, kind: type[_W]) -> _W | None:
        for worker in self.workers:
            found = worker.find(kind)
            if found is not None:
                return found
        return None
