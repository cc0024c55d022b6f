"""The scheduler <-> runner step contract: plain dataclasses, no torch.

Each step the scheduler sends deltas, never whole histories::

    SchedulerOutput
      new_requests      NewRequestData     first scheduling, or resumed after preemption: everything
      cached_requests   CachedRequestData  already known: new block ids, num_computed_tokens,
                                           tokens the runner did not sample itself
      num_scheduled_tokens                 tokens to compute per request (drafts included)
      spec_token_ids                       k draft tokens per request, verified by the runner
      kv_orders         KVOrders           the KV connector's orders: swap, load, save, receive, stream
      finished_request_ids, preempted_request_ids

    RunnerOutput
      sampled_token_ids  0 .. k+1 tokens per request (none for a non-final prefill chunk)
      logprobs           one entry per sampled token, for requests that ask
      prompt_logprobs    one entry per prompt token, once, for requests that ask
      pooled             the pooled final hidden state of a pooling (embedding) request
      finished_loading / finished_saving / finished_sending   KV order completions

The runner keeps each request's token ids and block table from the first
message on and appends the tokens it samples itself, so a decode step carries
only integers. The request's tokens to compute this step are
``token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens]``
where ``token_ids`` is the runner's copy followed by the step's drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.sampling import SamplingParams
# A wire type (it rides in EngineCoreOutput too); re-exported for the runner and sampler.
from kvferry.types.logprobs import TokenLogprobs  # noqa: F401


@dataclass(slots=True)
class NewRequestData:
    """A request the runner does not hold: first scheduled, or resumed after
    preemption (the runner dropped its row then)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    # The request's whole block table (prefix-hit blocks first).
    block_ids: list[int]
    num_computed_tokens: int
    # Tokens generated before a preemption: inputs to recompute, and history
    # for the penalties. Empty on first scheduling.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner holds from an earlier step."""

    request_id: str
    # Appended to the request's block table.
    new_block_ids: list[int]
    num_computed_tokens: int
    # Tokens appended since the runner last saw the request that it did not
    # sample itself. Empty in the steady state.
    new_token_ids: list[int] = field(default_factory=list)


# -- KV orders ------------------------------------------------------------------
# Each order names device block ids and where their KV goes to or comes from.
# Orders run before the step's forward pass, in the order listed in KVOrders,
# so a block swapped out may be reused by the same step.


@dataclass(slots=True)
class SwapOrder:
    """Copy whole blocks between the device pool and the runner's host swap
    space: ``device_block_ids[i] <-> host_slots[i]``."""

    request_id: str
    device_block_ids: list[int]
    host_slots: list[int]


@dataclass(slots=True)
class TransferOrder:
    """Move whole blocks between the device pool and a tier (``keys`` are
    the blocks' hashes)."""

    request_id: str  # the request's id, or an I/O id (a save: one request may have several in flight)
    device_block_ids: list[int]
    keys: list[bytes] = field(default_factory=list)
    # Whose blocks (tier quotas, encryption keys): the first
    # ``num_public_blocks`` keys lie in a public prefix, the rest are the tenant's.
    tenant: str = ""
    num_public_blocks: int = 0


@dataclass(slots=True)
class ReceiveOrder:
    """Decode side of a disaggregated request: expect KV from a prefill core
    into ``block_ids`` (complete once every layer arrived and checks out,
    failed at ``deadline``, time.monotonic())."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    deadline: float


@dataclass(slots=True)
class StreamOrder:
    """Prefill side: while this step's forward runs, send each layer's
    ``src_block_ids`` (this core's) into ``dst_block_ids`` (the decode
    core's) as soon as the layer is computed. ``last``: the step computes the
    end of the prompt; its first token and sampling state follow the KV."""

    request_id: str
    transfer_id: str
    address: str
    shm_name: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    # Every decode-core block of the transfer (checksummed once it is whole).
    all_dst_block_ids: list[int]
    # The first ``num_final_blocks`` of ``src_block_ids`` are complete after
    # this step (a trailing partly computed block is sent again later).
    num_final_blocks: int
    last: bool
    lease_s: float
    deadline: float
    # The decode core's tensor-parallel ranks (KVDestination.tp_size): each
    # rank here sends each of them the heads both hold (kvferry.disagg.heads).
    dst_tp_size: int = 1


@dataclass(slots=True)
class KVOrders:
    swap_out: list[SwapOrder] = field(default_factory=list)
    swap_in: list[SwapOrder] = field(default_factory=list)
    load: list[TransferOrder] = field(default_factory=list)
    save: list[TransferOrder] = field(default_factory=list)
    # Prefill/decode disaggregation: receives are registered before the
    # forward pass, streams run during it (layer by layer).
    receive: list[ReceiveOrder] = field(default_factory=list)
    stream: list[StreamOrder] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.load or self.save or self.receive or self.stream)


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # request_id -> tokens to compute this step, drafts included.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # request_id -> draft tokens appended after the request's known tokens;
    # the last len(drafts) of its scheduled tokens.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> the parent of each draft (-1: the request's newest token)
    # where its drafts are a tree (kvferry.spec.tree); absent: a chain.
    spec_tree_parents: dict[str, list[int]] = field(default_factory=dict)
    kv_orders: KVOrders = field(default_factory=KVOrders)
    # Finished since the last step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Preempted this step: the runner drops their rows (they come back, if
    # ever, as new requests).
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def scheduled_request_ids(self) -> list[str]:
        return list(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(slots=True)
class RunnerOutput:
    # request_id -> tokens accepted this step, in order: the verified drafts
    # then one token sampled by the target (0 .. k+1). Absent for a request
    # whose scheduled tokens did not reach the end of its known tokens.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> one entry per sampled token, for requests that ask.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # KV order completions, by request id, in completion order.
    finished_loading: list[str] = field(default_factory=list)
    finished_saving: list[str] = field(default_factory=list)
    finished_sending: list[str] = field(default_factory=list)
    # request_id -> leading blocks a finished load actually filled, present
    # only when fewer than ordered (missing or corrupt in the tier): the
    # rest are recomputed, never read.
    num_loaded_blocks: dict[str, int] = field(default_factory=dict)
    # Disaggregation, decode side: tokens the prefill core sampled, for each
    # request in finished_loading whose KV came from one; and receives that
    # failed (request id -> reason: timeout, checksum, incomplete, ...).
    kv_received: dict[str, list[int]] = field(default_factory=dict)
    failed_loading: dict[str, str] = field(default_factory=dict)
    # Prompt positions the draft model computed this step (method "draft").
    num_draft_prompt_tokens: int = 0
    # Requests that asked for work at prompt positions, reported once, on
    # the step that computed the end of the prompt: request_id -> one entry
    # per prompt token (None for the first, which has no context), and
    # request_id -> the pooled, L2-normalized final hidden state (pooling).
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # A pipeline's last stage with a draft head: each request's drafts for
    # its next step, made from this step's hidden states (and a draft tree's
    # parents); rank 0 puts them in the slots its scheduler reserves then.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_tree_parents: dict[str, list[int]] = field(default_factory=dict)
