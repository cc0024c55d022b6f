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

import torch

from kvferry.config import EngineConfig
from kvferry.core.kv_manager import KVCacheManager
from kvferry.core.scheduler import Scheduler, SchedulerStats
from kvferry.engine import kv_memory
from kvferry.engine.kv_connector import SchedulerContext, for_engine
from kvferry.engine.runner import ModelRunner, kv_block_bytes
from kvferry.engine.pp_runner import StageRunner
from kvferry.engine.afd_leader import AFDLeader
from kvferry.engine.afd_runner import AFDRunner
from kvferry.engine.pp_stages import PPLeader
from kvferry.engine.tp_ranks import RunnerShape, TPLeader
from kvferry.messages import EngineCoreOutputs, EngineCoreReady, EngineCoreRequest, KVTransferParams, TPRank
from kvferry.model import layer_op, small_gemm
from kvferry.model.attention import attention_backend
from kvferry.model.fused_ops import fused_ops_available
from kvferry.model.kv_cache_dtype import dtype_name, resolve_kv_cache_dtype
from kvferry.model.layers.parallel import TPShard
from kvferry.model.loader import LoadedModel, load_model, read_config, resolve_model_folder
from kvferry.model.paged_kernel import get_paged_decode_kernel
from kvferry.core.request import Request, RequestStatus
from kvferry.spec import AutoProposer, runs_head, speculation, speculation_signature
from kvferry.spec.head import EagleHead, resolve_head_path

logger = logging.getLogger(__name__)

