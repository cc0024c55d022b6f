"""One step's plan: which requests run and how many tokens each.

The rule (after vLLM v1): each step gives every running request up to
``num_tokens - num_computed_tokens`` tokens (plus its draft tokens), within
a per-step token budget (``max_num_batched_tokens``) and a cap on concurrent
sequences (``max_num_seqs``). Running requests go first (decodes cost one
token each, plus drafts), then waiting ones are admitted with whatever budget
is left, chunking long prompts, in weighted fair order between tenants
(``core/fairness.py``; FCFS with one tenant). When blocks run out, the most
recently admitted running request of the most-served tenant is preempted
(with one tenant: the most recently admitted): its KV connector may keep its
KV (host swap, the node store), otherwise its blocks are freed and it is
recomputed from its (prefix-cached) tokens later. Neither changes a greedy
output.

KV that comes from outside the device pool (a swap space, the node's
store, a prefill core) is the KV connector's business
(``core/kv_connector``): the scheduler asks it how many tokens it can
supply, allocates their blocks, and parks a request whose load is
asynchronous until the load completes (``loading``). Queued requests start
such loads ahead of admission (``core/load_ahead.py``).

Entry points: ``add_request``, ``schedule`` -> SchedulerOutput,
``update_from_output`` -> list[EngineCoreOutput], ``finish_requests``.
"""
from __future__ import annotations

import enum
import time
import weakref
from collections import deque
from dataclasses import dataclass

from kvferry.config import SchedulerConfig
# Re-exported: the speculation interfaces the scheduler drives.
from kvferry.core.drafting import DraftBudget, DraftProposer  # noqa: F401
from kvferry.core.fairness import TenantFairness
from kvferry.core.kv_connector import KVConnectorScheduler, ExternalTokens, NO_EXTERNAL_TOKENS, kv_role
from kvferry.core.kv_manager import KVCacheManager, PrefixHit
from kvferry.core.load_ahead import LoadAhead
from kvferry.core.outputs import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from kvferry.types.stats import SchedulerStats
from kvferry.messages import EngineCoreOutput
from kvferry.core.request import FINISH_REASON, Request, RequestStatus


class AdmitOutcome(enum.Enum):
    SCHEDULED = "scheduled"  # runs this step
    LEFT_QUEUE = "left_queue"  # finished, or waits for its KV now: not running
    TOO_LONG = "too_long"  # its whole prompt must run at once and exceeds the budget left
    NO_BLOCKS = "no_blocks"  # the pool cannot take it now


@dataclass(frozen=True, slots=True)
class Admission:
    outcome: AdmitOutcome
    num_tokens: int = 0  # scheduled this step (drafts included)


_LEFT_QUEUE = Admission(AdmitOutcome.LEFT_QUEUE)
_TOO_LONG = Admission(AdmitOutcome.TOO_LONG)
_NO_BLOCKS = Admission(AdmitOutcome.NO_BLOCKS)


