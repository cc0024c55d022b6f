"""EngineCore: token ids in, token ids out. Owns the scheduler and the runner.

No text here: the front end (LLMEngine, the server's engine client) owns
tokenization, detokenization, stop strings and the n > 1 fan-out, and talks
to a core through the types of ``kvferry.messages``, in-process or over a
socket (``engine/core_proc.py``).
"""
from __future__ import annotations

import logging
import os
import time

from kvferry.config import EngineConfig
from kvferry.core.kv_manager import KVCacheManager
from kvferry.core.scheduler import Scheduler, SchedulerStats
from kvferry.core.swap_space import HostSwapSpace
from kvferry.engine.runner import ModelRunner, kv_block_bytes
from kvferry.messages import EngineCoreOutputs, EngineCoreReady, EngineCoreRequest
from kvferry.model.loader import LoadedModel, load_model
from kvferry.request import Request, RequestStatus
from kvferry.spec import speculation
from kvferry.spec.head import EagleHead, resolve_head_path

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        m = config.model
        self.loaded = loaded or load_model(m.model, dtype=m.dtype, device=m.device)
        self.block_size = config.cache.block_size
        self.max_model_len = self._resolve_max_model_len()
        self.num_kv_blocks = self._resolve_num_blocks()
        # A sequence can never outgrow the pool.
        self.max_model_len = min(self.max_model_len, self.num_kv_blocks * self.block_size)
        kv = KVCacheManager(self.num_kv_blocks, self.block_size, config.cache.enable_prefix_caching,
                            self.loaded.fingerprint, kv_dtype=str(self.loaded.dtype).removeprefix("torch."))
        num_swap = config.cache.num_swap_blocks
        self.scheduler = Scheduler(config.scheduler, kv, swap_space=HostSwapSpace(num_swap) if num_swap else None,
                                   **speculation(config.speculative))
        self.runner = ModelRunner(self.loaded, self.num_kv_blocks, self.block_size, num_swap_blocks=num_swap,
                                  draft=self._load_draft(), head=self._load_head())
        logger.info("engine core ready: %d KV blocks of %d tokens, max_model_len %d",
                    self.num_kv_blocks, self.block_size, self.max_model_len)

    def _load_draft(self) -> LoadedModel | None:
        spec = self.config.speculative
        if spec is None or spec.method != "draft":
            return None
        m = self.config.model
        # The target's dtype name, so "auto" resolves the same way for both.
        return load_model(spec.model, dtype=str(self.loaded.dtype).removeprefix("torch."), device=m.device)

    def _load_head(self) -> "EagleHead | None":
        spec = self.config.speculative
        if spec is None or spec.method != "head":
            return None
        if spec.model is None and self.config.model.model is not None:
            raise ValueError('speculative.model: method "head" without a path uses the head of the embedded '
                             "default model; this target needs its own (kvferry train-draft)")
        return EagleHead.load(resolve_head_path(spec.model), device=self.config.model.device)

    def _resolve_max_model_len(self) -> int:
        limit = self.loaded.max_model_len
        asked = self.config.scheduler.max_model_len
        if asked and asked > limit:
            raise ValueError(f"max_model_len {asked} exceeds the model's context length {limit}")
        return asked or limit

    def _resolve_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        by_memory = int(cache.kv_cache_memory_gb * 2**30) // kv_block_bytes(self.loaded, self.block_size)
        # No point holding more than every running sequence at full length
        # (plus as much again for the prefix cache).
        per_seq = -(-self.max_model_len // self.block_size)
        return max(2, min(by_memory, 2 * per_seq * self.config.scheduler.max_num_seqs))

    def ready_message(self) -> EngineCoreReady:
        sched = self.config.scheduler
        return EngineCoreReady(
            pid=os.getpid(),
            max_model_len=self.max_model_len,
            vocab_size=self.loaded.config.vocab_size,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            model_fingerprint=self.loaded.fingerprint,
            model_path=self.loaded.model_path,
            eos_token_ids=list(self.loaded.tokenizer.eos_token_ids),
        )

    # -- requests ----------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue one sequence. The front end validated it against the ready
        message; the scheduler still raises ValueError on a duplicate id or a
        prompt that cannot fit."""
        request = Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            arrival_time=req.arrival_time,
            cache_namespace=req.cache_namespace,
            public_cache_namespace=req.public_cache_namespace,
            num_public_blocks=req.num_public_blocks,
            cache_quota_blocks=req.cache_quota_blocks,
            tenant=req.tenant,
            eos_token_ids=tuple(req.eos_token_ids),
            max_model_len=self.max_model_len,
        )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these now; unknown or finished ids are ignored. No output
        is sent for them: the front end asked, so it already knows."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping ----------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Run one batch; return only what it added to each request."""
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
        outputs = self.scheduler.update_from_output(sched, result)
        self._observe_step_cost(sched, time.perf_counter() - started)
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic())

    def _observe_step_cost(self, sched, seconds: float) -> None:  # noqa: ANN001 - a SchedulerOutput
        """Decode-only steps' times teach speculation where it pays."""
        budget = self.scheduler.draft_budget
        if budget is None or not hasattr(budget, "observe_step") or not sched.num_scheduled_tokens:
            return
        num_drafts = {rid: len(d) for rid, d in sched.spec_token_ids.items()}
        if any(n != 1 + num_drafts.get(rid, 0) for rid, n in sched.num_scheduled_tokens.items()):
            return  # a prefill chunk rode along: not a decode step's cost
        budget.observe_step(len(sched.num_scheduled_tokens), sum(num_drafts.values()), seconds)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def check_integrity(self) -> None:
        self.scheduler.kv.check_integrity()
