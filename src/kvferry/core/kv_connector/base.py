"""The scheduler half of a KV connector: what moves KV in and out of the
device pool, decided at scheduling time. No torch here.

A KV connector has two halves, after the shape of vLLM's v1 connector.
This half lives in the scheduler and plans; the worker half
(``kvferry.engine.kv_connector``) lives in the runner and executes the
orders this half writes into ``SchedulerOutput.kv_orders``. The scheduler
calls a connector at five points of a request's life::

    admission     resume_tokens / get_num_new_matched_tokens   how much KV comes from outside, async or not
                  update_state_after_alloc                     order it into the blocks just allocated
    each step     start_step, on_scheduled, request_computed   orders riding this step; saves of what it wrote
    preemption    on_preempt                                   keep the KV somewhere (swap, store) or not
    results       load_finished / load_failed, apply_completions
    finish        request_finished                             free the blocks now, or hold them for I/O

Every hook has a do-nothing default, so an implementation overrides only
what it takes part in. ``MultiKVConnectorScheduler`` composes several.

The scheduler keeps the generic part of every load: it allocates the
blocks, parks a request whose load is asynchronous in ``WAITING_FOR_KV``
(``Scheduler.loading``) and frees blocks late while a load still writes
them. A connector never allocates or frees device blocks itself; it may pin
blocks for its own I/O (``KVCacheManager.pin``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvferry.core.outputs import KVOrders, RunnerOutput

if TYPE_CHECKING:
    from kvferry.core.kv_manager import KVCacheManager
    from kvferry.types.stats import SchedulerStats
    from kvferry.messages import EngineCoreOutput, KVDestination
    from kvferry.core.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ExternalTokens:
    """Tokens past the prefix hit whose KV a connector can supply (a
    multiple of the block size). ``is_async``: the load completes in a later
    step (the request waits for it); else the KV is in place before this
    step's forward pass."""

    num_tokens: int = 0
    is_async: bool = False


NO_EXTERNAL_TOKENS = ExternalTokens()


class SchedulerControl(Protocol):
    """What a connector may do to requests, through the scheduler that owns them."""

    kv: KVCacheManager

    def append_tokens(self, request: Request, tokens: list[int]) -> RequestStatus | None:
        """Append tokens sampled elsewhere, applying the stop rules; the stop, if any."""
        ...

    def finish(self, request: Request, status: RequestStatus) -> None: ...

    def core_output(self, request: Request, new_tokens: list[int]) -> EngineCoreOutput: ...

    def mark_loaded(self, request: Request, num_tokens: int) -> None:
        """``num_tokens`` more of the request's KV is in its blocks, loaded
        from a cache (counted as cached for a prompt's first load)."""
        ...


class KVConnectorScheduler:
    """Scheduler half of a KV connector; every hook defaults to doing nothing."""

    control: SchedulerControl
    # Whether queued requests may start this connector's asynchronous loads
    # before they are admitted (``core/load_ahead.py``): worth it for a
    # tier whose loads take a while and need nothing but blocks.
    can_load_ahead = False

    def bind(self, control: SchedulerControl) -> None:
        """Called once by the scheduler that uses this connector."""
        self.control = control

    # -- admission -------------------------------------------------------------
    def resume_tokens(self, request: Request) -> int:
        """Computed tokens of a preempted request whose KV this connector
        kept and restores synchronously (host swap). Non-zero: the scheduler
        skips the prefix lookup and counts them as computed for the step."""
        return 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalTokens:
        """A first admission: the tokens after ``num_computed_tokens`` (the
        prefix hit) whose KV can come from outside. Must leave at least the
        last prompt token to compute unless the KV arrives with the request's
        first token (prefill/decode transfer)."""
        return NO_EXTERNAL_TOKENS

    def update_state_after_alloc(self, request: Request, external: ExternalTokens,
                                 orders: KVOrders) -> KVDestination | None:
        """Blocks are allocated for the request (its prefix hit counted as
        computed); ``external`` is what this connector matched (0 tokens if
        another connector did, or none). Write the orders that fill them.
        A returned ``KVDestination`` is announced to the front end at once."""
        return None

    # -- each step ---------------------------------------------------------------
    def start_step(self, orders: KVOrders) -> None:
        """A new step: add orders deferred from the last results (saves)."""

    def on_scheduled(self, request: Request, num_new_tokens: int, orders: KVOrders) -> None:
        """The request runs ``num_new_tokens`` this step (e.g. stream them, layer by layer)."""

    def request_computed(self, request: Request) -> None:
        """A step wrote the request's KV and its full blocks were published."""

    # -- preemption --------------------------------------------------------------
    def on_preempt(self, request: Request, orders: KVOrders) -> bool:
        """The request is preempted and its blocks freed right after. True:
        this connector took care of its KV (another one is not asked)."""
        return False

    # -- results -----------------------------------------------------------------
    def load_finished(self, request: Request, num_tokens: int, result: RunnerOutput,
                      outputs: list[EngineCoreOutput]) -> None:
        """An asynchronous load of ``num_tokens`` this connector ordered completed."""
        self.control.mark_loaded(request, num_tokens)

    def load_failed(self, request: Request, reason: str, result: RunnerOutput,
                    outputs: list[EngineCoreOutput]) -> None:
        """An asynchronous load this connector ordered failed; the request
        must not read its blocks. Default: recompute from the prefix hit."""
        request.status = type(request.status).WAITING

    def apply_completions(self, result: RunnerOutput) -> None:
        """Saves and sends the worker half reported done."""

    # -- finish ------------------------------------------------------------------
    def request_finished(self, request: Request) -> bool:
        """The request finished (any reason). True: hold its blocks until
        this connector's I/O on them completes (released by the scheduler on
        ``finished_sending``)."""
        return False

    def has_pending(self) -> bool:
        """Orders still to hand out or to see completed (the engine keeps stepping)."""
        return False

    def fill_stats(self, stats: SchedulerStats) -> None:
        """Add this connector's counters to the scheduler's."""
