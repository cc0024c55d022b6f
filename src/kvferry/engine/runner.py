"""SchedulerOutput -> tensors -> forward -> sample/verify -> RunnerOutput.

The runner owns the model, the KV cache tensor, a persistent batch of the
requests it holds (``InputBatch``: token ids and block tables as numpy rows,
updated in place from the scheduler's deltas) and per-request sampling state
(penalty counts updated with each sampled token). A step
builds its inputs by numpy gathers over those rows, runs the forward pass,
and returns 0 .. k+1 tokens per request (k = its draft tokens). There is one
device->host sync per step: the sampled ids.

Requests with ``structured_outputs`` keep a grammar matcher in their state;
their rows of the token bitmask are filled on a worker thread during the
forward pass and applied by the sampler before anything else
(``kvferry.structured.step``). The matcher advances with each accepted token;
it allows EOS only where the grammar is complete, so a finished grammar ends
the request with finish_reason "stop".
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvferry.config import EngineConfig
from kvferry.core.outputs import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from kvferry.disagg.transport import Received
from kvferry.engine.cuda_graphs import DecodeGraphs
from kvferry.engine.greedy_step import plain_greedy_tokens
from kvferry.engine.host_memory import tune_malloc
from kvferry.model.input_batch import FlatStep, InputBatch, flatten, to_device
from kvferry.engine.kv_connector import KVConnector, KVConnectorWorker, WorkerContext
from kvferry.engine.prompt_work import PromptStep, PromptWork
from kvferry.engine.speculation import (draft_requests, drafts_alone, hidden_from_bytes, hidden_rows, make_drafter,
                                       share_drafts)
from kvferry.engine.tree_verify import UnsampledTrees, compact, prepare_trees, row_prefixes, share_branches, step_trees
from kvferry.model.attention import AttentionMetadata
from kvferry.model.attention import attention_backend as attention_backend_for
from kvferry.model.attention import kernel_max_chunk_tokens
from kvferry.model.layers import BatchInvariantConfig
from kvferry.model.llama import allocate_kv_cache
from kvferry.model.loader import LoadedModel
from kvferry.model.sampler import Sampler, SamplingBatch, SamplingRow, position_generator, token_counts
from kvferry.sampling import SamplingParams
from kvferry.spec.draft_model import DraftModelProposer, Proposal
from kvferry.spec.eagle3_proposer import Eagle3Proposer
from kvferry.spec.head import EagleHead, HeadProposer
from kvferry.spec.rejection import NO_DRAFT, accepted_prefix
from kvferry.spec.reserved import PLACEHOLDER_ID
from kvferry.spec.tree import walk
from kvferry.structured.step import GrammarRow, StepBitmask, StepGrammars

if TYPE_CHECKING:
    from kvferry.structured.backend import GrammarMatcher

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestState:
    """What the runner keeps per request from its first scheduling to its end
    (across preemption, so a seeded stream continues where it was)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    eos_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    # Penalty state, only for requests that penalize: [V] float32 counts of
    # output tokens, [V] bool prompt membership.
    output_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    # Its position in its grammar (structured outputs only).
    matcher: GrammarMatcher | None = None

    @property
    def penalizes(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@dataclass(slots=True)
class StepInputs:
    flat: FlatStep
    # The eager forward's tensors; None for a step a CUDA graph replays
    # (it copies ``flat`` into its own buffers).
    input_ids: torch.Tensor | None  # [num_tokens] int64
    positions: torch.Tensor | None  # [num_tokens] int64
    meta: AttentionMetadata | None
    # [num_logits] indices into the flattened batch: for each sampling request, its last 1 + k
    # tokens (k drafts); None where that is every row in order on CPU (a decode step: no copy)
    logits_indices: torch.Tensor | None
    # (request id, its drafts) for each sampling request, in logits order
    sampling: list[tuple[str, list[int]]]
    # Prompt logprobs / pooling rows of the step (None: no request asks).
    prompt: PromptStep | None = None
    order: list[str] = field(default_factory=list)  # request ids, in the flattened batch's order
    # Draft trees (engine/tree_verify.py): request id -> its drafts' parents, and its first token's offset.
    trees: dict[str, list[int]] = field(default_factory=dict)
    tree_starts: dict[str, int] = field(default_factory=dict)
    # Tree requests' accepted nodes, filled by sampling.
    tree_accepted: dict[str, list[int]] = field(default_factory=dict)


def kv_block_bytes(loaded: LoadedModel, block_size: int, cache_dtype: torch.dtype | None = None) -> int:
    """Bytes of one block over every layer, K and V, in ``cache_dtype`` (default: the model's)."""
    cfg = loaded.config
    elem = torch.empty((), dtype=cache_dtype or loaded.dtype).element_size()
    # A tensor-parallel rank's own KV heads (a plain geometry has no model: all of them).
    kv_heads = getattr(getattr(loaded, "model", None), "num_kv_heads", cfg.num_key_value_heads)
    layers = getattr(getattr(loaded, "model", None), "layers", None)  # a pipeline stage's own
    return (cfg.num_hidden_layers if layers is None else len(layers)) * 2 * block_size * kv_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, num_blocks: int, max_model_len: int,
                 kv_cache_dtype: torch.dtype | None = None, connector: KVConnector | None = None,
                 draft: LoadedModel | None = None, head: EagleHead | None = None, speculative: str = "") -> None:
        """``config``: the engine's (block size, attention backend, CUDA
        graphs, max_num_seqs); ``num_blocks`` and ``max_model_len``: as the
        engine core resolved them; ``kv_cache_dtype``: the cache's storage
        dtype (default: the model's; ``kv_cache_dtype.resolve_kv_cache_dtype``);
        ``connector``: the KV connector whose worker half this runner builds
        over its pool (None: the device pool alone); ``draft``: the draft
        model of speculative method "draft"; ``head``: the draft head of
        method "head"; ``speculative``: the speculation signature a
        disaggregated pair compares (``kvferry.spec.speculation_signature``)."""
        m = config.model
        self.loaded = loaded
        self.model = loaded.model
        if m.deterministic:  # batch-invariant matmuls and attention (model/layers/unquantized.py)
            if config.scheduler.max_num_batched_tokens > kernel_max_chunk_tokens():
                raise ValueError(f"deterministic needs max_num_batched_tokens <= {kernel_max_chunk_tokens()} "
                                 "(longer chunks leave the batch-invariant attention kernel)")
            self.model.set_linear_config(BatchInvariantConfig())
        self.device = next(loaded.model.parameters()).device
        if self.device.type == "cpu":
            tune_malloc()  # steps' temporaries from the heap, not fresh pages (host_memory.py)
        self.block_size = block_size = config.cache.block_size
        self.vocab_size = loaded.config.vocab_size
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zeroed
        self.kv_cache = allocate_kv_cache(loaded.config, num_blocks, block_size, kv_cache_dtype or loaded.dtype,
                                          self.device, getattr(self.model, "num_kv_heads", None))
        # Tensor parallelism (engine/tp_ranks.py): rank 0 sends each step to
        # the workers first; a worker runs the same steps and does not sample.
        self.tp_leader = None
        self.samples = True
        self.triton = attention_backend_for(m.attention_backend, self.device) == "triton"
        self.drafter: DraftModelProposer | HeadProposer | None = None
        # Method auto with a head: the requests whose reserved slots the head
        # fills this step (the scheduler's AutoProposer keeps it); None: all.
        self.head_requests: set[str] | None = None
        # A worker rank with a draft head: its last sampling step's rows, until rank 0's tokens arrive.
        self._pending_hidden: tuple[list[tuple[str, list[int]]], torch.Tensor, dict[str, list[int]]] | None = None
        # A pipeline stage before the last: its step's draft trees, until the last stage's tokens say which held.
        self._unsampled: UnsampledTrees | None = None
        self.drafter = make_drafter(loaded, config, num_blocks, block_size, draft, head)
        # Decode side: requests whose draft KV came with their prompt's, until
        # first scheduled here (the draft then starts past the prompt).
        self._draft_kv_received: set[str] = set()
        self.connector: KVConnectorWorker | None = None
        if connector is not None:
            draft_kv = self.drafter.kv_cache if isinstance(self.drafter, DraftModelProposer) else None
            self.connector = connector.worker_half(WorkerContext(self.kv_cache, block_size, draft_kv, speculative,
                                                                 shard=getattr(self.model, "shard", None)))
            self.kv_cache = self.connector.kv_cache  # moved into shared memory for a prefill core, maybe
        self.states: dict[str, RequestState] = {}
        self.batch = InputBatch(self.vocab_size)
        self.sampler = Sampler()
        # Requests that asked for prompt logprobs, pooling or no sampling (prompt_work.py).
        self.prompt_work = PromptWork(self.device)
        self.grammars = StepGrammars(loaded.tokenizer, self.vocab_size)
        self.graphs: DecodeGraphs | None = None
        if not m.enforce_eager and self.triton and self.device.type == "cuda":
            max_blocks = -(-(max_model_len or loaded.config.max_position_embeddings) // block_size)
            self.graphs = DecodeGraphs(self.model, self.kv_cache, block_size, config.scheduler.max_num_seqs,
                                       max_blocks)
            self.graphs.capture_all()

    # -- applying the scheduler's deltas ------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        if self.prompt_work.tasks:
            for rid in sched.finished_request_ids:
                self.prompt_work.remove(rid)
        for rid in sched.finished_request_ids:
            self.states.pop(rid, None)
            self.batch.remove(rid)
            self._draft_kv_received.discard(rid)
            if self.drafter is not None:
                self.drafter.remove(rid)
        if self.connector is not None and sched.finished_request_ids:
            self.connector.finished_requests(sched.finished_request_ids)
        for rid in sched.preempted_request_ids:
            self.batch.remove(rid)  # the state stays: it comes back as new
        for data in sched.new_requests:
            self._add_request(data)
        for cached in sched.cached_requests:
            row = self.batch.index[cached.request_id]
            self.batch.append_blocks(row, cached.new_block_ids)
            self.batch.append_tokens(row, cached.new_token_ids)
            self.states[cached.request_id].output_token_ids.extend(cached.new_token_ids)
            self.batch.num_computed_tokens[row] = cached.num_computed_tokens
        for rid, drafts in sched.spec_token_ids.items():
            self.batch.write_drafts(self.batch.index[rid], drafts)

    def _add_request(self, data: NewRequestData) -> None:
        self.batch.remove(data.request_id)
        self.batch.add(data)
        if isinstance(self.drafter, DraftModelProposer) and data.request_id in self._draft_kv_received:
            # Its prompt's draft KV was received with the target's: the draft
            # starts where the target does (once: a readmission starts over).
            self._draft_kv_received.discard(data.request_id)
            self.drafter.add(data.request_id, num_computed_tokens=data.num_computed_tokens)
        elif self.drafter is not None:
            self.drafter.add(data.request_id)
        state = self.states.get(data.request_id)
        if state is None:
            state = RequestState(data.sampling_params, data.prompt_token_ids, data.eos_token_ids,
                                 matcher=self._matcher(data) if self.samples else None)
            self.states[data.request_id] = state
            self.prompt_work.add(data.request_id, data.sampling_params, data.prompt_token_ids)
        state.output_token_ids = list(data.output_token_ids)
        if state.penalizes:
            # Once per (re)admission: O(prompt + outputs). Steps then only add.
            state.prompt_mask = token_counts([data.prompt_token_ids], self.vocab_size, self.device)[0] > 0
            state.output_counts = token_counts([state.output_token_ids], self.vocab_size, self.device)[0]

    def _matcher(self, data: NewRequestData) -> GrammarMatcher | None:
        structured = data.sampling_params.structured_outputs
        if structured is None:
            return None
        try:
            matcher = self.grammars.matcher(structured)
        except ValueError:
            # The edge compiles every grammar first; reaching here is a bug, and
            # one request must not take the core down: it runs unconstrained.
            logger.exception("request %s: grammar does not compile; running it unconstrained", data.request_id)
            return None
        for token in data.output_token_ids:  # outputs made before it came here
            matcher.accept_token(token)
            if matcher.is_terminated:  # ignore_eos went past the grammar's end: nothing left to constrain
                return None
        return matcher

    # -- inputs ---------------------------------------------------------------
    def _prepare(self, sched: SchedulerOutput, spec_token_ids: dict[str, list[int]], graph_ok: bool,
                 trees: dict[str, list[int]] | None = None) -> StepInputs:
        """``spec_token_ids``: each request's drafts (the scheduler's, or the
        draft model's where the scheduler only reserved their slots);
        ``trees``: the parents of those that are draft trees."""
        # Multi-token chunks first, then single-token ones (AttentionMetadata).
        order = sorted(sched.num_scheduled_tokens, key=lambda rid: sched.num_scheduled_tokens[rid] == 1)
        batch = self.batch
        rows = np.fromiter((batch.index[rid] for rid in order), dtype=np.int64, count=len(order))
        lens = np.fromiter((sched.num_scheduled_tokens[rid] for rid in order), dtype=np.int64, count=len(order))
        starts = batch.num_computed_tokens[rows]
        flat = flatten(batch, rows, starts, lens, self.block_size)
        tree_starts = prepare_trees(flat, order, trees) if trees else {}
        # A request samples when its tokens reach the end of the known ones
        # (a non-final prefill chunk does not); with k drafts it samples at
        # its last 1 + k positions.
        num_drafts = np.fromiter((len(spec_token_ids.get(rid, ())) for rid in order), dtype=np.int64, count=len(order))
        samples = flat.seq_lens - num_drafts >= batch.num_tokens[rows]
        prompt = None
        if self.prompt_work.tasks:  # (clears ``samples`` of prompt-only requests)
            prompt = self.prompt_work.plan(order, starts, lens, flat.query_start_loc, samples)
        logits_indices = [
            np.arange(end - 1 - k, end)
            for end, k, s in zip(flat.query_start_loc[1:], num_drafts, samples)
            if s
        ]
        indices = np.concatenate(logits_indices) if logits_indices else np.zeros(0, np.int64)
        inputs = StepInputs(
            flat=flat, input_ids=None, positions=None, meta=None,
            logits_indices=None if len(indices) == len(flat.input_ids) and self.device.type == "cpu" else
            self._to_device(indices),
            sampling=[(rid, spec_token_ids.get(rid, [])) for rid, s in zip(order, samples) if s],
            prompt=prompt, order=order, trees=trees or {}, tree_starts=tree_starts,
        )
        # A replay fills no aux rows, and takes no tree mask.
        graph_ok = graph_ok and not isinstance(self.drafter, Eagle3Proposer) and not tree_starts
        if not (graph_ok and self.graphs is not None and self.graphs.can_run(flat)):
            self._eager_inputs(inputs)
        return inputs

    def _eager_inputs(self, inputs: StepInputs) -> None:
        flat = inputs.flat
        inputs.input_ids = self._to_device(flat.input_ids)
        inputs.positions = self._to_device(flat.positions)
        inputs.meta = flat.metadata(self.block_size, self.device, self.kv_cache.dtype, self.triton)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """[num_tokens, hidden]: a CUDA graph's replay where the step has one
        (``inputs.meta`` is None), else the eager forward."""
        if inputs.meta is None:
            hidden = self.graphs.run(inputs.flat)
            if hidden is not None:
                return hidden
            self._eager_inputs(inputs)  # the capture failed: eager from now on
        return self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    # -- step -----------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        # A draft model or an EAGLE-3 head drafts on rank 0 alone (outside the
        # ranks' collectives): the workers get the step once its drafts are known.
        publish_late = self.tp_leader is not None and drafts_alone(self.drafter)
        if self.tp_leader is not None and self.head_requests is not None:  # auto's choice, made here alone
            self.tp_leader.share_head_requests(self.head_requests)
        if self.tp_leader is not None and (not publish_late or sched.is_empty):
            self.tp_leader.publish(sched)
        self._update_states(sched)
        step_transfer = None  # the connector's layer hooks for this step
        if sched.kv_orders:
            if self.connector is None:
                raise ValueError("KV orders reached a runner without a KV connector")
            self.connector.execute(sched.kv_orders)
            step_transfer = self.connector.begin_step(sched.kv_orders)
        out = RunnerOutput()
        if not sched.is_empty:
            spec_token_ids, proposals, drafted = self._draft(sched, out, step_transfer)
            # Draft trees: the scheduler's where nothing here drafted over them, and the head's (spec/head_tree.py).
            trees = step_trees(sched.spec_tree_parents, proposals)
            if publish_late:
                self.tp_leader.publish(replace(sched, spec_token_ids=spec_token_ids, spec_tree_parents=trees))
            inputs = self._prepare(sched, spec_token_ids, graph_ok=step_transfer is None, trees=trees)
            if inputs.meta is not None:
                inputs.meta.kv_transfer = step_transfer
            # Started before the forward pass so the two overlap; joined before sampling.
            pending_bitmask = self._start_bitmask(inputs.sampling) if self.samples else None
            hidden = self._forward(inputs)
            if inputs.prompt is not None:
                self.prompt_work.run(self.model, hidden, inputs.prompt, out)
            if inputs.sampling:
                sampled_hidden = hidden if inputs.logits_indices is None else hidden[inputs.logits_indices]
                logits = self.model.compute_logits(sampled_hidden)  # [num_logits, vocab] fp32
                if self.samples:  # rank 0 alone (its tokens reach the workers with the next step)
                    self._sample(logits, inputs, out, pending_bitmask, proposals)
                if inputs.trees and getattr(getattr(self.model, "shard", None), "size", 1) > 1:
                    self._settle_trees_over_ranks(inputs)
                if isinstance(self.drafter, HeadProposer):
                    self._record_hidden(inputs, sampled_hidden, out)
            if isinstance(self.drafter, Eagle3Proposer):
                self.drafter.record_aux(self.model.aux_hidden, inputs.flat, inputs.order, spec_token_ids,
                                        out.sampled_token_ids)
            for request in drafted:
                self.drafter.advance(request, max(len(out.sampled_token_ids.get(request.request_id, [])) - 1, 0))
            if step_transfer is not None:
                # Seeded sampling is keyed by output position (position_generator):
                # the decode core draws the same noise with no generator state sent.
                hidden = None
                if isinstance(self.drafter, HeadProposer):  # the head drafts from it on the decode core
                    hidden = {o.request_id: h for o in step_transfer.orders
                              if o.last and (h := self.drafter.hidden_state(o.request_id)) is not None}
                step_transfer.finish(out.sampled_token_ids, {}, hidden)
        if self.connector is not None:
            self._take_completions(out, idle=sched.is_empty)
        if self.tp_leader is not None:
            self.tp_leader.record(out)
        return out

    def _draft(self, sched: SchedulerOutput, out: RunnerOutput,
               step_transfer: object) -> "tuple[dict[str, list[int]], dict[str, Proposal], list]":
        """The step's drafts: (each request's drafts, the drafter's proposals,
        the DraftRequests it drafted for). The scheduler reserved the drafts'
        slots; the drafter fills them."""
        if self.drafter is None or not (sched.spec_token_ids or self.drafter.every_step):
            return sched.spec_token_ids, {}, []
        drafted = draft_requests(self.batch, sched, self.states)
        if self.head_requests is not None:  # method auto: its other drafts are the scheduler's
            drafted = [r for r in drafted if r.request_id in self.head_requests]
        proposals = self.drafter.propose(self.batch, drafted) if drafted else {}
        if not drafts_alone(self.drafter):  # a draft head drafts on every rank: rank 0's sampled drafts hold
            share_drafts(self.model, self.batch, drafted, proposals, self.samples)
        spec_token_ids = ({**sched.spec_token_ids, **{rid: p.token_ids for rid, p in proposals.items()}}
                          if self.head_requests is not None else {rid: p.token_ids for rid, p in proposals.items()})
        if isinstance(self.drafter, DraftModelProposer):
            out.num_draft_prompt_tokens = self.drafter.take_prompt_tokens_computed()
            if step_transfer is not None:
                step_transfer.draft_done()
        return spec_token_ids, proposals, drafted

    def apply_sampled(self, sampled: dict[str, list[int]],
                      received_hidden: dict[str, torch.Tensor] | None = None) -> None:
        """A worker rank: rank 0's tokens of the step before, as if sampled
        here (a draft tree's accepted branch compacted as rank 0's was), and
        the hidden states rank 0's connector received for the draft head (P/D
        decode side)."""
        for rid, hidden in (received_hidden or {}).items():
            if isinstance(self.drafter, HeadProposer):
                self.drafter.record(rid, hidden.to(self.device))
        if self._unsampled is not None:  # a pipeline stage: the last stage's tokens name each tree's branch
            (trees, self._unsampled) = self._unsampled, None
            trees.settle(self.kv_cache, getattr(self.model, "aux_hidden", None), trees.branches(sampled))
        if self._pending_hidden is not None:  # the draft head's rows of that step, now that they are known
            (sampling, hidden, tree_accepted), self._pending_hidden = self._pending_hidden, None
            self._record_rows(sampling, hidden, sampled, tree_accepted)
        for rid, tokens in sampled.items():
            if tokens and rid in self.states and rid in self.batch.index:
                self._record(rid, tokens)

    def _settle_trees_over_ranks(self, inputs: StepInputs) -> None:
        """Tensor parallelism: rank 0's accepted nodes of each tree to every
        rank (one small sum, rank 0's fills), and each worker compacts its
        own KV heads now, within the step, before a second sum lets rank 0
        go on: rank 0's connector may read any rank's pool from the next
        step on (a KV store's save of the block)."""
        trees = [(rid, len(drafts)) for rid, drafts in inputs.sampling if rid in inputs.trees]
        group = self.model.shard.group
        accepted = share_branches(group, trees, inputs.tree_accepted if self.samples else None)
        if not self.samples:
            for rid, nodes in accepted.items():
                compact(self.kv_cache, getattr(self.model, "aux_hidden", None), inputs.flat.slots,
                        inputs.tree_starts[rid], nodes)
            inputs.tree_accepted = accepted  # the draft head's rows (_record_hidden)
        group.all_reduce(torch.zeros(1))  # rank 0 goes on only once every worker has compacted

    def _keep_trees(self, inputs: StepInputs) -> None:
        """A pipeline stage before the last: the step's trees, for ``apply_sampled`` to compact."""
        if inputs.trees:
            self._unsampled = UnsampledTrees({rid: (drafts, inputs.trees[rid], inputs.tree_starts[rid])
                                              for rid, drafts in inputs.sampling if rid in inputs.trees},
                                             inputs.flat.slots)

    # -- warm-up --------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, max_num_tokens: int, max_model_len: int, num_seqs: int = 8,
                num_spec_tokens: int = 0) -> int:
        """Run one prefill step of up to ``max_num_tokens`` tokens over
        ``num_seqs`` dummy sequences, then one decode step of them (with
        ``num_spec_tokens`` drafts each when speculation is on), and drop
        them; returns the prefill's token count (0: the pool is too small).

        Called before the core reports ready. The first forward pass of a
        process pays one-time costs (the kernels' first calls, weight
        packing, the allocator growing to a full step's temporaries): 0.4 s
        on a 2-core CPU with SmolLM2-135M, on top of a 256-token prefill's
        0.09 s. Without this, the first requests a server takes wait for it.
        With speculation the decode step verifies ``num_spec_tokens`` drafts
        a request (1 + k tokens each), and a draft model or head is warmed
        too: it runs over the prompts and drafts them (ngram drafts are
        placeholders here). The dummy sequences write KV (the target's
        and the draft's) into blocks no request holds yet (every block is
        written before it is read) and never reach the scheduler, the prefix
        cache or the connectors; the drafter forgets them when they finish.
        Greedy sampling leaves the random state alone.
        """
        bs = self.block_size
        num_blocks = self.kv_cache.shape[2]
        k = num_spec_tokens
        num_seqs = max(1, min(num_seqs, max_num_tokens, num_blocks))
        per_seq = min(max_num_tokens // num_seqs, max_model_len - 1 - k, (num_blocks // num_seqs) * bs - 1 - k)
        if per_seq < 1:
            return 0
        blocks_per_seq = -(-(per_seq + 1 + k) // bs)
        params = SamplingParams(temperature=0.0, max_tokens=2 + k)
        new, ids = [], []
        for i in range(num_seqs):
            rid = f"kvferry-warm-up-{i}"
            prompt = ((np.arange(per_seq, dtype=np.int64) * 7919 + i * 104729) % self.vocab_size).tolist()
            blocks = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            new.append(NewRequestData(rid, prompt, params, [], blocks, 0))
            ids.append(rid)
        connector = self.connector
        self.connector = None  # nothing of the warm-up reaches a connector (or leaves the process)
        try:
            self.execute(SchedulerOutput(new_requests=new, num_scheduled_tokens={rid: per_seq for rid in ids}))
            self.execute(SchedulerOutput(
                cached_requests=[CachedRequestData(rid, [], per_seq) for rid in ids],
                num_scheduled_tokens={rid: 1 + k for rid in ids},
                spec_token_ids={rid: [PLACEHOLDER_ID] * k for rid in ids} if k else {}))
        finally:
            self.execute(SchedulerOutput(finished_request_ids=ids))
            self.connector = connector
        return per_seq * num_seqs

    def _take_completions(self, out: RunnerOutput, idle: bool) -> None:
        """The connector's completions into the step's result. An idle step
        (only KV I/O outstanding) lets the connector wait a little for one."""
        done = self.connector.take_finished(idle)
        out.finished_loading = done.finished_loading
        out.finished_saving = done.finished_saving
        out.finished_sending = done.finished_sending
        out.num_loaded_blocks = done.num_loaded_blocks
        out.failed_loading = done.failed_loading
        out.kv_received = done.kv_received
        for rid, received in done.payloads.items():
            self._install_draft_state(rid, received)

    def _install_draft_state(self, rid: str, received: Received) -> None:
        """What the prefill core's drafter state became here: the hidden
        state the head drafts from, or the note that the draft model's
        prompt KV is in place. Nothing of the prompt is recomputed."""
        if isinstance(self.drafter, DraftModelProposer):
            self._draft_kv_received.add(rid)
        elif isinstance(self.drafter, HeadProposer) and received.hidden_state:
            hidden = hidden_from_bytes(received, self.loaded.config.hidden_size, self.device)
            if hidden is None:
                logger.warning("request %s: a hidden state of %d bytes (%s) does not fit this head; it drafts "
                               "from its second step", rid, len(received.hidden_state), received.hidden_state_dtype)
            else:
                self.drafter.record(rid, hidden)
                if self.tp_leader is not None:  # the workers' heads draft in step with this one
                    self.tp_leader.share_hidden(rid, hidden)

    def _record_hidden(self, inputs: StepInputs, sampled_hidden: torch.Tensor, out: RunnerOutput) -> None:
        """The draft head's input: each request's row of ``sampled_hidden``
        [num_logits, H] that sampled its newest token (its last accepted
        row). Only indices here; the head gathers the rows it drafts from.
        A worker rank learns which rows from rank 0's tokens, with the next
        step (``apply_sampled``)."""
        assert isinstance(self.drafter, HeadProposer)
        if not self.samples:  # a chain's row is known with rank 0's tokens (apply_sampled)
            self._pending_hidden = (inputs.sampling, sampled_hidden, inputs.tree_accepted)
            return
        self._record_rows(inputs.sampling, sampled_hidden, out.sampled_token_ids, inputs.tree_accepted)

    def _record_rows(self, sampling: list[tuple[str, list[int]]], sampled_hidden: torch.Tensor,
                     sampled: dict[str, list[int]], tree_accepted: dict[str, list[int]] | None = None) -> None:
        self.drafter.record_step(sampled_hidden, hidden_rows(sampling, sampled, tree_accepted))

    # -- sampling and verification --------------------------------------------
    def _start_bitmask(self, sampling: list[tuple[str, list[int]]]) -> "Future[StepBitmask] | None":
        rows, first_logit = [], 0
        for rid, drafts in sampling:
            matcher = self.states[rid].matcher
            if matcher is not None:
                rows.append(GrammarRow(first_logit, matcher, drafts))
            first_logit += len(drafts) + 1
        return self.grammars.start_fill(rows) if rows else None

    def _sample(self, logits: torch.Tensor, inputs: StepInputs, out: RunnerOutput,
                pending_bitmask: "Future[StepBitmask] | None" = None,
                proposals: "dict[str, Proposal] | None" = None) -> None:
        """Sample the target at every position, verifying drafts by exact
        rejection sampling (``kvferry.spec.rejection``): each request keeps
        its drafts up to the first rejected one, then one sampled token. A
        draft tree is walked instead (``kvferry.spec.tree``): each row is
        sampled as the output position of its depth, and the accepted
        branch's KV is moved to where a chain's would be."""
        sampling = inputs.sampling
        # All-greedy rows without a draft distribution: the argmax of every row (engine/greedy_step.py).
        tokens = None if pending_bitmask is not None else plain_greedy_tokens(
            logits, sampling, self.states, self.vocab_size,
            with_drafts=all(p.probs is None for p in (proposals or {}).values()))
        if tokens is None:
            tokens, logprobs = self._sampler_tokens(logits, inputs, pending_bitmask, proposals)
        else:
            logprobs = [None] * len(tokens)
        i = 0
        for rid, drafts in sampling:
            parents = inputs.trees.get(rid)
            if parents is None:
                accepted = accepted_prefix(drafts, tokens[i : i + len(drafts) + 1])
                lps = logprobs[i : i + len(accepted)]
            else:
                accepted, nodes = walk(drafts, parents, tokens[i : i + len(drafts) + 1])
                lps = [logprobs[i + r] for r in [0, *(1 + n for n in nodes)]]
                inputs.tree_accepted[rid] = nodes
                compact(self.kv_cache, getattr(self.model, "aux_hidden", None), inputs.flat.slots,
                        inputs.tree_starts[rid], nodes)
            i += len(drafts) + 1
            self._record(rid, accepted)
            out.sampled_token_ids[rid] = accepted
            if lps and lps[0] is not None:
                out.logprobs[rid] = [lp for lp in lps if lp is not None]

    def _sampler_tokens(self, logits: torch.Tensor, inputs: StepInputs,
                        pending_bitmask: "Future[StepBitmask] | None",
                        proposals: "dict[str, Proposal] | None") -> tuple[list[int], list]:
        """The sampler's token and logprobs per row (a request's 1 + k rows in order)."""
        sampling = inputs.sampling
        rows: list[SamplingRow] = []
        draft_ids: list[int] = []
        prefixes = {rid: row_prefixes(drafts, inputs.trees.get(rid)) for rid, drafts in sampling}
        for rid, drafts in sampling:
            state = self.states[rid]
            # A tree's nodes are deterministic guesses: each row samples p (the
            # one-hot case of rejection sampling), and the walk picks the branch.
            draft_ids.extend([NO_DRAFT] * len(drafts) if rid in inputs.trees else drafts)
            draft_ids.append(NO_DRAFT)
            for prefix in prefixes[rid]:
                rows.append(
                    SamplingRow(
                        params=state.params,
                        prompt_token_ids=state.prompt_token_ids,
                        output_token_ids=state.output_token_ids,
                        generator=position_generator(state.params.seed, len(state.output_token_ids) + len(prefix),
                                                     self.device),
                        eos_token_ids=state.eos_token_ids,
                        num_output_tokens=len(state.output_token_ids) + len(prefix),
                    )
                )
        counts, prompt_mask = self._penalty_state(sampling, prefixes)
        # [num_logits, 8]: each request's persistent knob row, once per position
        knob_rows = np.fromiter((self.batch.index[rid] for rid, _ in sampling), dtype=np.int64, count=len(sampling))
        reps = np.fromiter((len(d) + 1 for _, d in sampling), dtype=np.int64, count=len(sampling))
        knobs = np.repeat(self.batch.sampling_knobs[knob_rows], reps, axis=0)
        batch = SamplingBatch.build(rows, self.vocab_size, self.device, counts, prompt_mask, knobs)
        if pending_bitmask is not None:
            step_bitmask = pending_bitmask.result()
            batch.grammar_rows, batch.grammar_bitmask = step_bitmask.rows, step_bitmask.bitmask
        if len(draft_ids) == len(sampling):  # no drafts this step
            result = self.sampler(logits, batch)
        else:
            draft_probs, has_draft_probs = self._draft_probs(sampling, proposals or {})
            result = self.sampler.verify(logits, batch, draft_ids, draft_probs, has_draft_probs)
        return result.token_ids, result.logprobs

    def _draft_probs(self, sampling: list[tuple[str, list[int]]],
                     proposals: "dict[str, Proposal]") -> tuple[torch.Tensor | None, list[bool] | None]:
        """[num_logits, V] q at each draft row (zeros elsewhere) and which
        rows have one; (None, None) when every draft is deterministic."""
        if not any(p.probs is not None for p in proposals.values()):
            return None, None
        parts, flags = [], []
        for rid, drafts in sampling:
            probs = proposals[rid].probs if rid in proposals else None
            if probs is not None:
                parts.append(probs[: len(drafts)])  # [k, V]
            else:
                parts.append(torch.zeros(len(drafts), self.vocab_size, device=self.device))
            parts.append(torch.zeros(1, self.vocab_size, device=self.device))  # the bonus row
            flags.extend([probs is not None] * len(drafts) + [False])
        return torch.cat(parts), flags

    def _penalty_state(self, sampling: list[tuple[str, list[int]]],
                       prefixes: dict[str, list[list[int]]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """[num_logits, V] output counts and prompt masks from each request's
        running state; a draft position k also counts the k drafts before it
        (they are the output there if accepted; in a tree, its ancestors)."""
        states = [self.states[rid] for rid, _ in sampling]
        if not any(s.penalizes for s in states):
            return None, None
        zeros_counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
        zeros_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        counts, masks, draft_rows, draft_ids = [], [], [], []
        for (rid, drafts), state in zip(sampling, states):
            for prefix in prefixes[rid]:
                row = len(counts)
                counts.append(state.output_counts if state.penalizes else zeros_counts)
                masks.append(state.prompt_mask if state.penalizes else zeros_mask)
                draft_rows.extend([row] * len(prefix))
                draft_ids.extend(prefix)
        output_counts = torch.stack(counts)  # [num_logits, V]
        if draft_rows:
            index = (torch.tensor(draft_rows, device=self.device), torch.tensor(draft_ids, device=self.device))
            output_counts.index_put_(index, torch.ones(len(draft_rows), device=self.device), accumulate=True)
        return output_counts, torch.stack(masks)

    def _record(self, rid: str, accepted: list[int]) -> None:
        """The runner knows its own samples: append them to the request's
        row and penalty state (the scheduler will not send them back)."""
        state = self.states[rid]
        state.output_token_ids.extend(accepted)
        self.batch.append_tokens(self.batch.index[rid], accepted)
        if state.matcher is not None:
            for token in accepted:
                if not state.matcher.accept_token(token):
                    # Only when something overrode the mask (min_tokens banning
                    # the grammar's only way out): the grammar cannot follow.
                    logger.warning("request %s: token %d breaks its grammar", rid, token)
                    state.matcher = None
                    break
                if state.matcher.is_terminated:
                    # The grammar accepted its stop token. A request goes on
                    # only under ignore_eos; a terminated matcher has no mask
                    # to give (xgrammar raises), so, as in vLLM, the rest of
                    # its tokens are unconstrained.
                    state.matcher = None
                    break
        if state.output_counts is not None:
            ids = torch.tensor(accepted, device=self.device)
            state.output_counts.index_add_(0, ids, torch.ones(len(accepted), device=self.device))


