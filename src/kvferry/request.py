"""Request: one sequence's bookkeeping, shared by scheduler and engine. No torch.

The one rule: each step gives a request tokens so that ``num_computed_tokens``
catches up with ``num_tokens``. Prefill chunks, prefix-cache hits, preemption
(``num_computed_tokens`` reset to 0) and decode are all that rule.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvferry.sampling import SamplingParams


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
    # Cache namespace (tenant); comes from the server, never from the client.
    cache_namespace: str = ""
    # The first num_public_blocks blocks lie wholly inside a declared public
    # prefix and are keyed in public_cache_namespace (see core/hashing.py).
    public_cache_namespace: str = ""
    num_public_blocks: int = 0
    # Only a declaration's own prefill writes public blocks; every other
    # request reads them or stays private (core/kv_manager.py).
    writes_public_blocks: bool = False
    # Most blocks the cache may hold for cache_namespace (the tenant's
    # device quota, as the server sees it now); None: no cap.
    cache_quota_blocks: int | None = None
    # The caller's tenant as the server authenticated it ("" with one tenant).
    tenant: str = ""
    # The tenant's share of the engine relative to others (core/fairness.py).
    tenant_weight: float = 1.0
    # Every end-of-sequence id of the model (Llama 3 has two).
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 0  # 0: unbounded (set by the engine)
    # Worker to send this request's KV to when it finishes (prefill/decode
    # disaggregation); "" sends nothing.
    kv_send_peer: str = ""
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
        if not self.tenant_weight > 0:
            raise ValueError(f"tenant_weight must be > 0, got {self.tenant_weight}")

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
