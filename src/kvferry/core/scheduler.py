"""One step's plan: which requests run and how many tokens each.

The rule (after vLLM v1): each step gives every running request up to
``num_tokens - num_computed_tokens`` tokens (plus its draft tokens), within
a per-step token budget (``max_num_batched_tokens``) and a cap on concurrent
sequences (``max_num_seqs``). Running requests go first (decodes cost one
token each, plus drafts), then waiting ones are admitted with whatever budget
is left, chunking long prompts, in weighted fair order between tenants
(``core/fairness.py``; FCFS with one tenant). When blocks run out, the most
recently admitted running request of the most-served tenant is preempted
(with one tenant: the most recently admitted): its KV is swapped out to host memory
when the swap space has room, otherwise its blocks are freed and it is
recomputed from its (prefix-cached) tokens later. Neither changes a greedy
output.

With a KV store below the device pool (``write_down``), every newly full
block, generated tokens' included, is ordered saved after the step that
wrote it; its device block stays pinned until the runner reports the save
done. A finished request that asked for ``kv_retention_s`` has its blocks
retained in the store once its saves are done.

Entry points: ``add_request``, ``schedule`` -> SchedulerOutput,
``update_from_output`` -> list[EngineCoreOutput], ``finish_requests``.
"""
from __future__ import annotations

import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kvferry.config import SchedulerConfig
from kvferry.core.fairness import TenantFairness
from kvferry.core.kv_manager import KVCacheManager, PrefixHit
from kvferry.core.outputs import (
    CachedRequestData,
    NewRequestData,
    ReceiveOrder,
    RunnerOutput,
    SchedulerOutput,
    StreamOrder,
    SwapOrder,
    TransferOrder,
)
from kvferry.core.swap_space import HostSwapSpace
from kvferry.core.tier_source import StoreKVSource, TierLookupStats
from kvferry.core.stats import SchedulerStats
from kvferry.messages import EngineCoreOutput, KVDestination, KVTransferParams
from kvferry.request import FINISH_REASON, Request, RequestStatus


class _Skip:
    """``_admit`` result: leave the request queued, try the next one."""


_SKIP = _Skip()


class DraftProposer(Protocol):
    """Proposes draft tokens for a running request (n-gram, draft model,
    heads). The scheduler verifies at most ``num_speculative_tokens`` of them."""

    def propose(self, request: Request) -> list[int]: ...


class DraftBudget(Protocol):
    """Decides each request's k per step and learns from verification
    (``kvferry.spec.AdaptiveSpecController``)."""

    def num_drafts(self, request_id: str, num_running: int) -> int: ...

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None: ...

    def forget(self, request_id: str) -> None: ...