def first_decode_step(request: Request, resumed_tokens: int, hit: PrefixHit) -> bool:
    """Admitted with its whole context's KV already in place but for the
    newest token (a decode-role request resumed with received KV)."""
    return (resumed_tokens == 0 and hit.num_tokens == 0 and request.num_output_tokens > 0
            and request.num_tokens - request.num_computed_tokens == 1)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        connector: KVConnectorScheduler | None = None,
        proposer: DraftProposer | None = None,
        num_speculative_tokens: int = 0,
        draft_budget: DraftBudget | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.connector = connector or KVConnectorScheduler()
        # The connector and the load-ahead planner refer back weakly: no
        # reference cycle, so an engine is freed as soon as it is dropped
        # (its store clients' sockets closed then, not at a random
        # collection inside another engine's step).
        self.connector.bind(weakref.proxy(self))
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_budget = draft_budget
        self.requests: dict[str, Request] = {}
        self.fairness = TenantFairness()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, int] = {}  # request id -> external tokens in flight (asynchronous loads)
        self.ahead = LoadAhead(weakref.proxy(self))
        self.num_loaded_tokens = 0
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
        self.num_drafts = 0  # verified proposals
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos: list[int] = []  # [k_max]: drafts accepted at each position
        self.num_prompt_tokens_computed = 0  # target forward positions inside a prompt
        self.num_draft_prompt_tokens_computed = 0  # the draft model's (runner-reported)

    @property
    def num_loads_ahead(self) -> int:
        return self.ahead.num_loads_ahead

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
        """Requests to run, or KV I/O still to order or to complete (the
        engine must keep stepping to collect their completions)."""
        return bool(self.waiting or self.running or self.kv.delayed_free or self.connector.has_pending())

    # -- planning ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_since_step)
        self._finished_since_step = []
        self.connector.start_step(out.kv_orders)
        self.propose()
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(out, budget)
        if not preempted:
            self._schedule_waiting(out, budget)
            self.ahead.start_loads(out)
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
            k = min(k, self.draft_budget.num_drafts(request.request_id, num_running, request.tenant))
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
                    self.finish(request, RequestStatus.FINISHED_ERROR)
                    self._pending_outputs.append(self.core_output(request, []))
                    break
                if self.ahead.release():
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
            admission = self._admit(out, request, budget)
            while admission.outcome is AdmitOutcome.NO_BLOCKS and self.ahead.release(keep=request):
                admission = self._admit(out, request, budget)  # a request behind it had loaded ahead
            if admission.outcome is AdmitOutcome.TOO_LONG:
                continue  # a shorter one behind may fit
            if admission.outcome is AdmitOutcome.NO_BLOCKS:
                break  # every request behind it needs blocks too (fair order)
            if admission.outcome is AdmitOutcome.LEFT_QUEUE:
                continue
            self.waiting.remove(request)
            budget -= admission.num_tokens

    def _admit(self, out: SchedulerOutput, request: Request, budget: int) -> Admission:
        """Try to start or resume ``request``: its prefix hit, then the KV
        its connector can supply (kept across a preemption, or matched past
        the hit), then blocks for all of it and this step's tokens."""
        rid = request.request_id
        resumed_tokens = self.connector.resume_tokens(request) if request.num_computed_tokens == 0 else 0
        # (A decode-role request whose transfer failed holds its blocks
        # already: it recomputes into them, with no second lookup.)
        first = request.num_computed_tokens == 0 and not resumed_tokens and rid not in self.kv.req_blocks
        hit = self.kv.find_prefix_hit(request) if first else PrefixHit()
        # Prompt logprobs and mean pooling read every prompt position's
        # output: such a request computes its prompt itself (as vLLM).
        whole = first and request.num_output_tokens == 0 and request.sampling_params.needs_prompt_positions
        if whole:
            hit = PrefixHit()
        if resumed_tokens:
            external = ExternalTokens(resumed_tokens, is_async=False)
        elif first and not whole:
            external = self.connector.get_num_new_matched_tokens(request, hit.num_tokens)
        else:
            external = NO_EXTERNAL_TOKENS
        num_new = request.num_tokens - request.num_computed_tokens - hit.num_tokens - external.num_tokens
        # Without chunked prefill a prompt runs whole. A resumed request
        # (preempted after generating) may recompute in chunks: that is
        # invisible to its output, and its prompt + output can exceed the
        # budget, so it would otherwise never run again.
        if num_new > budget and not self.config.enable_chunked_prefill and request.num_output_tokens == 0:
            return _TOO_LONG
        num_new = 0 if external.is_async else min(num_new, budget)
        drafts = (self._admission_drafts(request, num_new, budget)
                  if first_decode_step(request, resumed_tokens, hit) else [])
        new = self.kv.allocate_slots(request, num_new + len(drafts), hit, num_external_tokens=external.num_tokens)
        if new is None:
            total = request.num_computed_tokens + hit.num_tokens + external.num_tokens + num_new
            if not self.running and not self.kv.can_fit(total):
                self.finish(request, RequestStatus.FINISHED_ERROR)
                self._pending_outputs.append(self.core_output(request, []))
                return _LEFT_QUEUE
            return _NO_BLOCKS
        request.num_computed_tokens += hit.num_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.num_tokens
            self.kv.record_lookup(request, hit)
        dest = self.connector.update_state_after_alloc(request, external, out.kv_orders)
        if external.is_async:
            self.wait_for_load(request, external.num_tokens)
            if dest is not None:  # tell the front end where the KV goes, now
                output = self.core_output(request, [])
                output.kv_destination = dest
                self._pending_outputs.append(output)
            return _LEFT_QUEUE
        # Synchronous: the KV is in place before this step's forward pass.
        request.num_computed_tokens += external.num_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.ahead.forget(rid)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._emit(out, request, num_new, drafts)
        return Admission(AdmitOutcome.SCHEDULED, num_new + len(drafts))

    def wait_for_load(self, request: Request, num_tokens: int) -> None:
        """The request's external KV is ordered into its blocks; it waits,
        skipped by the queue, until the runner reports ``finished_loading``."""
        request.status = RequestStatus.WAITING_FOR_KV
        self.loading[request.request_id] = num_tokens

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
        self.connector.on_scheduled(request, num_new, out.kv_orders)
        out.num_scheduled_tokens[rid] = num_new + len(drafts)
        # Prompt positions the target computes here (0 on a decode core for a
        # request whose prompt KV was received).
        self.num_prompt_tokens_computed += max(
            0, min(request.num_computed_tokens + num_new, request.num_prompt_tokens) - request.num_computed_tokens)
        self.fairness.charge(request, num_new + len(drafts))
        if drafts:
            out.spec_token_ids[rid] = list(drafts)
            if getattr(drafts, "parents", None) is not None:  # a draft tree (kvferry.spec.tree)
                out.spec_tree_parents[rid] = list(drafts.parents)
        # Advance now, as if the step already ran; update_from_output rolls
        # back rejected drafts and appends the sampled tokens.
        request.num_computed_tokens += num_new + len(drafts)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        if self.config.preemption_mode != "recompute" and request.num_computed_tokens > 0:
            self.connector.on_preempt(request, out.kv_orders)  # keep its KV (swap, store) if one can
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._runner_blocks.pop(request.request_id, None)
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)

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
            new_tokens, stop = self._append_sampled(request, sampled)
            if (not sampled and stop is None and request.sampling_params.prompt_only
                    and request.num_computed_tokens >= request.num_tokens):
                stop = RequestStatus.FINISHED_LENGTH  # its prompt is computed: all it asked for
            if new_tokens and kv_role(request) == "prefill":
                stop = RequestStatus.FINISHED_PREFILLED  # the decode core continues it
            # The step wrote these blocks' KV: publish them (before a finish frees them).
            self.kv.cache_computed_blocks(request)
            self.connector.request_computed(request)
            if stop is not None:
                self.finish(request, stop)
            self._runner_tokens[rid] = request.num_tokens
            if new_tokens or request.is_finished:
                logprobs = result.logprobs.get(rid)
                outputs.append(self.core_output(request, new_tokens, logprobs))
        if result.prompt_logprobs or result.pooled:
            for output in outputs:
                output.prompt_logprobs = result.prompt_logprobs.get(output.request_id)
                output.pooled = result.pooled.get(output.request_id)
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

    def _append_sampled(self, request: Request, sampled: list[int]) -> tuple[list[int], RequestStatus | None]:
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

    def append_tokens(self, request: Request, tokens: list[int]) -> RequestStatus | None:
        """Tokens sampled elsewhere (a prefill core's first token); the stop, if any."""
        return self._append_sampled(request, tokens)[1]

    def core_output(self, request: Request, new_tokens: list[int], logprobs=None) -> EngineCoreOutput:
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
            self.connector.load_finished(request, num_tokens, result, outputs)
        for rid, reason in result.failed_loading.items():
            if self.loading.pop(rid, None) is None:
                continue
            request = self.requests.get(rid)
            if request is None:
                self.kv.release_delayed(rid)  # finished while loading
                continue
            self.connector.load_failed(request, reason, result, outputs)
        for rid in result.finished_sending:
            self.kv.release_delayed(rid)
        self.connector.apply_completions(result)

    def mark_loaded(self, request: Request, num_tokens: int) -> None:
        request.num_computed_tokens += num_tokens
        if request.num_output_tokens == 0:  # the prompt's first load, not a resume after preemption
            request.num_cached_tokens = (request.num_cached_tokens or 0) + num_tokens
        self.num_loaded_tokens += num_tokens
        request.status = RequestStatus.WAITING

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
                self.finish(request, status)

    def finish(self, request: Request, status: RequestStatus) -> None:
        rid = request.request_id
        request.status = status
        request.spec_token_ids = []
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        # A load in flight still writes the blocks, a connector's send may
        # still read them: keep them until it completes.
        hold = self.connector.request_finished(request)
        self.kv.free(request, delay=rid in self.loading or hold)
        del self.requests[rid]
        self.fairness.on_departure(request)
        if self.draft_budget is not None:
            self.draft_budget.forget(rid)
        learns = getattr(self.proposer, "finished", None)  # optional: see DraftProposer
        if learns is not None:
            learns(request)
        self._runner_tokens.pop(rid, None)
        self._runner_blocks.pop(rid, None)
        if rid in self._runner_states:
            self._runner_states.discard(rid)
            self._finished_since_step.append(rid)
        self.ahead.forget(rid)

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
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
            kv_loaded_tokens=self.num_loaded_tokens,
        )
        self.connector.fill_stats(stats)
        return stats
