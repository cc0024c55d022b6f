"""SchedulerOutput -> tensors -> forward -> sample/verify -> RunnerOutput.

The runner owns the model, the KV cache tensor, a persistent batch of the
requests it holds (``InputBatch``: token ids and block tables as numpy rows,
updated in place from the scheduler's deltas) and per-request sampling state
(seeded generator, penalty counts updated with each sampled token). A step
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
from dataclasses import dataclass, field

import numpy as np
import torch

from kvferry.config import KVTransferConfig
from kvferry.core.outputs import NewRequestData, RunnerOutput, SchedulerOutput
from kvferry.disagg.agent import KVTransferAgent
from kvferry.disagg.transport import SharedKVPool
from kvferry.engine.input_batch import InputBatch
from kvferry.engine.kv_connector import HostSwapConnector, KVConnector
from kvferry.model.attention import AttentionMetadata
from kvferry.model.llama import allocate_kv_cache
from kvferry.model.loader import LoadedModel
from kvferry.model.sampler import Sampler, SamplingBatch, SamplingRow, token_counts
from kvferry.sampling import SamplingParams
from kvferry.structured.backend import GrammarMatcher
from kvferry.structured.step import GrammarRow, StepBitmask, StepGrammars

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestState:
    """What the runner keeps per request from its first scheduling to its end
    (across preemption, so a seeded stream continues where it was)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    eos_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
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
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    # [num_logits] indices into the flattened batch: for each sampling
    # request, its last 1 + k tokens (k drafts)
    logits_indices: torch.Tensor
    # (request id, its drafts) for each sampling request, in logits order
    sampling: list[tuple[str, list[int]]]


