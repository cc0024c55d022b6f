"""One simulated instance driven by the REAL scheduler and KV manager.

The runner is simulated: a step takes the time the step cost model gives for
what the scheduler planned (prefill chunks with their cached context, decode
batch and contexts), and every request whose computed tokens reach its known
tokens samples one token (id 0; the simulator never stops on EOS). So the
simulated instance admits, chunks, preempts and hits the prefix cache exactly
as a served engine with the same config would.

Roles: ``colocated`` (prefill and decode), ``prefill`` (max_tokens 1; the KV
then travels to a decode instance), ``decode`` (the prompt's KV arrives
whole: its full blocks load through the scheduler's external-KV path, the
partial last block and the first token are computed locally).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvferry.config import SchedulerConfig
from kvferry.core.kv_connector import TierKVScheduler
from kvferry.core.kv_manager import KVCacheManager
from kvferry.core.outputs import RunnerOutput, SchedulerOutput
from kvferry.core.scheduler import Scheduler
from kvferry.plan.latency import StepCostModel
from kvferry.plan.workload import SimRequest
from kvferry.core.request import Request
from kvferry.sampling import SamplingParams

SAMPLED_TOKEN = 0


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    num_kv_blocks: int = 4096
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True


@dataclass(slots=True)
class TokenEvent:
    request: SimRequest
    num_tokens: int  # tokens produced this step
    finished: bool
    failed: bool = False  # the scheduler gave up on it (it outgrew the KV pool)


class _TransferredKV:
    """External KV source of a decode instance: every full block of a
    request handed over by a prefill instance is loadable."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.transferred: set[str] = set()

    def num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if request.request_id not in self.transferred:
            return 0
        self.transferred.discard(request.request_id)
        full = (request.num_tokens - 1) // self.block_size * self.block_size
        return max(full - num_computed_tokens, 0)


class SchedulerInstance:
    mode = "scheduler"

    def __init__(self, name: str, role: str, cost: StepCostModel, config: InstanceConfig,
                 rng: random.Random | None = None) -> None:
        self.name, self.role, self.cost, self.config = name, role, cost, config
        self.rng = rng  # draws each step's noise ratio (when the cost model has one)
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.source = _TransferredKV(config.block_size) if role == "decode" else None
        sched_config = SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                       max_num_batched_tokens=config.max_num_batched_tokens)
        self.scheduler = Scheduler(sched_config, self.kv,
                                   connector=TierKVScheduler(self.source) if self.source else None)
        self.sim: dict[str, SimRequest] = {}
        self.busy = False
        self.step_end = 0.0  # when the running step ends alone (valid while busy)
        self.step_has_prefill = False  # the running step carries prefill tokens
        self.busy_time = 0.0
        self.num_steps = 0
        self._step: tuple[SchedulerOutput, RunnerOutput] | None = None

    @property
    def num_outstanding(self) -> int:
        return len(self.sim)

    def add(self, req: SimRequest, now: float) -> None:
        prompt = req.token_ids()
        max_tokens = req.output_len
        if self.role == "prefill":
            max_tokens = 1
        elif self.role == "decode":
            prompt = prompt + [SAMPLED_TOKEN]  # the first token came from the prefill instance
            max_tokens = req.output_len - 1
        rid = str(req.request_id)
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                          arrival_time=now)
        self.scheduler.add_request(request)  # ValueError: cannot fit in the pool
        if self.source is not None:
            self.source.transferred.add(rid)
        self.sim[rid] = req

    def start_step(self, now: float) -> float | None:
        """Plan a step; its end time, or None when there is nothing to run."""
        finished_loading: list[str] = []
        while True:
            out = self.scheduler.schedule()
            # Transferred KV is already here when the request arrives: loads complete at once.
            finished_loading += [o.request_id for o in out.kv_orders.load]
            if not out.is_empty:
                break
            self.scheduler.update_from_output(out, RunnerOutput(finished_loading=finished_loading))
            if not finished_loading:
                return None
            finished_loading = []
        duration = self._step_time(out)
        result = RunnerOutput(finished_loading=finished_loading)
        for rid in out.num_scheduled_tokens:
            request = self.scheduler.requests[rid]
            if request.num_computed_tokens >= request.num_tokens:
                result.sampled_token_ids[rid] = [SAMPLED_TOKEN]
        self._step = (out, result)
        self.busy = True
        self.busy_time += duration
        self.num_steps += 1
        self.step_end = now + duration
        return self.step_end

    def _step_time(self, out: SchedulerOutput) -> float:
        chunks: list[tuple[int, int]] = []
        batch = context = 0
        for rid, num_new in out.num_scheduled_tokens.items():
            # num_computed_tokens already counts this step's tokens
            cached = self.scheduler.requests[rid].num_computed_tokens - num_new
            if num_new == 1:
                batch += 1
                context += cached + 1
            else:
                chunks.append((num_new, cached))
        self.step_has_prefill = bool(chunks)
        return self.cost.noisy_step(chunks, batch, context, self.rng)

    def finish_step(self, now: float) -> list[TokenEvent]:
        out, result = self._step
        self._step = None
        self.busy = False
        events = []
        for o in self.scheduler.update_from_output(out, result):
            req = self.sim[o.request_id]
            finished = o.finish_reason is not None
            if finished:
                del self.sim[o.request_id]
            events.append(TokenEvent(req, len(o.new_token_ids), finished, o.finish_reason == "error"))
        return events

    def cache_stats(self) -> tuple[int, int]:
        """(tokens looked up, tokens hit) in the prefix cache."""
        return self.kv.stats.queries, self.kv.stats.hits