# How long an idle step waits for background KV I/O before the next one
# (a connector that signals its completions wakes it sooner).
_IO_WAIT_S = 0.0005
_IO_WAIT_SIGNALLED_S = 0.002
# The order kinds of a prefill/decode transfer: a core takes a disaggregated
# request only if its connector executes them.
_TRANSFER_KINDS = frozenset({"receive", "stream"})


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        # --tensor-parallel-size N: this process is rank 0; the workers start
        # first so that they load their shards while this rank loads its own.
        tp = config.parallel.tensor_parallel_size
        if tp > 1 and loaded is not None:
            raise ValueError("tensor_parallel_size > 1: the engine core loads each rank's shard itself")
        shard = TPShard(0, tp, config.parallel.enable_expert_parallel) if tp > 1 else None
        if shard is not None:  # a model that does not split fails here, before any rank starts
            shard.check(read_config(resolve_model_folder(config.model.model)))
        pp, self.stage = config.parallel.pipeline_parallel_size, None
        self.tp = TPLeader(config) if tp > 1 and pp == 1 else None
        if pp > 1:  # -pp N: this process is stage 0, the leader of stages 1..N-1 (and with -tp, of their ranks)
            if loaded is not None:
                raise ValueError("pipeline_parallel_size > 1: the engine core loads each stage's layers itself")
            self.tp = PPLeader(config, read_config(resolve_model_folder(config.model.model)).num_hidden_layers)
            self.stage = self.tp.stage
        if config.parallel.afd.enabled:  # --ffn M: the MLPs run on FFN workers (afd_leader.py)
            self.tp = AFDLeader(config)
        try:
            self._init(config, loaded, shard)
        except BaseException:
            self.close()
            raise

    def _init(self, config: EngineConfig, loaded: LoadedModel | None, shard: TPShard | None) -> None:
        self.config = config
        m = config.model
        self.runner = None
        self.loaded = loaded or load_model(m.model, dtype=m.dtype, device=m.device, quantization=m.quantization,
                                           shard=shard, stage=self.stage, deterministic=m.deterministic)
        if self.tp is not None:
            self.tp.connect(self.loaded.model.shard)
        self.block_size = config.cache.block_size
        device = torch.device(m.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.loaded.dtype, device,
                                                     attention_backend(m.attention_backend, device) == "triton")
        self.max_model_len = self._resolve_max_model_len()
        # Before the pool is sized: the draft's weights take memory too, and
        # its KV (as many blocks, its own layers and heads) shares the pool's budget.
        draft = self._load_draft()
        self.num_kv_blocks = self._resolve_num_blocks(draft)
        # A sequence can never outgrow the pool.
        self.max_model_len = min(self.max_model_len, self.num_kv_blocks * self.block_size)
        # A draft model over stages writes its KV ahead (pp_runner.py): k slots past each request's tokens.
        spec = config.speculative
        lookahead = (spec.num_speculative_tokens if spec is not None and spec.method == "draft"
                     and self.stage is not None else 0)
        kv = KVCacheManager(self.num_kv_blocks, self.block_size, config.cache.enable_prefix_caching,
                            self.loaded.fingerprint, kv_dtype=dtype_name(self.kv_cache_dtype), lookahead_tokens=lookahead)
        self.speculative = speculation_signature(config.speculative, draft.fingerprint if draft else "")
        # The KV connector: its worker half is made by the runner over the
        # pool, its scheduler half below. Whatever it links to (the node's
        # KV store, a peer) is its own: the core only calls its hooks.
        connector = for_engine(config, kv_block_bytes(self.loaded, self.block_size, self.kv_cache_dtype))
        runner = ModelRunner if self.stage is None else StageRunner  # a pipeline stage: its layers' part
        runner = AFDRunner if config.parallel.afd.enabled else runner  # attention here, MLPs on FFN workers
        self.runner = runner(self.loaded, config, self.num_kv_blocks, self.max_model_len,
                             kv_cache_dtype=self.kv_cache_dtype, connector=connector, draft=draft,
                             head=self._load_head(), speculative=self.speculative)
        if self.tp is not None:  # every rank's pool: the same blocks, its own KV heads
            pool = getattr(self.runner.connector, "pool_name", "")  # pipeline stages: where each maps its pool
            self.tp.start_runners(RunnerShape(self.num_kv_blocks, self.max_model_len, self.kv_cache_dtype, pool))
            self.runner.tp_leader = self.tp
            if self.stage is not None:
                self.runner.link = self.tp.link
        self._cpu = m.device == "cpu"
        if m.device == "cpu":
            # Build (or load) the C++ attention kernel now, before the ready
            # message: otherwise the first requests' TTFT pays for it (a
            # 15-30 s build whenever the kernel's cache is cold).
            get_paged_decode_kernel()
            fused_ops_available()  # the same for the fused elementwise ops
            small_gemm.available(self.loaded.dtype)  # and the small-batch matmul, where the CPU fits it
            layer_op.available()  # and the one-call decoder layer (over it or oneDNN's matmuls)
        scheduler_half = (connector.scheduler_half(SchedulerContext(self.block_size, self.num_kv_blocks))
                          if connector is not None else None)
        self.scheduler = Scheduler(config.scheduler, kv, connector=scheduler_half, **speculation(config.speculative))
        if isinstance(self.scheduler.proposer, AutoProposer) and self.scheduler.proposer.has_head:
            # Method auto with a head: the head fills only the slots auto reserved for it.
            self.runner.head_requests = self.scheduler.proposer.head_requests
        self._num_steps, self._step_seconds = 0, 0.0  # steps that ran a batch (stats)
        if m.warm_up:
            start = time.perf_counter()
            spec = config.speculative
            tokens = self.runner.warm_up(config.scheduler.max_num_batched_tokens, self.max_model_len,
                                         num_spec_tokens=spec.num_speculative_tokens if spec is not None else 0)
            logger.info("warm-up: a %d-token prefill step and a decode step in %.2f s",
                        tokens, time.perf_counter() - start)
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
        if not runs_head(spec):
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

    def _resolve_num_blocks(self, draft: LoadedModel | None) -> int:
        """--num-kv-blocks, else --kv-cache-memory-gb, else a share of the
        memory free now that the weights are in (engine/kv_memory.py). A
        block's bytes are the target's KV plus, with a draft model, the
        draft's (it keeps as many blocks, in its own dtype)."""
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            logger.info("KV cache: --num-kv-blocks %d of %d tokens", cache.num_kv_blocks, self.block_size)
            return cache.num_kv_blocks
        block_bytes = kv_block_bytes(self.loaded, self.block_size, self.kv_cache_dtype)
        if draft is not None:
            block_bytes += kv_block_bytes(draft, self.block_size)
        shape = dict(max_num_seqs=self.config.scheduler.max_num_seqs, max_model_len=self.max_model_len,
                     block_size=self.block_size, block_bytes=block_bytes)
        if cache.kv_cache_memory_gb is not None:
            size = kv_memory.size_explicit(cache.kv_cache_memory_gb, **shape)
        else:
            size = kv_memory.size_kv_pool(
                available_bytes=kv_memory.available_bytes(self.config.model.device),
                num_local_cores=kv_memory.local_engine_cores(),
                max_model_len_asked=bool(self.config.scheduler.max_model_len), **shape)
        logger.info("%s", size.line)
        return size.num_blocks

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
            kv_dtype=self.scheduler.kv.kv_dtype,
            speculative=self.speculative,
            ranks=self.ranks(),
            pipeline_parallel_size=self.config.parallel.pipeline_parallel_size,
            ffn_workers=self.ffn_workers(),
        )

    def ffn_workers(self) -> int:
        """Its FFN workers now (a resize changes them: afd_pool.py); 0 without."""
        return self.tp.size if isinstance(self.tp, AFDLeader) else 0

    def ranks(self) -> list[TPRank]:
        """Its tensor-parallel ranks, rank 0 first ([] without tensor parallelism)."""
        return self.tp.ranks() if self.tp is not None else []

    # -- requests ----------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue one sequence. The front end validated it against the ready
        message; the scheduler still raises ValueError on a duplicate id or a
        prompt that cannot fit."""
        request = Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            arrival_time=req.arrival_time,
            # Whole, as the front end built it (validated when decoded).
            cache_scope=req.cache_scope,
            eos_token_ids=tuple(req.eos_token_ids),
            max_model_len=self.max_model_len,
            kv_transfer=self._check_kv_transfer(req),
        )
        self.scheduler.add_request(request)

    def _check_kv_transfer(self, req: EngineCoreRequest) -> KVTransferParams | None:
        """A disaggregated request's part, validated (ValueError names the field)."""
        params = req.kv_transfer
        if params is None:
            return None
        connector = self.runner.connector
        if connector is None or not _TRANSFER_KINDS <= connector.order_kinds:
            raise ValueError("kv_transfer: this core has no KV transfer socket (--kv-transfer-address)")
        if params.role == "decode":
            return params
        if params.role != "prefill":
            raise ValueError(f"kv_transfer.role must be 'prefill' or 'decode', got {params.role!r}")
        dest, bs = params.dest, self.block_size
        if dest is None:
            raise ValueError("kv_transfer.dest is required with role 'prefill'")
        if dest.block_size != bs:
            raise ValueError(f"kv_transfer.dest.block_size {dest.block_size} differs from this core's {bs}")
        num_prompt = len(req.prompt_token_ids)
        if dest.num_cached_tokens % bs or not 0 <= dest.num_cached_tokens < num_prompt:
            raise ValueError("kv_transfer.dest.num_cached_tokens must be a multiple of block_size below the prompt length")
        if len(dest.block_ids) != -(-num_prompt // bs) - dest.num_cached_tokens // bs:
            raise ValueError("kv_transfer.dest.block_ids must cover the prompt past num_cached_tokens")
        return params

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these now; unknown or finished ids are ignored. No output
        is sent for them: the front end asked, so it already knows."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def purge_tenant(self, tenant: str) -> int:
        """Drop the tenant's unused cached blocks from the device pool now
        (blocks running requests hold stay), and its private blocks from
        every tier of the node's KV store (the connector's), and what suffix
        decoding learned from its finished requests. Returns how many blocks
        were dropped."""
        dropped = self.scheduler.kv.purge(tenant)
        if self.runner.connector is not None:
            dropped += self.runner.connector.purge_tenant(tenant)
        forget = getattr(self.scheduler.proposer, "purge_tenant", None)
        if forget is not None:
            forget(tenant)  # what suffix decoding learned from the tenant's finished requests
        return dropped

    def drop_public_blocks(self, public_namespace: str, token_ids: list[int], first_block: int) -> int:
        """A deleted public prefix's own blocks leave the device pool
        (``KVCacheManager.drop_public``) and the node store's tiers on this
        node (the connector's ``drop_public``: DRAM and disk; a tier shared
        between nodes keeps them, as another node may still declare them).
        Returns how many left the device pool."""
        kv = self.scheduler.kv
        dropped = kv.drop_public(public_namespace, token_ids, first_block)
        if self.runner.connector is not None:
            own = kv.public_block_hashes(public_namespace, token_ids)[first_block:]
            self.runner.connector.drop_public(list(own))
        return dropped

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping ----------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Run one batch; return only what it added to each request."""
        start, cpu_start = time.monotonic(), time.process_time()
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched) if self.tp is None else self.tp.run(self.runner.execute, sched)
        outputs = self.scheduler.update_from_output(sched, result)
        seconds = time.monotonic() - start
        # On a CPU speculation is steered by the lesser of wall and CPU seconds:
        # each only grows with other processes' load (spec/adaptive.py).
        self._observe_step_cost(sched, min(seconds, time.process_time() - cpu_start) if self._cpu else seconds)
        if sched.total_num_scheduled_tokens:
            self._num_steps += 1
            self._step_seconds += seconds
        completed = result.finished_loading or result.finished_saving
        if sched.is_empty and not sched.kv_orders and not outputs and not completed:
            # Only background KV I/O (loads, write-down) to wait for: yield
            # the CPU to it rather than spin. (A completion just applied may
            # have made a request runnable: no wait then.)
            connector = self.runner.connector
            if connector is None or not connector.wait_for_io(_IO_WAIT_SIGNALLED_S):
                time.sleep(_IO_WAIT_S)
        now = time.monotonic()
        return EngineCoreOutputs(outputs=outputs, timestamp=now, kv_events=self.take_kv_events(),
                                 num_scheduled_tokens=sched.total_num_scheduled_tokens, step_duration_s=now - start)

    def take_kv_events(self) -> list | None:
        """Block events since the last call (None when there are none).
        Drained every step, so that they never pile up unread."""
        return self.scheduler.kv.take_events() or None

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
        stats = self.scheduler.stats()
        stats.num_steps, stats.step_seconds = self._num_steps, self._step_seconds
        if self.runner.connector is not None:
            self.runner.connector.report_stats(stats)  # the node store's tiers
        return stats

    def store_stats_changed(self) -> bool:
        """Whether the KV connector's counters (the node store's) were
        refreshed since the last ``stats()`` (the store keeps counting while
        this core idles)."""
        return self.runner.connector is not None and self.runner.connector.stats_changed()

    def close(self) -> None:
        """Release what outlives the process otherwise: the KV connector's
        (the transfer agent's shared-memory pool, the KV store's clients and
        the store this core started, if any), and the worker ranks."""
        if self.runner is not None and self.runner.connector is not None:
            self.runner.connector.close()
        if self.tp is not None:
            self.tp.close()

    def check_ranks(self) -> None:
        """RankFailed once a tensor-parallel worker rank is gone (the core ends whole)."""
        if self.tp is not None:
            self.tp.check()

    def check_integrity(self) -> None:
        self.scheduler.kv.check_integrity()