def kv_block_bytes(loaded: LoadedModel, block_size: int) -> int:
    cfg = loaded.config
    elem = torch.empty((), dtype=loaded.dtype).element_size()
    return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, num_swap_blocks: int = 0,
                 kv_transfer: KVTransferConfig | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = next(loaded.model.parameters()).device
        self.block_size = block_size
        self.vocab_size = loaded.config.vocab_size
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zeroed
        self.kv_cache = allocate_kv_cache(loaded.config, num_blocks, block_size, loaded.dtype, self.device)
        # Prefill/decode disaggregation: the agent (and, on CPU, the pool in
        # shared memory so that a prefill core on this host writes in place).
        self.kv_transfer: KVTransferAgent | None = None
        if kv_transfer is not None and kv_transfer.kv_transfer_address:
            self.kv_transfer = _transfer_agent(self.kv_cache, kv_transfer)
            self.kv_cache = self.kv_transfer.kv_cache
        self.connector: KVConnector = HostSwapConnector(self.kv_cache, num_swap_blocks)
        self.states: dict[str, RequestState] = {}
        self.batch = InputBatch(self.vocab_size)
        self.sampler = Sampler()
        self.grammars = StepGrammars(loaded.tokenizer, self.vocab_size)

    # -- applying the scheduler's deltas ------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.states.pop(rid, None)
            self.batch.remove(rid)
        if self.kv_transfer is not None:
            self.kv_transfer.finished_requests(sched.finished_request_ids)
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
        state = self.states.get(data.request_id)
        if state is None:
            gen = None
            if data.sampling_params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(data.sampling_params.seed)
                received = self.kv_transfer.generator_states.pop(data.request_id, None) if self.kv_transfer else None
                if received:  # a prefill core sampled its first token: continue its stream
                    gen.set_state(torch.frombuffer(bytearray(received), dtype=torch.uint8))
            state = RequestState(data.sampling_params, data.prompt_token_ids, data.eos_token_ids, generator=gen,
                                 matcher=self._matcher(data))
            self.states[data.request_id] = state
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
        return matcher

    # -- inputs ---------------------------------------------------------------
    def _prepare(self, sched: SchedulerOutput) -> StepInputs:
        # Multi-token chunks first, then single-token ones (AttentionMetadata).
        order = sorted(sched.num_scheduled_tokens, key=lambda rid: sched.num_scheduled_tokens[rid] == 1)
        batch, bs = self.batch, self.block_size
        rows = np.fromiter((batch.index[rid] for rid in order), dtype=np.int64, count=len(order))
        lens = np.fromiter((sched.num_scheduled_tokens[rid] for rid in order), dtype=np.int64, count=len(order))
        num_prefills = int((lens > 1).sum())
        query_start_loc = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(lens, out=query_start_loc[1:])
        starts = batch.num_computed_tokens[rows]
        seq_lens = starts + lens
        # positions: for request i, starts[i] .. starts[i] + lens[i] - 1
        positions = np.repeat(starts - query_start_loc[:-1], lens) + np.arange(query_start_loc[-1])
        req_of_token = np.repeat(np.arange(len(order)), lens)  # [num_tokens]
        input_ids = batch.token_ids[rows[req_of_token], positions]
        max_blocks = int(-(-seq_lens.max() // bs))
        block_tables = batch.block_table[rows, :max_blocks]  # [num_reqs, max_blocks], one gather
        # slot = block_tables[req, pos // bs] * bs + pos % bs   for every new token
        slots = block_tables[req_of_token, positions // bs] * bs + positions % bs
        # A request samples when its tokens reach the end of the known ones
        # (a non-final prefill chunk does not); with k drafts it samples at
        # its last 1 + k positions.
        num_drafts = np.fromiter((len(sched.spec_token_ids.get(rid, ())) for rid in order), dtype=np.int64, count=len(order))
        samples = seq_lens - num_drafts >= batch.num_tokens[rows]
        logits_indices = [
            np.arange(end - 1 - k, end)
            for end, k, s in zip(query_start_loc[1:], num_drafts, samples)
            if s
        ]
        meta = AttentionMetadata(
            query_start_loc=query_start_loc.tolist(),
            seq_lens=seq_lens.tolist(),
            slot_mapping=self._to_device(slots),
            block_tables=self._to_device(block_tables),
            block_size=bs,
            num_prefills=num_prefills,
        )
        meta.prepare()
        return StepInputs(
            input_ids=self._to_device(input_ids),
            positions=self._to_device(positions),
            meta=meta,
            logits_indices=self._to_device(np.concatenate(logits_indices) if logits_indices else np.zeros(0, np.int64)),
            sampling=[(rid, sched.spec_token_ids.get(rid, [])) for rid, s in zip(order, samples) if s],
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

    # -- step -----------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self._update_states(sched)
        if sched.kv_orders:
            self.connector.execute(sched.kv_orders)
        step_transfer = self.kv_transfer.begin_step(sched.kv_orders) if self.kv_transfer else None
        out = RunnerOutput()
        if not sched.is_empty:
            inputs = self._prepare(sched)
            inputs.meta.kv_transfer = step_transfer
            # Started before the forward pass so the two overlap; joined before sampling.
            pending_bitmask = self._start_bitmask(inputs.sampling)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
            if inputs.sampling:
                logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [num_logits, vocab] fp32
                self._sample(logits, inputs.sampling, out, pending_bitmask)
            if step_transfer is not None:
                step_transfer.finish(out.sampled_token_ids, {rid: s.generator for rid, s in self.states.items()})
        finished = self.connector.take_finished()
        out.finished_loading = finished.finished_loading
        out.finished_saving = finished.finished_saving
        out.finished_sending = finished.finished_sending
        if self.kv_transfer is not None:
            self._take_transfers(out, idle=sched.is_empty)
        return out

    def _take_transfers(self, out: RunnerOutput, idle: bool) -> None:
        """Disaggregation completions into the step's result. An idle step
        (only transfers outstanding) first waits a little for one, rather
        than let the step loop spin."""
        if idle:
            self.kv_transfer.wait(0.005)
        received, failed, failed_received, sent = self.kv_transfer.take()
        for rid, r in received.items():
            out.finished_loading.append(rid)
            out.kv_received[rid] = r.output_token_ids
        out.failed_loading.update(failed)
        for rid, r in failed_received.items():
            out.kv_received[rid] = r.output_token_ids
        out.finished_sending.extend(sent)

    # -- sampling and verification --------------------------------------------
    def _start_bitmask(self, sampling: list[tuple[str, list[int]]]) -> "Future[StepBitmask] | None":
        rows, first_logit = [], 0
        for rid, drafts in sampling:
            matcher = self.states[rid].matcher
            if matcher is not None:
                rows.append(GrammarRow(first_logit, matcher, drafts))
            first_logit += len(drafts) + 1
        return self.grammars.start_fill(rows) if rows else None

    def _sample(self, logits: torch.Tensor, sampling: list[tuple[str, list[int]]], out: RunnerOutput,
                pending_bitmask: "Future[StepBitmask] | None" = None) -> None:
        """Sample the target at every position and accept drafts while they
        equal the sample: exact for drafts without a distribution (the
        accepted tokens are each a sample of the target given the ones
        before), and greedy verification at temperature 0."""
        rows: list[SamplingRow] = []
        for rid, drafts in sampling:
            state = self.states[rid]
            for k in range(len(drafts) + 1):
                rows.append(
                    SamplingRow(
                        params=state.params,
                        prompt_token_ids=state.prompt_token_ids,
                        output_token_ids=state.output_token_ids,
                        generator=state.generator,
                        eos_token_ids=state.eos_token_ids,
                        num_output_tokens=len(state.output_token_ids) + k,
                    )
                )
        counts, prompt_mask = self._penalty_state(sampling)
        # [num_logits, 8]: each request's persistent knob row, once per position
        knob_rows = np.fromiter((self.batch.index[rid] for rid, _ in sampling), dtype=np.int64, count=len(sampling))
        reps = np.fromiter((len(d) + 1 for _, d in sampling), dtype=np.int64, count=len(sampling))
        knobs = np.repeat(self.batch.sampling_knobs[knob_rows], reps, axis=0)
        batch = SamplingBatch.build(rows, self.vocab_size, self.device, counts, prompt_mask, knobs)
        if pending_bitmask is not None:
            step_bitmask = pending_bitmask.result()
            batch.grammar_rows, batch.grammar_bitmask = step_bitmask.rows, step_bitmask.bitmask
        result = self.sampler(logits, batch)
        i = 0
        for rid, drafts in sampling:
            accepted = _accept(drafts, result.token_ids[i : i + len(drafts) + 1])
            lps = result.logprobs[i : i + len(accepted)]
            i += len(drafts) + 1
            self._record(rid, accepted)
            out.sampled_token_ids[rid] = accepted
            if lps and lps[0] is not None:
                out.logprobs[rid] = [lp for lp in lps if lp is not None]

    def _penalty_state(self, sampling: list[tuple[str, list[int]]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """[num_logits, V] output counts and prompt masks from each request's
        running state; a draft position k also counts the k drafts before it
        (they are the output there if accepted)."""
        states = [self.states[rid] for rid, _ in sampling]
        if not any(s.penalizes for s in states):
            return None, None
        zeros_counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
        zeros_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        counts, masks, draft_rows, draft_ids = [], [], [], []
        for (rid, drafts), state in zip(sampling, states):
            for k in range(len(drafts) + 1):
                row = len(counts)
                counts.append(state.output_counts if state.penalizes else zeros_counts)
                masks.append(state.prompt_mask if state.penalizes else zeros_mask)
                draft_rows.extend([row] * k)
                draft_ids.extend(drafts[:k])
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
        if state.output_counts is not None:
            ids = torch.tensor(accepted, device=self.device)
            state.output_counts.index_add_(0, ids, torch.ones(len(accepted), device=self.device))


def _accept(drafts: list[int], samples: list[int]) -> list[int]:
    """Tokens accepted by verification: the drafts up to the first one that
    differs from the target's sample there, then that sample (or, when every
    draft matched, the sample after the last draft)."""
    for k, draft in enumerate(drafts):
        if samples[k] != draft:
            return samples[: k + 1]
    return samples[: len(drafts) + 1]


def _transfer_agent(kv_cache: torch.Tensor, config: KVTransferConfig) -> KVTransferAgent:
    """The agent over the pool it will serve: moved into shared memory on
    CPU (a prefill core on this host writes there); as is on a GPU."""
    pool = None
    if kv_cache.device.type == "cpu":
        pool = SharedKVPool.create(tuple(kv_cache.shape), kv_cache.dtype)
        kv_cache = pool.tensor
    return KVTransferAgent(kv_cache, config, pool)