class ExternalKVSource(Protocol):
    """Scheduler side of a KV source outside the device pool (a tier, a
    prefill worker). The runner's KVConnector executes the load orders."""

    def num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after ``num_computed_tokens`` whose KV can be loaded; a
        multiple of the block size, leaving at least the last prompt token
        to compute."""
        ...


@dataclass(slots=True)
class KVTransferSettings:
    """This core's side of prefill/decode disaggregation (from the engine
    core once its transfer socket and KV pool exist)."""

    address: str  # the transfer socket a prefill core connects to
    shm_name: str  # the KV pool's shared-memory segment ("": none)
    timeout_s: float  # the lease of each transfer
    recompute_on_failure: bool  # else finish the request with an error


def first_decode_step(request: Request, swapped: "SwappedKV | None", hit: "PrefixHit") -> bool:
    """Admitted with its whole context's KV already in place but for the
    newest token (a decode-role request resumed with received KV)."""
    return (swapped is None and hit.num_tokens == 0 and request.num_output_tokens > 0
            and request.num_tokens - request.num_computed_tokens == 1)


def _role(request: Request) -> str:
    params = request.kv_transfer
    return params.role if isinstance(params, KVTransferParams) else ""


@dataclass(slots=True)
class SwappedKV:
    host_slots: list[int]
    num_tokens: int  # computed tokens whose KV the slots hold


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        swap_space: HostSwapSpace | None = None,
        kv_source: ExternalKVSource | None = None,
        proposer: DraftProposer | None = None,
        num_speculative_tokens: int = 0,
        draft_budget: DraftBudget | None = None,
        write_down: bool = False,
    ) -> None:
        self.config = config
        self.kv = kv
        self.swap_space = swap_space
        self.kv_source = kv_source
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_budget = draft_budget
        # Save full blocks to the node's KV store (kv_source: a StoreKVSource).
        self.write_down = write_down
        self.requests: dict[str, Request] = {}
        self.fairness = TenantFairness()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: dict[str, SwappedKV] = {}
        self.loading: dict[str, int] = {}  # request id -> external tokens in flight
        # Load at arrival: queued requests whose tier hits were looked up
        # ahead of admission -> the end (in tokens) of what the store held
        # then; and the requests holding blocks loaded ahead (not running yet).
        self._ahead_held: dict[str, int] = {}
        self._loaded_ahead: set[str] = set()
        self.num_loads_ahead = 0
        # Disaggregation: this core's transfer settings (None: off), and per
        # prefill-role request the first of its blocks not yet sent whole.
        self.kv_transfer: KVTransferSettings | None = None
        self._streams: dict[str, int] = {}
        # Sends of finished requests' KV, ordered with the next step.
        self._pending_sends: list[TransferOrder] = []
        # Write-down: saves ordered with the next step, saves in flight (I/O
        # id -> request id), blocks per request already saved or ordered
        # (block positions, kept across preemption), and finished requests'
        # retentions waiting for their saves: request id -> (blocks, seconds).
        self._pending_saves: list[TransferOrder] = []
        self._saves: dict[str, str] = {}
        self._num_saved_blocks: dict[str, int] = {}
        self._retain_after_save: dict[str, tuple[Request, int, float]] = {}
        self._next_save_id = 0
        self.num_loaded_tokens = 0
        self.num_partial_loads = 0
        self.num_saved_blocks = 0
        self._finished_since_step: list[str] = []
        # What the runner's batch row holds per request: block count and
        # token count. A preempted request loses its row (re-sent in full).
        self._runner_blocks: dict[str, int] = {}
        self._runner_tokens: dict[str, int] = {}
        # Requests the runner keeps any state for (seeded generators survive
        # preemption): told when they finish.
        self._runner_states: set[str] = set()
        # Outputs of requests finished inside schedule(), reported with the
        # next update_from_output.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.num_drafts = 0  # verified proposals
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos: list[int] = []  # [k_max]: drafts accepted at each position
        self.num_prompt_tokens_computed = 0  # target forward positions inside a prompt
        self.num_draft_prompt_tokens_computed = 0  # the draft model's (runner-reported)

    # -- intake ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if not self.kv.can_fit(request.num_tokens + 1):
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens cannot fit in the KV cache "
                f"({self.kv.pool.num_blocks} blocks of {self.kv.block_size})"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.fairness.on_arrival(request)

    def has_unfinished(self) -> bool:
        """Requests to run, or KV sends still to order or to complete (the
        engine must keep stepping to collect their completions)."""
        return bool(self.waiting or self.running or self._pending_sends or self.kv.delayed_free
                    or self._pending_saves or self._saves)

    # -- planning ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_since_step)
        self._finished_since_step = []
        out.kv_orders.send, self._pending_sends = self._pending_sends, []
        out.kv_orders.save, self._pending_saves = self._pending_saves, []
        self.propose()
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(out, budget)
        if not preempted:
            self._schedule_waiting(out, budget)
            self._load_ahead(out)
        return out

    def propose(self) -> None:
        """Fill ``spec_token_ids`` of running decodes from the proposer. A
        caller may also set them directly before ``schedule``."""
        if self.proposer is None or self.num_speculative_tokens == 0:
            return
        num_running = len(self.running)
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens != 1:
                continue
            request.spec_token_ids = self._proposal(request, num_running)

    def _proposal(self, request: Request, num_running: int) -> list[int]:
        k = self.num_speculative_tokens
        if self.draft_budget is not None:
            k = min(k, self.draft_budget.num_drafts(request.request_id, num_running))
        return self.proposer.propose(request)[:k] if k > 0 else []

    def _admission_drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Drafts for a request admitted with only its newest token to
        compute: a decode-role request whose prompt KV and first token came
        from a prefill core. It drafts at its first step here, as a running
        decode would (the proposer sees prompt + first token)."""
        if (self.proposer is None or self.num_speculative_tokens == 0 or num_new != 1
                or request.num_output_tokens == 0):
            return []
        request.spec_token_ids = self._proposal(request, len(self.running) + 1)
        return self._drafts_for(request, num_new, budget)

    def _drafts_for(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The drafts worth verifying: only for a decode, within the budget,
        and never more than the tokens the request may still produce."""
        if num_new != 1 or not request.spec_token_ids:
            return []
        params = request.sampling_params
        remaining = budget - num_new
        if params.max_tokens is not None:
            remaining = min(remaining, params.max_tokens - request.num_output_tokens - 1)
        if request.max_model_len:
            remaining = min(remaining, request.max_model_len - request.num_tokens - 1)
        return request.spec_token_ids[: max(remaining, 0)]

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        preempted_any = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            drafts = self._drafts_for(request, num_new, budget)
            while self.kv.allocate_slots(request, num_new + len(drafts)) is None:
                if not self.kv.can_fit(request.num_computed_tokens + num_new):
                    # Alone it would need more blocks than the pool has:
                    # preempting others cannot help, and retrying would spin.
                    self._finish(request, RequestStatus.FINISHED_ERROR)
                    self._pending_outputs.append(self._core_output(request, []))
                    break
                if self._release_loaded_ahead():
                    continue  # blocks a queued request loaded ahead: cheaper to give up than a running one
                # Only requests not yet scheduled this step (index >= i) may go.
                victim = self.fairness.pick_victim(self.running[i:])
                self.running.remove(victim)
                self._preempt(victim, out)
                preempted_any = True
                if victim is request:
                    break
            else:
                self._emit(out, request, num_new, drafts)
                budget -= num_new + len(drafts)
                i += 1
        return budget, preempted_any

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        for request in self.fairness.admission_order(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if request.status == RequestStatus.WAITING_FOR_KV:
                continue  # its own KV is in flight; the rest of the queue is not blocked by that
            admitted = self._admit(out, request, budget)
            while admitted is None and self._release_loaded_ahead(keep=request):
                admitted = self._admit(out, request, budget)  # a request behind it had loaded ahead
            if admitted is _SKIP:
                continue  # too long for the budget left; a shorter one behind may fit
            if admitted is None:
                break  # no blocks: every request behind it needs blocks too (fair order)
            if admitted == 0:
                continue  # left the queue (finished, or now waiting for KV)
            self.waiting.remove(request)
            budget -= admitted

    def _admit(self, out: SchedulerOutput, request: Request, budget: int) -> int | None | _Skip:
        """Try to start or resume ``request``. Returns the tokens it was
        scheduled for, 0 if it left the runnable set without running, _SKIP
        if its whole prompt must run at once and exceeds the budget left, or
        None if there are no blocks for it."""
        swapped = self.swapped.get(request.request_id)
        # (A decode-role request whose transfer failed holds its blocks
        # already: it recomputes into them, with no second lookup.)
        first = request.num_computed_tokens == 0 and swapped is None and request.request_id not in self.kv.req_blocks
        hit = self.kv.find_prefix_hit(request) if first else PrefixHit()
        if first and _role(request) == "decode":
            return self._admit_decode(out, request, hit)
        num_external = swapped.num_tokens if swapped else 0
        load_async = 0
        if first and self.kv_source is not None:
            load_async = self.kv_source.num_matched_tokens(request, hit.num_tokens)
        num_new = request.num_tokens - request.num_computed_tokens - hit.num_tokens - num_external - load_async
        # Without chunked prefill a prompt runs whole. A resumed request
        # (preempted after generating) may recompute in chunks: that is
        # invisible to its output, and its prompt + output can exceed the
        # budget, so it would otherwise never run again.
        resumed = request.num_output_tokens > 0
        if num_new > budget and not self.config.enable_chunked_prefill and not resumed:
            return _SKIP
        num_new = 0 if load_async else min(num_new, budget)
        drafts = self._admission_drafts(request, num_new, budget) if first_decode_step(request, swapped, hit) else []
        new = self.kv.allocate_slots(request, num_new + len(drafts), hit,
                                     num_external_tokens=num_external + load_async)
        if new is None:
            total = request.num_computed_tokens + hit.num_tokens + num_external + load_async + num_new
            if not self.running and not self.kv.can_fit(total):
                self._finish(request, RequestStatus.FINISHED_ERROR)
                self._pending_outputs.append(self._core_output(request, []))
                return 0
            return None
        request.num_computed_tokens += hit.num_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.num_tokens
            self.kv.record_lookup(request, hit)
        if self.write_down:
            # Blocks hit on the device were saved when they were computed,
            # and loaded ones come from the store: neither is saved again.
            saved = (request.num_computed_tokens + load_async) // self.kv.block_size
            self._num_saved_blocks[request.request_id] = max(self._num_saved_blocks.get(request.request_id, 0), saved)
        if load_async:
            self._start_load(out, request, load_async)
            return 0
        if swapped is not None:
            self._swap_in(out, request, swapped)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self._forget_ahead(request.request_id)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._emit(out, request, num_new, drafts)
        return num_new + len(drafts)

    # -- disaggregation ---------------------------------------------------------
    def _admit_decode(self, out: SchedulerOutput, request: Request, hit: PrefixHit) -> int | None:
        """Decode role: hold blocks for the whole prompt past the prefix hit,
        expect its KV from a prefill core, and report where it goes::

            | hit (ours) |  external: written by the prefill core  |
            '-- kept --' '-- KVDestination.block_ids --------------'
        """
        if self.kv_transfer is None:
            raise RuntimeError("a decode-role request reached a core without a KV transfer socket")
        rid, bs = request.request_id, self.kv.block_size
        num_external = request.num_tokens - hit.num_tokens
        if self.kv.allocate_slots(request, 0, hit, num_external_tokens=num_external) is None:
            if not self.running and not self.kv.can_fit(request.num_tokens):
                self._finish(request, RequestStatus.FINISHED_ERROR)
                self._pending_outputs.append(self._core_output(request, []))
                return 0
            return None
        request.num_computed_tokens += hit.num_tokens
        request.num_cached_tokens = hit.num_tokens
        self.kv.record_lookup(request, hit)
        request.first_scheduled_time = time.monotonic()
        settings = self.kv_transfer
        deadline = time.monotonic() + settings.timeout_s
        block_ids = self.kv.block_ids(rid)[hit.num_tokens // bs :]
        transfer_id = f"{rid}@{uuid.uuid4().hex[:12]}"
        out.kv_orders.receive.append(ReceiveOrder(rid, transfer_id, block_ids, deadline))
        request.status = RequestStatus.WAITING_FOR_KV
        self.loading[rid] = num_external
        dest = KVDestination(transfer_id=transfer_id, address=settings.address, shm_name=settings.shm_name,
                             block_ids=block_ids, num_cached_tokens=hit.num_tokens, block_size=bs,
                             lease_s=settings.timeout_s, deadline=deadline)
        output = self._core_output(request, [])
        output.kv_destination = dest
        self._pending_outputs.append(output)
        return 0

    def _order_stream(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        """Prefill role: stream, layer by layer during this step, every
        block the step completes or touches that the decode core lacks (a
        block partly written now is sent again, whole, by a later step)::

            P blocks: | P's hit | computed before | this step |
            D blocks: | D's hit |<-- sent earlier -->|<- now ->|
        """
        dest: KVDestination = request.kv_transfer.dest
        rid, bs = request.request_id, self.kv.block_size
        d_first = dest.num_cached_tokens // bs
        lo = self._streams.get(rid, d_first)
        end = min(request.num_computed_tokens + num_new, request.num_prompt_tokens)
        hi = -(-end // bs)
        self._streams[rid] = max(lo, end // bs)
        block_ids = self.kv.block_ids(rid)
        out.kv_orders.stream.append(StreamOrder(
            request_id=rid, transfer_id=dest.transfer_id, address=dest.address, shm_name=dest.shm_name,
            src_block_ids=block_ids[lo:hi], dst_block_ids=dest.block_ids[lo - d_first : hi - d_first],
            all_dst_block_ids=list(dest.block_ids),
            num_final_blocks=hi - lo if end >= request.num_prompt_tokens else end // bs - lo,
            last=end >= request.num_prompt_tokens, lease_s=dest.lease_s, deadline=dest.deadline,
        ))

    def _apply_received(self, request: Request, num_tokens: int, first_tokens: list[int],
                        outputs: list[EngineCoreOutput]) -> None:
        """Decode role: the prompt's KV arrived whole and verified; resume
        with the prefill core's first token appended (which that core
        reported: only a finish is reported here)."""
        request.num_computed_tokens += num_tokens
        request.status = RequestStatus.WAITING
        request.kv_transfer = None
        _, stop = self._append_tokens(request, first_tokens)
        self.kv.cache_computed_blocks(request)
        if stop is not None:
            self._finish(request, stop)
            outputs.append(self._core_output(request, []))

    def _transfer_failed(self, request: Request, reason: str, first_tokens: list[int],
                         outputs: list[EngineCoreOutput]) -> None:
        """Decode role: never decode from partial KV. Recompute the prompt
        here (its blocks stay; nothing past the prefix hit was published),
        or end the request with the reason.

        ``first_tokens``: the prefill core's first token when its Done
        arrived (only the KV failed): it was computed from intact KV and
        reported already, so it is appended and the recompute samples the
        second token. Without it (a timeout) the recompute samples the first
        token here; a router that streamed one from the prefill core drops
        this core's first (the same token: same KV, same seed)."""
        request.kv_transfer = None
        if self.kv_transfer is not None and self.kv_transfer.recompute_on_failure:
            request.status = RequestStatus.WAITING
            _, stop = self._append_tokens(request, first_tokens)
            if stop is not None:
                self._finish(request, stop)
            output = self._core_output(request, [])
            output.kv_transfer_error = f"KV transfer failed ({reason}); recomputing the prompt"
        else:
            self._finish(request, RequestStatus.FINISHED_ERROR)
            output = self._core_output(request, [])
            output.kv_transfer_error = f"KV transfer failed: {reason}"
        outputs.append(output)

    # -- load at arrival --------------------------------------------------------
    def _load_ahead(self, out: SchedulerOutput) -> None:
        """Requests still queued (behind ``max_num_seqs`` or the token
        budget) start loading their tier hits now, not when admitted, so
        that the load overlaps their wait. Each is looked up in the store
        once. A load ahead takes only blocks the running requests cannot
        need for their prompts and next token (``_spare_blocks``); the
        blocks belong to the request (nothing evicts them) until it runs,
        finishes, or gives them up to a running request (``_release_loaded_ahead``)::

            queued request: | device hit | loaded ahead (tier) | computed once admitted |
        """
        if self.kv_source is None or not self.waiting:
            return
        spare = self._spare_blocks()
        # Queue order (arrival, preempted first): cheap with many tenants,
        # and each request behind is looked up once only.
        for request in list(self.waiting):
            if spare <= 0:
                break
            rid = request.request_id
            if self._ahead_held.get(rid) == 0 or not self._may_load_ahead(request):
                continue
            hit = self.kv.find_prefix_hit(request)
            if rid not in self._ahead_held:
                held = self.kv_source.num_matched_tokens(request, hit.num_tokens)
                self._ahead_held[rid] = hit.num_tokens + held if held else 0
            num_load = self._ahead_held[rid] - hit.num_tokens
            if num_load <= 0:
                continue
            bs = self.kv.block_size
            needed = -(-(hit.num_tokens + num_load) // bs) - len(hit.blocks)
            needed += sum(1 for b in hit.blocks if b.ref_cnt == 0)  # touching them takes them off the free queue
            if needed > spare:
                break  # the requests behind it do not jump ahead
            if self.kv.allocate_slots(request, 0, hit, num_external_tokens=num_load) is None:
                break
            spare -= needed
            request.num_computed_tokens += hit.num_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.num_tokens
                self.kv.record_lookup(request, hit)
            if self.write_down:  # hit blocks were saved when computed; loaded ones come from the store
                saved = (hit.num_tokens + num_load) // bs
                self._num_saved_blocks[rid] = max(self._num_saved_blocks.get(rid, 0), saved)
            self._start_load(out, request, num_load)
            self._loaded_ahead.add(rid)
            self.num_loads_ahead += 1

    def _may_load_ahead(self, request: Request) -> bool:
        """Queued, never looked up, holding nothing, and not a decode-role
        request (its KV comes from a prefill core)."""
        rid = request.request_id
        return (request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and rid not in self._loaded_ahead
                and request.num_computed_tokens == 0 and rid not in self.swapped and rid not in self.kv.req_blocks
                and _role(request) != "decode")

    def _spare_blocks(self) -> int:
        """Free blocks beyond what the running requests need to finish their
        prompts and take their next token (and its drafts)."""
        bs, reserved = self.kv.block_size, 0
        for request in self.running:
            held = len(self.kv.req_blocks.get(request.request_id, ()))
            reserved += max(0, -(-(request.num_tokens + 1 + self.num_speculative_tokens) // bs) - held)
        return self.kv.pool.num_free_blocks - reserved

    def _forget_ahead(self, request_id: str) -> None:
        """Running or finished: a later preemption looks it up afresh."""
        self._ahead_held.pop(request_id, None)
        self._loaded_ahead.discard(request_id)

    def _release_loaded_ahead(self, keep: Request | None = None) -> bool:
        """Give up the blocks of the last queued request (other than
        ``keep``) that loaded ahead and is done loading: its KV is published
        first, so that its blocks stay in the prefix cache (evictable) and a
        later admission hits them. Returns whether one was released."""
        for request in reversed(self.waiting):
            rid = request.request_id
            if (request is keep or rid not in self._loaded_ahead or rid in self.loading
                    or rid not in self.kv.req_blocks):
                continue
            self.kv.cache_computed_blocks(request)
            self.kv.free(request)
            request.num_computed_tokens = 0
            self._loaded_ahead.discard(rid)
            self._ahead_held[rid] = 0  # not again: the pool is short
            return True
        return False

    def _start_load(self, out: SchedulerOutput, request: Request, num_tokens: int) -> None:
        """Order the external KV of ``request`` into its blocks; it waits,
        skipped by the queue, until the runner reports ``finished_loading``."""
        bs = self.kv.block_size
        first = request.num_computed_tokens // bs
        count = num_tokens // bs
        block_ids = self.kv.block_ids(request.request_id)[first : first + count]
        keys = request.block_hashes[first : first + count]
        out.kv_orders.load.append(TransferOrder(
            request.request_id, block_ids, keys=list(keys), tenant=request.tenant,
            num_public_blocks=max(0, request.num_public_blocks - first)))
        request.status = RequestStatus.WAITING_FOR_KV
        self.loading[request.request_id] = num_tokens

    def _swap_in(self, out: SchedulerOutput, request: Request, swapped: SwappedKV) -> None:
        del self.swapped[request.request_id]
        block_ids = self.kv.block_ids(request.request_id)[: len(swapped.host_slots)]
        out.kv_orders.swap_in.append(SwapOrder(request.request_id, block_ids, swapped.host_slots))
        # Swap-in runs before this step's forward pass, so the tokens count
        # as computed for the step.
        request.num_computed_tokens += swapped.num_tokens
        self.swap_space.free(swapped.host_slots)

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int, drafts: list[int]) -> None:
        rid = request.request_id
        block_ids = self.kv.block_ids(rid)
        if rid not in self._runner_blocks:
            out.new_requests.append(
                NewRequestData(
                    request_id=rid,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    eos_token_ids=list(request.eos_token_ids),
                    block_ids=block_ids,
                    num_computed_tokens=request.num_computed_tokens,
                    output_token_ids=list(request.output_token_ids),
                )
            )
        else:
            known = self._runner_tokens[rid]
            out.cached_requests.append(
                CachedRequestData(
                    request_id=rid,
                    new_block_ids=block_ids[self._runner_blocks[rid] :],
                    num_computed_tokens=request.num_computed_tokens,
                    new_token_ids=request.all_token_ids[known:],
                )
            )
        self._runner_blocks[rid] = len(block_ids)
        self._runner_tokens[rid] = request.num_tokens
        self._runner_states.add(rid)
        if _role(request) == "prefill":
            self._order_stream(out, request, num_new)
        out.num_scheduled_tokens[rid] = num_new + len(drafts)
        # Prompt positions the target computes here (0 on a decode core for a
        # request whose prompt KV was received).
        self.num_prompt_tokens_computed += max(
            0, min(request.num_computed_tokens + num_new, request.num_prompt_tokens) - request.num_computed_tokens)
        self.fairness.charge(request, num_new + len(drafts))
        if drafts:
            out.spec_token_ids[rid] = list(drafts)
        # Advance now, as if the step already ran; update_from_output rolls
        # back rejected drafts and appends the sampled tokens.
        request.num_computed_tokens += num_new + len(drafts)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._swap_out(request, out)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._runner_blocks.pop(request.request_id, None)
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)

    def _swap_out(self, request: Request, out: SchedulerOutput) -> None:
        """Copy the computed KV to host slots when they are free; the copy
        runs before this step's forward pass, so the blocks can be freed now.
        Without a swap space, a store below the pool takes the full blocks
        (write-down has ordered most of them already; the resumed request
        loads them back through the prefix lookup)."""
        if self.config.preemption_mode == "recompute" or request.num_computed_tokens == 0:
            return
        if self.swap_space is None:
            if self.write_down:
                self._order_save(request)
            return
        num_blocks = -(-request.num_computed_tokens // self.kv.block_size)
        slots = self.swap_space.allocate(num_blocks)
        if slots is None:
            return  # no room: recompute later
        block_ids = self.kv.block_ids(request.request_id)[:num_blocks]
        out.kv_orders.swap_out.append(SwapOrder(request.request_id, block_ids, slots))
        self.swapped[request.request_id] = SwappedKV(slots, request.num_computed_tokens)
        self.num_swapped_out += 1

    # -- results -----------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Apply a step's result: publish the blocks it wrote, roll back
        rejected drafts, append accepted tokens and apply token-level stop
        rules per token. Returns one output per request that got tokens or
        finished. Stop strings need text: the front end applies them and
        calls ``finish_requests``."""
        outputs, self._pending_outputs = self._pending_outputs, []
        self.num_draft_prompt_tokens_computed += result.num_draft_prompt_tokens
        self._apply_kv_completions(result, outputs)
        for rid, num_scheduled in sched.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue  # finished (aborted) while the step ran
            sampled = result.sampled_token_ids.get(rid, [])
            self._rollback_drafts(request, sched.spec_token_ids.get(rid, []), sampled)
            new_tokens, stop = self._append_tokens(request, sampled)
            if new_tokens and _role(request) == "prefill":
                stop = RequestStatus.FINISHED_PREFILLED  # the decode core continues it
            # The step wrote these blocks' KV: publish them (before a finish frees them).
            self.kv.cache_computed_blocks(request)
            if self.write_down:
                self._order_save(request)
            if stop is not None:
                self._finish(request, stop)
            self._runner_tokens[rid] = request.num_tokens
            if new_tokens or request.is_finished:
                logprobs = result.logprobs.get(rid)
                outputs.append(self._core_output(request, new_tokens, logprobs))
        return outputs

    def _rollback_drafts(self, request: Request, drafts: list[int], sampled: list[int]) -> None:
        request.spec_token_ids = []
        if not drafts or not sampled:
            return
        num_accepted = len(sampled) - 1
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(drafts) - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1
        if self.draft_budget is not None:
            self.draft_budget.observe(request.request_id, len(drafts), num_accepted)
        # KV at the rejected drafts' positions is garbage; it is overwritten
        # when those positions are computed again.
        request.num_computed_tokens -= len(drafts) - num_accepted

    def _append_tokens(self, request: Request, sampled: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append tokens one at a time; a stop in the middle of an accepted
        run drops the rest. Returns the tokens kept and the stop, if any."""
        for n, token in enumerate(sampled, start=1):
            request.append_output_token(token)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            status = self._check_stop(request, token)
            if status is not None:
                return sampled[:n], status
        return sampled, None

    def _core_output(self, request: Request, new_tokens: list[int], logprobs=None) -> EngineCoreOutput:
        finished = request.is_finished
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=list(new_tokens),
            new_logprobs=logprobs[: len(new_tokens)] if logprobs is not None else None,
            finish_reason=FINISH_REASON[request.status] if finished else None,
            stop_reason=request.stop_reason if finished else None,
            num_cached_tokens=request.num_cached_tokens or 0,
            # On the request's first output only (for the queue-time metric).
            first_scheduled_time=(request.first_scheduled_time
                                  if request.num_output_tokens == len(new_tokens) else None),
        )

    def _apply_kv_completions(self, result: RunnerOutput, outputs: list[EngineCoreOutput]) -> None:
        for rid in result.finished_loading:
            if rid not in self.loading:
                continue  # a swap-in: complete within its own step
            num_tokens = self.loading.pop(rid)
            request = self.requests.get(rid)
            if request is None:
                self.kv.release_delayed(rid)  # finished while loading
                continue
            if rid in result.kv_received:
                self._apply_received(request, num_tokens, result.kv_received[rid], outputs)
                continue
            self._finish_load(request, num_tokens, result.num_loaded_blocks.get(rid))
        for rid, reason in result.failed_loading.items():
            if self.loading.pop(rid, None) is None:
                continue
            request = self.requests.get(rid)
            if request is None:
                self.kv.release_delayed(rid)  # finished while loading
                continue
            self._transfer_failed(request, reason, result.kv_received.get(rid, []), outputs)
        for rid in result.finished_sending:
            self._streams.pop(rid, None)
            self.kv.release_delayed(rid)
        for io_id in result.finished_saving:
            self._finish_save(io_id)

    def _finish_load(self, request: Request, num_tokens: int, num_loaded_blocks: int | None) -> None:
        """A load ended. Only its leading run of filled blocks counts as
        computed; a block after a gap (missing or corrupt in the tier) is
        recomputed with everything behind it, so no step ever reads KV the
        load did not write."""
        if num_loaded_blocks is not None:
            loaded = min(num_tokens, max(num_loaded_blocks, 0) * self.kv.block_size)
            if loaded < num_tokens:
                self.num_partial_loads += 1
                if self.write_down:  # the missing blocks are saved again once recomputed
                    end = (request.num_computed_tokens + loaded) // self.kv.block_size
                    self._num_saved_blocks[request.request_id] = end
            num_tokens = loaded
        request.num_computed_tokens += num_tokens
        if request.num_output_tokens == 0:  # the prompt's first load, not a resume after preemption
            request.num_cached_tokens = (request.num_cached_tokens or 0) + num_tokens
        self.num_loaded_tokens += num_tokens
        request.status = RequestStatus.WAITING

    # -- write-down ----------------------------------------------------------
    def _order_save(self, request: Request) -> None:
        """Order the request's newly full, written blocks saved to the store
        with the next step, pinned until the save is done (a finish or a
        preemption may free the request's blocks meanwhile)."""
        rid = request.request_id
        bs = self.kv.block_size
        start = self._num_saved_blocks.get(rid, 0)
        if not request.writes_public_blocks:
            start = max(start, request.num_public_blocks)  # public blocks are written by their declaration only
        end = min(min(request.num_computed_tokens, request.num_tokens) // bs, len(request.block_hashes))
        if end <= start or not self.kv.enable_caching:
            return
        block_ids = self.kv.block_ids(rid)[start:end]
        io_id = f"save-{self._next_save_id}"
        self._next_save_id += 1
        self.kv.pin(io_id, block_ids)
        self._pending_saves.append(TransferOrder(
            io_id, block_ids, keys=list(request.block_hashes[start:end]), tenant=request.tenant,
            num_public_blocks=max(0, request.num_public_blocks - start)))
        self._saves[io_id] = rid
        self._num_saved_blocks[rid] = end
        self.num_saved_blocks += end - start

    def _finish_save(self, io_id: str) -> None:
        rid = self._saves.pop(io_id, None)
        if rid is None:
            return  # a swap-out: complete within its own step
        self.kv.unpin(io_id)
        if rid in self._retain_after_save and rid not in self._saves.values():
            self._retain(*self._retain_after_save.pop(rid))

    def _retain(self, request: Request, num_blocks: int, seconds: float) -> None:
        if isinstance(self.kv_source, StoreKVSource):
            self.kv_source.retain(request, num_blocks, seconds)

    def _after_finish_write_down(self, request: Request) -> None:
        """A finished request that asked to keep its conversation: retain
        its written blocks (prompt and output) once their saves are done."""
        rid = request.request_id
        num_blocks = self._num_saved_blocks.pop(rid, 0)
        seconds = request.sampling_params.kv_retention_s
        if not seconds or num_blocks == 0 or request.status in (RequestStatus.FINISHED_ABORTED,
                                                                RequestStatus.FINISHED_ERROR):
            return
        if rid in self._saves.values():
            self._retain_after_save[rid] = (request, num_blocks, seconds)
        else:
            self._retain(request, num_blocks, seconds)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.max_model_len and request.num_tokens >= request.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        rid = request.request_id
        request.status = status
        request.spec_token_ids = []
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        send = self._order_send(request)
        # A load in flight still writes the blocks, a send will read them:
        # keep them until it completes.
        self.kv.free(request, delay=rid in self.loading or send or rid in self._streams)
        swapped = self.swapped.pop(rid, None)
        if swapped is not None:
            self.swap_space.free(swapped.host_slots)
        if self.write_down:
            self._after_finish_write_down(request)
        del self.requests[rid]
        self.fairness.on_departure(request)
        if self.draft_budget is not None:
            self.draft_budget.forget(rid)
        self._runner_tokens.pop(rid, None)
        self._runner_blocks.pop(rid, None)
        if rid in self._runner_states:
            self._runner_states.discard(rid)
            self._finished_since_step.append(rid)
        self._forget_ahead(rid)

    def _order_send(self, request: Request) -> bool:
        """Queue a send of a normally finished request's computed KV to its
        peer; True when one was queued."""
        if not request.kv_send_peer or request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            return False
        num_blocks = -(-request.num_computed_tokens // self.kv.block_size)
        block_ids = self.kv.block_ids(request.request_id)[:num_blocks]
        if not block_ids or request.request_id in self.loading:
            return False
        keys = list(request.block_hashes[:num_blocks])
        self._pending_sends.append(TransferOrder(request.request_id, block_ids, keys=keys, peer=request.kv_send_peer))
        return True

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        lookups = self.kv_source.stats if isinstance(self.kv_source, StoreKVSource) else TierLookupStats()
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            num_swapped_out=self.num_swapped_out,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_total=pool.num_blocks,
            prefix_queries=self.kv.stats.queries,
            prefix_hits=self.kv.stats.hits,
            prefix_hits_public=self.kv.stats.public_hits,
            prefix_by_owner=self.kv.owner_stats(),
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos),
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_draft_prompt_tokens_computed=self.num_draft_prompt_tokens_computed,
            kv_store_queries=lookups.queries,
            kv_store_hits=lookups.hits,
            kv_loaded_tokens=self.num_loaded_tokens,
            kv_partial_loads=self.num_partial_loads,
            kv_saved_blocks=self.num_saved_blocks,
        )
