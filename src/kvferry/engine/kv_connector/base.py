"""The worker half of a KV connector: moving KV blocks between the runner's
device pool and elsewhere (see ``kvferry.core.kv_connector`` for the
scheduler half, which decides).

The scheduler writes orders into ``SchedulerOutput.kv_orders``; the worker
half executes them and reports completions, which come back to the
scheduler in ``RunnerOutput``. Every order moves whole blocks in the one KV
layout of the pool, ``[num_layers, 2, block_size, num_kv_heads, head_dim]``
per block, so no reshaping happens anywhere on the way.

Contract:

* ``execute`` is called once per step, before the forward pass, with the
  step's orders; orders run in this order: swap out, swap in, save, load,
  receive. ``begin_step`` then returns the step's layer hooks, if any: the
  model calls ``layer_done(i)`` once layer ``i`` wrote its KV (the
  prefill/decode stream sends each layer while the next one computes).
* Swap orders are synchronous: they are complete when ``execute``
  returns. A swap-out reads its blocks before the forward pass writes any
  block, which is why the scheduler may hand the swapped-out blocks to
  another request in the same step.
* Load, save, receive and stream may be asynchronous. While one is in
  flight the scheduler keeps its device blocks pinned (held by the request,
  or by a delayed free): they are neither evicted nor reallocated. A load's
  blocks are not read by any forward pass until its completion.
* A completion means the data is where the order said: for a load, the KV
  is in the device blocks (a short load reports the leading blocks it
  filled; a failed one its reason); for a save, the tier holds it under its
  keys; for a send, the peer holds it and the device blocks may be freed.
* ``take_finished`` returns each completion exactly once.
* An order of a kind no connector of the engine handles is refused with a
  ValueError: nothing is dropped silently.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

    from kvferry.core.outputs import KVOrders
    from kvferry.types.stats import SchedulerStats

ORDER_KINDS = ("swap_out", "swap_in", "load", "save", "receive", "stream")

_W = TypeVar("_W", bound="KVConnectorWorker")


@dataclass(slots=True)
class KVCompletions:
    """Orders completed since the last ``take_finished``, by request id (an
    I/O id for a save), in completion order."""

    finished_loading: list[str] = field(default_factory=list)
    finished_saving: list[str] = field(default_factory=list)
    finished_sending: list[str] = field(default_factory=list)
    # Loads that filled fewer blocks than ordered: request id -> the leading
    # blocks filled (see RunnerOutput.num_loaded_blocks).
    num_loaded_blocks: dict[str, int] = field(default_factory=dict)
    # Loads that failed: request id -> reason (the blocks must not be read).
    failed_loading: dict[str, str] = field(default_factory=dict)
    # Tokens that came with a load (a prefill core's first token), and the
    # whole payload for the runner (a drafter's state), by request id.
    kv_received: dict[str, list[int]] = field(default_factory=dict)
    payloads: dict[str, Any] = field(default_factory=dict)

    def extend(self, other: KVCompletions) -> None:
        self.finished_loading += other.finished_loading
        self.finished_saving += other.finished_saving
        self.finished_sending += other.finished_sending
        self.num_loaded_blocks.update(other.num_loaded_blocks)
        self.failed_loading.update(other.failed_loading)
        self.kv_received.update(other.kv_received)
        self.payloads.update(other.payloads)


class KVConnectorWorker(ABC):
    """Worker half of a KV connector, owned by the runner."""

    # The order kinds (``ORDER_KINDS``) this worker executes.
    order_kinds: frozenset[str] = frozenset()
    # The pool the runner computes in: the one it was given, or a copy this
    # worker moved where a peer can reach it (shared memory).
    kv_cache: torch.Tensor

    def execute(self, orders: KVOrders) -> None:
        """Run or queue the step's orders; refuse kinds no part of this worker executes."""
        refuse_unhandled(orders, self.order_kinds)
        self.run_orders(orders)

    @abstractmethod
    def run_orders(self, orders: KVOrders) -> None:
        """Run or queue the step's orders of this worker's kinds (ignore the rest)."""

    def begin_step(self, orders: KVOrders) -> Any:
        """The step's layer hooks (``layer_done(i)``, ``draft_done()``,
        ``finish(...)``), or None when nothing happens between layers."""
        return None

    def finished_requests(self, request_ids: list[str]) -> None:
        """The scheduler finished these requests: end any I/O of theirs still open."""

    @abstractmethod
    def take_finished(self, idle: bool = False) -> KVCompletions:
        """Completions since the last call, each once. ``idle``: the step ran
        nothing, so a worker may wait briefly for one rather than let the
        step loop spin."""

    def wait_for_io(self, timeout_s: float) -> bool:
        """Block an idle step until some I/O completes (at most
        ``timeout_s``); False when this worker has no way to signal it."""
        return False

    def report_stats(self, stats: SchedulerStats) -> None:
        """Add this connector's counters to the core's ``stats`` (the node
        store: its tiers'). Called on the step's thread; must not block."""

    def stats_changed(self) -> bool:
        """Whether counters ``report_stats`` adds changed since it last ran
        (the core then reports stats while idle)."""
        return False

    def purge_tenant(self, tenant: str) -> int:
        """Drop what this connector keeps of ``tenant`` outside the device
        pool (the node store: its private blocks in every tier); how many."""
        return 0

    def drop_public(self, keys: list[bytes]) -> int:
        """Drop a deleted public prefix's own blocks (``keys``, their chain
        hashes) from what this connector keeps outside the device pool;
        how many."""
        return 0

    def close(self) -> None:
        """Stop threads and release what outlives the process otherwise."""

    def find(self, kind: type[_W]) -> _W | None:
        """This worker, or the part of it, of type ``kind`` (None: absent)."""
        return self if isinstance(self, kind) else None


def refuse_unhandled(orders: KVOrders, kinds: frozenset[str]) -> None:
    """ValueError for orders of a kind outside ``kinds``: a misconfigured
    engine must fail loudly, not drop KV."""
    for kind in ORDER_KINDS:
        if kind not in kinds and getattr(orders, kind):
            raise ValueError(f"{kind} orders need a KV connector that executes them; "
                             f"this engine's connectors execute {', '.join(sorted(kinds)) or 'none'}")
