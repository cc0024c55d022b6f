"""LLMEngine: add_request / step / abort. Owns the scheduler and the runner."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from kvferry.config import CacheConfig, EngineConfig, ModelLoadConfig, SchedulerConfig
from kvferry.core.kv_manager import KVCacheManager
from kvferry.core.scheduler import Scheduler, SchedulerStats
from kvferry.core.swap_space import HostSwapSpace
from kvferry.engine.output_processor import OutputProcessor
from kvferry.engine.runner import ModelRunner, kv_block_bytes
from kvferry.model.loader import LoadedModel, load_model
from kvferry.outputs import RequestOutput
from kvferry.request import Request, RequestStatus
from kvferry.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ParentRequest:
    """A user request; n > 1 fans out into n sequences sharing a prompt."""

    request_id: str
    child_ids: list[str]
    num_unfinished: int


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        m = config.model
        self.loaded = loaded or load_model(m.model, dtype=m.dtype, device=m.device)
        self.tokenizer = self.loaded.tokenizer
        self.block_size = config.cache.block_size
        self.max_model_len = self._resolve_max_model_len()
        num_blocks = self._resolve_num_blocks()
        self.max_model_len = min(self.max_model_len, num_blocks * self.block_size)
        kv = KVCacheManager(num_blocks, self.block_size, config.cache.enable_prefix_caching, self.loaded.fingerprint)
        num_swap = config.cache.num_swap_blocks
        self.scheduler = Scheduler(config.scheduler, kv, swap_space=HostSwapSpace(num_swap) if num_swap else None)
        self.runner = ModelRunner(self.loaded, num_blocks, self.block_size, num_swap_blocks=num_swap)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.parents: dict[str, ParentRequest] = {}
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        logger.info("engine ready: %d KV blocks of %d tokens, max_model_len %d", num_blocks, self.block_size, self.max_model_len)

    @classmethod
    def from_args(cls, model: str | None = None, dtype: str = "auto", device: str = "cpu", **kwargs) -> "LLMEngine":
        return cls(build_engine_config(model=model, dtype=dtype, device=device, **kwargs))

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

    # -- requests ----------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_namespace: str = "",
    ) -> None:
        """Validate and queue a request; raises ValueError naming the bad field."""
        params = (params or SamplingParams()).clone()
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids)
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        for index, child_id in enumerate(child_ids):
            child_params = _child_params(params, index)
            request = Request(
                child_id, token_ids, child_params,
                cache_namespace=cache_namespace,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
            )
            self.scheduler.add_request(request)
            self.output_processor.add(request, request_id, index, text)
        self.parents[request_id] = ParentRequest(request_id, child_ids, len(child_ids))

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError("prompt must be a string or a list of token ids")

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and len(token_ids) > sched.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                f"({sched.max_num_batched_tokens}) with chunked prefill disabled"
            )
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the context length is {self.max_model_len} "
                "and at least one token must be generated"
            )

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.parents.pop(request_id, None)
            if parent is None:
                continue
            self.scheduler.finish_requests(parent.child_ids, RequestStatus.FINISHED_ABORTED)
            for child_id in parent.child_ids:
                self._forget_child(child_id)

    def _forget_child(self, child_id: str) -> None:
        self.output_processor.remove(child_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # -- stepping ----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns one RequestOutput per sequence that changed;
        ``request_id`` is the user's id and ``outputs[0].index`` tells which
        of its n sequences it is."""
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
        core_outputs = self.scheduler.update_from_output(sched, result)
        processed = self.output_processor.process(core_outputs)
        if processed.stopped_by_string:
            self.scheduler.finish_requests(processed.stopped_by_string, RequestStatus.FINISHED_STOPPED)
        for out in processed.outputs:
            if out.finished:
                self._on_sequence_finished(out)
        return processed.outputs

    def _on_sequence_finished(self, out: RequestOutput) -> None:
        parent = self.parents.get(out.request_id)
        if parent is None:
            return
        child_id = parent.child_ids[out.outputs[0].index]
        self._forget_child(child_id)
        parent.num_unfinished -= 1
        if parent.num_unfinished == 0:
            del self.parents[out.request_id]

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def check_integrity(self) -> None:
        self.scheduler.kv.check_integrity()


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of n sequences gets its own seed (seed + index) so that they differ
    yet stay reproducible."""
    if params.n == 1:
        return params
    child = params.clone()
    child.n = 1
    if child.seed is not None:
        child.seed += index
    return child


def build_engine_config(
    model: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    block_size: int = 16,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    num_kv_blocks: int | None = None,
    kv_cache_memory_gb: float = 2.0,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    max_model_len: int = 0,
    num_swap_blocks: int = 0,
) -> EngineConfig:
    return EngineConfig(
        model=ModelLoadConfig(model=model, dtype=dtype, device=device),
        cache=CacheConfig(block_size, num_kv_blocks, kv_cache_memory_gb, enable_prefix_caching, num_swap_blocks),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill),
    )
