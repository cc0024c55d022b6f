"""One step's plan: which requests run and how many tokens each.

The rule (after vLLM v1): each step gives every running request up to
``num_tokens - num_computed_tokens`` tokens, within a per-step token budget
(``max_num_batched_tokens``) and a cap on concurrent sequences
(``max_num_seqs``). Running requests go first (decodes cost one token each),
then waiting ones are admitted with whatever budget is left, chunking long
prompts. When blocks run out, the most recently admitted running request is
preempted: its blocks are freed and it restarts from its (prefix-cached)
tokens later, which changes no greedy output.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvferry.config import SchedulerConfig
from kvferry.core.kv_manager import KVCacheManager, PrefixHit
from kvferry.core.outputs import NewRequestData, RunnerOutput, ScheduledRequest, SchedulerOutput
from kvferry.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0  # cumulative
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_queries: int = 0  # cumulative tokens
    prefix_hits: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_step: list[str] = []
        self._sent_to_runner: set[str] = set()
        self.num_preemptions = 0

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

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_since_step)
        self._finished_since_step = []
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(out, budget)
        if not preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        preempted_any = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                if not self.kv.can_fit(request.num_computed_tokens + num_new):
                    # Alone it would need more blocks than the pool has:
                    # preempting others cannot help, and retrying would spin.
                    self._finish(request, RequestStatus.FINISHED_ERROR)
                    break
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted_any = True
                if victim is request:
                    break
            else:
                self._emit(out, request, num_new)
                budget -= num_new
                i += 1
        return budget, preempted_any

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = self.kv.find_prefix_hit(request) if request.num_computed_tokens == 0 else PrefixHit()
            num_new = request.num_tokens - request.num_computed_tokens - hit.num_tokens
            # Without chunked prefill a prompt runs whole. A resumed request
            # (preempted after generating) may recompute in chunks: that is
            # invisible to its output, and its prompt + output can exceed the
            # budget, so it would otherwise never run again.
            resumed = request.num_output_tokens > 0
            if num_new > budget and not self.config.enable_chunked_prefill and not resumed:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(request, num_new, hit) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens += hit.num_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit.num_tokens
                self.kv.record_lookup(request, hit)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._emit(out, request, num_new)
            budget -= num_new

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        if request.request_id not in self._sent_to_runner:
            self._sent_to_runner.add(request.request_id)
            out.new_requests.append(
                NewRequestData(
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling_params,
                    list(request.eos_token_ids),
                )
            )
        out.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                num_computed_tokens=start,
                token_ids=request.all_token_ids[start : start + num_new],
                block_ids=self.kv.block_ids(request.request_id),
                sample=start + num_new == request.num_tokens,
            )
        )
        # Advance now, as if the step already ran; update_from_output appends
        # the sampled token, which makes num_tokens run ahead again by one.
        request.num_computed_tokens += num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)

    # -- results -----------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Append sampled tokens and apply token-level stop rules.

        Returns the requests that got a new token (finished ones included).
        Stop strings need text, so the engine applies them and calls
        ``finish_requests``.
        """
        updated = []
        for item in sched.scheduled:
            token = result.sampled_token_ids.get(item.request_id)
            request = self.requests.get(item.request_id)
            if token is None or request is None or request.is_finished:
                continue
            request.append_output_token(token)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            status = self._check_stop(request, token)
            if status is not None:
                self._finish(request, status)
            updated.append(request)
        return updated

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
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._sent_to_runner:
            self._sent_to_runner.discard(request.request_id)
            self._finished_since_step.append(request.request_id)

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_total=pool.num_blocks,
            prefix_queries=self.kv.stats.queries,
            prefix_hits=self.kv.stats.hits,
        )
