"""Request: one sequence's bookkeeping, shared by scheduler and engine. No torch.

The one rule: each step gives a request tokens so that ``num_computed_tokens``
catches up with ``num_tokens``. Prefill chunks, prefix-cache hits, preemption
(``num_computed_tokens`` reset to 0) and decode are all that rule.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvferry.types.cache_scope import CacheScope
from kvferry.sampling import SamplingParams

# Requests built without a scope: one tenant, every block private.
DEFAULT_CACHE_SCOPE = CacheScope()


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    # Blocks allocated, KV on its way from elsewhere (a tier, another
    # worker); the scheduler skips the request until the load completes.
    WAITING_FOR_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, stop token or stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or context length
    FINISHED_ABORTED = enum.auto()
    # The request can never be served (e.g. it outgrew the whole KV pool).
    FINISHED_ERROR = enum.auto()
    # A prefill-role request (disaggregation): its prompt's KV and first
    # token went to a decode core, which continues it.
    FINISHED_PREFILLED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
    RequestStatus.FINISHED_PREFILLED,
}

FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_PREFILLED: "prefilled",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    # Where its KV blocks are keyed and whose they are (tenant namespace,
    # public prefix blocks, quota, tenant, weight): the scope the server
    # built for the caller, as it crossed the wire. The properties below
    # read and write its fields under the names the scheduler and the KV
    # manager use.
    cache_scope: CacheScope = DEFAULT_CACHE_SCOPE
    # Every end-of-sequence id of the model (Llama 3 has two).
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 0  # 0: unbounded (set by the engine)
    # Prefill/decode disaggregation: a messages.KVTransferParams (its role and,
    # for "prefill", the decode core's KVDestination); None: both phases here.
    kv_transfer: object | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens found in the prefix cache the first time this request was
    # scheduled; None until then.
    num_cached_tokens: int | None = None
    # Draft tokens to verify in the next step (filled by a proposer; the
    # scheduler clears them once the step's result is in).
    spec_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Chained block hashes of the full blocks of all_token_ids, grown lazily.
    block_hashes: list[bytes] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    # -- the cache scope's fields, by their old names ------------------------
    # A scope is immutable: a setter swaps in a changed copy (validated), so
    # a scope the request was given is never changed under another holder.
    @property
    def cache_namespace(self) -> str:
        """The tenant's private namespace (narrowed by its cache salt)."""
        return self.cache_scope.namespace

    @cache_namespace.setter
    def cache_namespace(self, value: str) -> None:
        self.cache_scope = self.cache_scope.replace(namespace=value)

    @property
    def public_cache_namespace(self) -> str:
        """The namespace of the first ``num_public_blocks`` blocks (see core/hashing.py)."""
        return self.cache_scope.public_namespace

    @public_cache_namespace.setter
    def public_cache_namespace(self, value: str) -> None:
        self.cache_scope = self.cache_scope.replace(public_namespace=value)

    @property
    def num_public_blocks(self) -> int:
        """Leading blocks wholly inside a declared public prefix."""
        return self.cache_scope.num_public_blocks

    @num_public_blocks.setter
    def num_public_blocks(self, value: int) -> None:
        self.cache_scope = self.cache_scope.replace(num_public_blocks=value)

    @property
    def writes_public_blocks(self) -> bool:
        """Only a declaration's own prefill writes public blocks; every other
        request reads them or stays private (core/kv_manager.py)."""
        return self.cache_scope.writes_public

    @writes_public_blocks.setter
    def writes_public_blocks(self, value: bool) -> None:
        self.cache_scope = self.cache_scope.replace(writes_public=value)

    @property
    def cache_quota_blocks(self) -> int | None:
        """Most blocks the cache may hold for the tenant (its device quota,
        as the server saw it); None: no cap."""
        return self.cache_scope.quota_blocks

    @cache_quota_blocks.setter
    def cache_quota_blocks(self, value: int | None) -> None:
        self.cache_scope = self.cache_scope.replace(quota_blocks=value)

    @property
    def tenant(self) -> str:
        """The caller's tenant as the server authenticated it ("" with one tenant)."""
        return self.cache_scope.tenant

    @tenant.setter
    def tenant(self, value: str) -> None:
        self.cache_scope = self.cache_scope.replace(tenant=value)

    @property
    def tenant_weight(self) -> float:
        """The tenant's share of the engine relative to others (core/fairness.py)."""
        return self.cache_scope.tenant_weight

    @tenant_weight.setter
    def tenant_weight(self, value: float) -> None:
        self.cache_scope = self.cache_scope.replace(tenant_weight=value)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
