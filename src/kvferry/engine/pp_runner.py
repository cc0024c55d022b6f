"""A pipeline stage's runner: the step's batch as micro-batches through this
stage's layers (pp_stages.py has the processes; docs/architecture.md the picture).

Every stage keeps the same persistent batch (the scheduler's deltas reach all
of them), so each builds the same flattened step and cuts it into the same
micro-batches: contiguous runs of requests, balanced by tokens. A micro-batch
is a step of its own for attention (its requests' block tables, slots and
lengths), so the stages need nothing but the residual stream between them:

    stage 0:   embed + layers of mb 0 ─▶ send │ mb 1 ─▶ send │ ...            │ wait for the output
    stage 1:            recv mb 0, layers ─▶ send │ recv mb 1 ... ─▶ send     │
    last:                        recv mb 0, layers │ ... mb M-1 │ norm, lm_head, sample ─▶ rank 0

While stage s runs micro-batch k + 1, stage s + 1 runs k. Only the residual
``h`` travels: the next stage's first ``input_layernorm(h)`` gives the same
bits as the fused add-and-norm the stage before would have made.

The last stage samples (it holds the lm_head, and with it the sampler's
state: penalties, grammars, seeded positions), as ModelRunner does; its
``RunnerOutput`` goes back to rank 0, which appends the tokens to its batch
(its next step embeds them) and forwards them to the middle stages with the
next step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import zmq

from kvferry.core.outputs import RunnerOutput, SchedulerOutput
from kvferry.engine.kv_connector.base import KVConnectorWorker
from kvferry.engine.kv_connector.connectors import WorkerContext
from kvferry.engine.runner import ModelRunner, StepInputs
from kvferry.engine.speculation import draft_requests, drafts_alone, share_drafts
from kvferry.model.input_batch import FlatStep
from kvferry.model.llama import allocate_kv_cache
from kvferry.parallel.pipeline import pp_layer_range, recv_tensor, send_tensor
from kvferry.spec import runs_head
from kvferry.spec.draft_model import DraftModelProposer, DraftRequest, Proposal
from kvferry.spec.eagle3 import aux_layers_of, is_eagle3_checkpoint
from kvferry.spec.head import HeadProposer
from kvferry.spec.reserved import PLACEHOLDER_ID

# How long a stage waits for the stage before in one look; between looks it
# checks that its group is whole (``StageLink.alive`` raises otherwise).
_POLL_MS = 200
# Without --pp-micro-batches a step is cut into up to one micro-batch a stage,
# each of at least this many tokens. Every micro-batch reads the stage's
# weights again: a decode step of a few rows is bound by that read, so two
# half-batches cost about two whole ones and the overlap does not pay it back
# (bench/pp_decode.py at c16: 2 micro-batches 0.54-0.59x one's tok/s, 4 about
# 0.4x); a prompt chunk is bound by its arithmetic, which halves with its rows
# (the 512-token prompts' step: 2 micro-batches 1.65x one).
MIN_MICRO_BATCH_TOKENS = 64


@dataclass(slots=True)
class StageLink:
    """A stage's sockets: activations from the stage before (None on the
    first) and to the stage after (None on the last)."""

    prev: zmq.Socket | None
    next: zmq.Socket | None
    alive: Callable[[], None]  # raises once the stage group has failed


def micro_batches(query_start_loc: np.ndarray, count: int) -> list[tuple[int, int]]:
    """Request ranges [r0, r1) of up to ``count`` micro-batches, in order: the
    k-th ends at the first request whose end reaches k equal shares of the
    tokens (a long prompt chunk is one request and stays whole), and each
    keeps at least one request."""
    num_reqs = len(query_start_loc) - 1
    count = max(1, min(count, num_reqs))
    total = int(query_start_loc[-1])
    bounds, start = [], 0
    for k in range(1, count):
        end = int(np.searchsorted(query_start_loc, total * k / count, side="left"))
        end = min(max(end, start + 1), num_reqs - (count - k))  # room for the micro-batches after it
        bounds.append((start, end))
        start = end
    bounds.append((start, num_reqs))
    return bounds


def slice_flat(flat: FlatStep, r0: int, r1: int) -> FlatStep:
    """Requests [r0, r1) of a flattened step as a step of their own (draft trees' masks with them)."""
    qsl = flat.query_start_loc
    t0, t1 = int(qsl[r0]), int(qsl[r1])
    trees = {i - r0: mask for i, mask in (flat.tree_masks or {}).items() if r0 <= i < r1}
    return FlatStep(flat.input_ids[t0:t1], flat.positions[t0:t1], flat.slots[t0:t1], qsl[r0:r1 + 1] - t0,
                    flat.seq_lens[r0:r1], flat.block_tables[r0:r1], max(0, min(flat.num_prefills, r1) - r0),
                    trees or None)


@dataclass(frozen=True, slots=True)
class AuxColumns:
    """An EAGLE-3 head over stages: the model layers whose entering streams it
    fuses (``layers``, a column of H each in the last stage's
    ``LlamaModel.aux_hidden``), the columns this stage computes (``own``)
    and those the stages before send it (``incoming``: one tensor from each
    earlier stage that computes any, its columns side by side). A stage
    sends on what it received as it came, then its own columns (the model's
    buffer, which holds those alone), one more message each; the last stage
    joins them into the step's [T, 3H]. Every row of the step travels: the
    head keeps each position whose next token is final, which only the last
    stage's sampling decides."""

    layers: tuple[int, ...]
    incoming: tuple[tuple[int, ...], ...]
    own: tuple[int, ...]

    @staticmethod
    def of(config, num_layers: int, stage) -> AuxColumns | None:  # noqa: ANN001 - EngineConfig, PPStage
        """This stage's columns, or None when no EAGLE-3 head drafts."""
        spec = config.speculative
        if not runs_head(spec) or spec.model is None or not is_eagle3_checkpoint(Path(spec.model)):
            return None
        layers = aux_layers_of(spec.model, num_layers)

        def owned(rank: int) -> tuple[int, ...]:
            start, end = pp_layer_range(num_layers, rank, stage.size)
            return tuple(j for j, layer in enumerate(layers) if start <= layer < end)

        return AuxColumns(layers, tuple(c for c in map(owned, range(stage.rank)) if c), owned(stage.rank))

    def model_layers(self, last: bool) -> tuple[int, ...]:
        """What the stage's model copies into its ``aux_hidden``: its own
        columns alone, or on the last stage every column's place (the
        others' filled from ``incoming``)."""
        if not self.own:
            return ()
        return self.layers if last else tuple(self.layers[j] for j in self.own)

    def whole_rows(self, own: torch.Tensor | None, incoming: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """The last stage's [T, 3H]: its own buffer with the received columns copied in."""
        rows = own if self.own else h.new_empty(h.shape[0], len(self.layers) * h.shape[1])
        width = h.shape[1]
        for cols, part in zip(self.incoming, incoming):
            for i, j in enumerate(cols):
                rows[:, j * width:(j + 1) * width].copy_(part[:, i * width:(i + 1) * width])
        return rows


def _draft_pool(connector: KVConnectorWorker) -> torch.Tensor | None:
    """The draft model's pool a KV transfer's worker half moved into shared memory, if any."""
    for worker in [connector, *getattr(connector, "workers", [])]:
        if getattr(worker, "draft_kv_cache", None) is not None:
            return worker.draft_kv_cache
    return None


class StageRunner(ModelRunner):
    """ModelRunner over this stage's layers and their KV cache; the stage comes
    with the model (``loaded.model.stage``). ``link`` (set before the first
    step): its sockets; ``micro_batches``: how many a step is cut into (None:
    by its size, ``micro_batch_count``)."""

    def __init__(self, loaded, config, num_blocks: int, max_model_len: int, connector=None,  # noqa: ANN001
                 kv_pool: str = "", **kwargs) -> None:  # noqa: ANN003
        """``connector``: this stage's (``for_engine``; stage 0's is the
        core's), or None: it makes a worker half per stage over its own
        layers' pool (a KV transfer's is a ``StageTransferWorker``); a later
        stage maps its pool in the segment stage 0 named, ``kv_pool``
        (stage_transfer.py, stage_pools.py)."""
        draft = kwargs.get("draft")
        # Method "draft" beside a KV transfer: stage 0 (the core) creates the draft model's pool in
        # shared memory (its receiver writes a received prompt's draft layers there; the last stage
        # drafts in it): a tensor of its shape, never touched (an anonymous mapping), names it.
        draft_shape = (allocate_kv_cache(draft.config, num_blocks, config.cache.block_size, draft.dtype,
                                          config.model.device)
                       if draft is not None and loaded.model.stage.first and connector is not None else None)
        if not loaded.model.stage.last:  # a draft head or a draft model drafts on the last stage (``_draft_ahead``)
            kwargs["head"] = kwargs["draft"] = None
        super().__init__(loaded, config, num_blocks, max_model_len, **kwargs)
        model = self.model
        self.stage = model.stage
        # An EAGLE-3 head (drafting on the last stage) fuses the streams entering three
        # layers, which may be on any stage: each stage sends those it has on beside its
        # activations (``AuxColumns``); a stage that owns none of them copies nothing.
        # The last stage's ranks but the drafting one (TP rank 0) take the columns and keep none.
        self.aux = AuxColumns.of(config, loaded.config.num_hidden_layers, self.stage)
        self._keeps_aux = self.aux is not None and (not self.stage.last or self.drafter is not None)
        model.aux_layers = self.aux.model_layers(self.stage.last) if self._keeps_aux else ()
        # Its own layers' KV alone (the pool is an anonymous mapping: the whole
        # model's that the base class mapped was never touched, so cost nothing).
        self.kv_cache = allocate_kv_cache(loaded.config, num_blocks, self.block_size, self.kv_cache.dtype,
                                          self.device, model.num_kv_heads, num_layers=len(model.layers))
        self.connector: KVConnectorWorker | None = None
        if connector is not None:  # a worker half per stage, over its own layers' pool
            # ``speculative``: the core's signature (stage 0's, which sends and checks each Done).
            draft_kv = self.drafter.kv_cache if isinstance(self.drafter, DraftModelProposer) else draft_shape
            self.connector = connector.worker_half(WorkerContext(
                self.kv_cache, self.block_size, draft_kv, speculative=kwargs.get("speculative", ""),
                shard=getattr(model, "shard", None), stage=self.stage,
                num_layers=loaded.config.num_hidden_layers, stage_pool=kv_pool))
            # In shared memory with a KV transfer (stage 0's receiver fills every stage's) or the
            # node store (stage 0 saves and loads every stage's layers): stage_transfer.py, stage_pools.py.
            self.kv_cache = self.connector.kv_cache
            shared = _draft_pool(self.connector)
            if shared is not None and isinstance(self.drafter, DraftModelProposer):
                self.drafter.kv_cache = shared  # a received prompt's draft KV lands there
        # Stage 0 of a decode core with a draft model: the requests whose prompt's draft KV came
        # with the target's, for the last stage with the next step (its draft starts past the prompt).
        self._draft_kv_out: set[str] | None = (set() if self.stage.first and draft is not None
                                               and not self.stage.last else None)
        self.samples = self.stage.last
        self.micro_batches = config.parallel.pp_micro_batches
        self.link: StageLink | None = None
        self.steps_run = 0
        # This step's micro-batches on this stage: (k, start, end), monotonic
        # seconds (one clock for every process of the host): the overlap, seen.
        self.timeline: list[tuple[int, float, float]] = []
        # A draft head (the last stage): the drafts it made for each request's
        # next step, kept for their distributions until that step verifies them.
        self._ahead: dict[str, Proposal] = {}
        self._ahead_requests: dict[str, DraftRequest] = {}  # a draft model's, as it ran them
        # Rank 0: the last stage's drafts of the step before, for the slots its scheduler reserves.
        self._drafts_in: tuple[dict[str, list[int]], dict[str, list[int]]] = ({}, {})
        spec = config.speculative
        self._num_drafts = spec.num_speculative_tokens if spec is not None else 0
        # The last stage of a prefill core with a draft head: the hidden state each
        # transfer that ended this step ships (its report carries them to stage 0).
        self.transfer_hidden: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        leader = self.tp_leader  # rank 0's PPLeader (None on the other stages)
        if leader is not None:
            sched = self._with_drafts(sched)
            received, self._draft_kv_out = self._draft_kv_out, None if self._draft_kv_out is None else set()
            leader.publish(sched, self.head_requests, received)
        self.steps_run += 1
        if self.connector is not None:
            self.connector.step = None  # begin_step's, if this step streams KV
        if self.stage.last:  # the whole step: this stage's forward (below), then logits and sampling
            out = super().execute(sched)
            self.transfer_hidden = self._hidden_to_ship()
            if self.drafter is not None and not sched.is_empty:
                self._draft_ahead(out, sched, self._sampled_in_step(sched, out))
            step = getattr(self.connector, "step", None)
            if step is not None:
                step.release()  # this rank's end of the step's transfers, after the draft's layers
            return out
        self._update_states(sched)
        if sched.kv_orders and self.connector is not None:
            self.connector.execute(sched.kv_orders)
            self.connector.step = self.connector.begin_step(sched.kv_orders)
        out = RunnerOutput()
        if not sched.is_empty:
            inputs = self._prepare(sched, sched.spec_token_ids, graph_ok=False, trees=sched.spec_tree_parents)
            self._forward(inputs)
            self._keep_trees(inputs)  # compacted once the last stage's tokens say which branch held
            if leader is not None:
                out = leader.receive_output(self.steps_run, self.timeline)
                self._drafts_in = (out.draft_token_ids, out.draft_tree_parents)
                self.apply_sampled(out.sampled_token_ids)  # the next step embeds them
            if self.connector is not None and self.connector.step is not None:
                # Stage 0: the Done with the last stage's tokens (and its head's hidden
                # states, for the decode core's first drafts); a later stage: its part ends
                self.connector.step.finish(out.sampled_token_ids, {},
                                           leader.transfer_hidden if leader is not None else None)
        if self.connector is not None and leader is not None:
            self._take_completions(out, idle=sched.is_empty)
        return out

    def _install_draft_state(self, rid: str, received) -> None:  # noqa: ANN001 - a Received
        """Stage 0 with a draft model (on the last stage): the note that the
        prompt's draft KV is in place travels to it with the next step."""
        if self._draft_kv_out is not None:
            self._draft_kv_out.add(rid)
        else:
            super()._install_draft_state(rid, received)

    def _hidden_to_ship(self) -> dict[str, torch.Tensor]:
        """The last stage: the draft head's hidden state of each request whose
        prompt transfer ended this step, which only this stage has; stage 0
        sends the Done, so the states go to it with the step's output. Each
        is a copy: a view would pickle its step's whole hidden tensor."""
        step = getattr(self.connector, "step", None)
        if step is None or not isinstance(self.drafter, HeadProposer):
            return {}
        return {o.request_id: h.detach().clone().cpu() for o in step.orders
                if o.last and (h := self.drafter.hidden_state(o.request_id)) is not None}

    # -- a draft head over stages ------------------------------------------------
    # The head reads the final hidden states, which only the last stage has,
    # and stage 0 embeds the drafts: so the last stage drafts each request's
    # next step right after sampling it (k drafts, before the scheduler has
    # chosen that step's k), and the drafts ride to rank 0 with the tokens.
    # Rank 0 writes them into the slots its scheduler reserved (a prefix
    # where it reserved fewer) and every stage gets them with the step, as
    # the scheduler's own drafts. Sampling's state stays on the last stage,
    # which verifies: a draft's distribution q never travels. Under method
    # auto (``head_requests``: rank 0's scheduler names the requests it gave
    # the head this step, and every stage gets them with the step) only those
    # requests' slots take the head's drafts; the others keep the scheduler's
    # suffix or n-gram drafts, verified as such. The last stage still drafts
    # ahead for every request: auto chooses the next step's method after it.
    def _sampled_in_step(self, sched: SchedulerOutput, out: RunnerOutput) -> dict[str, list[int]]:
        """This step's sampled tokens. With -tp the last stage's ranks draft
        together (the head's lookups and logits are their collectives) before
        its TP rank 0's tokens would reach the others with the next step, so
        they come now, in one float32 sum (TP rank 0 fills [count, tokens..]
        per scheduled request, the others add zeros), and the others take
        them as they would then (``apply_sampled``; pp_worker skips it)."""
        if getattr(getattr(self.model, "shard", None), "size", 1) == 1 or drafts_alone(self.drafter):
            return out.sampled_token_ids  # a draft model drafts on the sampling rank alone: its own tokens
        sizes = [len(sched.spec_token_ids.get(rid, ())) + 2 for rid in sched.num_scheduled_tokens]
        values = [0.0] * sum(sizes)
        start = 0
        for rid, size in zip(sched.num_scheduled_tokens, sizes):
            if self.samples:
                tokens = out.sampled_token_ids.get(rid, [])
                values[start : start + 1 + len(tokens)] = [float(len(tokens)), *map(float, tokens)]
            start += size
        summed = self.model.shard.all_reduce(torch.tensor(values, dtype=torch.float32)).tolist()
        sampled, start = {}, 0
        for rid, size in zip(sched.num_scheduled_tokens, sizes):
            if int(summed[start]):
                sampled[rid] = [int(v) for v in summed[start + 1 : start + 1 + int(summed[start])]]
            start += size
        if not self.samples:
            self.apply_sampled(sampled)
        return sampled

    def _draft_ahead(self, out: RunnerOutput, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """The last stage: each request that sampled drafts its next step now
        (``out`` takes the drafts; ``sampled``: the step's tokens, on every TP rank).
        A draft model's KV follows every token: a prompt chunk that sampled
        nothing goes through it too, drafting none (as ``draft_requests`` has it)."""
        requests = []
        follows = isinstance(self.drafter, DraftModelProposer)
        for request in draft_requests(self.batch, sched, self.states) if follows else []:
            if not sampled.get(request.request_id):
                requests.append(replace(request, num_drafts=0))
        for rid, tokens in sampled.items():
            state, row = self.states.get(rid), self.batch.index.get(rid)
            if not tokens or state is None or row is None:
                continue
            left = state.params.max_tokens
            k = self._num_drafts if left is None else min(self._num_drafts, left - len(state.output_token_ids) - 1)
            if k <= 0 and not follows:
                continue
            k = max(k, 0)
            self.batch.write_drafts(row, [PLACEHOLDER_ID] * k)  # room in its row, which the drafter writes over
            requests.append(DraftRequest(rid, row, int(self.batch.num_tokens[row]), k, state.params,
                                         len(state.output_token_ids), len(state.prompt_token_ids)))
        self._ahead = self.drafter.propose(self.batch, requests) if requests else {}
        if follows:  # its KV is valid through what the next step accepts (``_draft``: advance)
            self._ahead_requests = {r.request_id: r for r in requests}
            out.num_draft_prompt_tokens = self.drafter.take_prompt_tokens_computed()
            step = getattr(self.connector, "step", None)
            if step is not None:  # a prefill core: the draft's KV of the step's prompt blocks goes too
                step.draft_done()
        elif not drafts_alone(self.drafter):  # an EAGLE-3 head drafts on TP rank 0 alone
            share_drafts(self.model, self.batch, requests, self._ahead, self.samples)  # -tp: TP rank 0's hold
        out.draft_token_ids = {rid: p.token_ids for rid, p in self._ahead.items()}
        out.draft_tree_parents = {rid: p.parents for rid, p in self._ahead.items() if p.parents is not None}

    def _with_drafts(self, sched: SchedulerOutput) -> SchedulerOutput:
        """Rank 0: the last stage's drafts in the slots the scheduler reserved
        (a tree's first nodes, each prefix a tree; one shorter than its slots
        leaves the placeholders, which are verified and rejected)."""
        (drafts, parents), self._drafts_in = self._drafts_in, ({}, {})
        if not drafts or not sched.spec_token_ids:
            return sched
        spec, trees = dict(sched.spec_token_ids), dict(sched.spec_tree_parents)
        for rid, reserved in sched.spec_token_ids.items():
            if self.head_requests is not None and rid not in self.head_requests:
                continue  # method auto gave it suffix or n-gram drafts: the scheduler's, as they are
            made, k = drafts.get(rid), len(reserved)
            if not made or (rid in parents and len(made) < k):
                continue
            spec[rid] = made[:k] + reserved[len(made):]
            if rid in parents:
                trees[rid] = parents[rid][:k]
        return replace(sched, spec_token_ids=spec, spec_tree_parents=trees)

    def _draft(self, sched: SchedulerOutput, out: RunnerOutput,
               step_transfer: object) -> tuple[dict[str, list[int]], dict[str, Proposal], list]:
        """The last stage: the step's drafts are its own of the step before,
        come back through rank 0; their distributions (a path's q) where the
        drafts are what it made (a prefix of them)."""
        if self.drafter is None:
            return super()._draft(sched, out, step_transfer)
        ahead, self._ahead = self._ahead, {}
        # A draft model: every request it ran ahead for, so that its KV position
        # moves past what this step accepts (ModelRunner.execute: ``advance``).
        drafted, self._ahead_requests = [r for rid, r in self._ahead_requests.items()
                                         if rid in sched.num_scheduled_tokens], {}
        proposals = {}
        for rid, drafts in sched.spec_token_ids.items():
            made = ahead.get(rid)
            if self.head_requests is not None and rid not in self.head_requests:
                continue  # method auto's suffix or n-gram drafts: no distribution of the head's
            if made is not None and made.parents is None and made.token_ids[:len(drafts)] == drafts:
                proposals[rid] = Proposal(drafts, None if made.probs is None else made.probs[:len(drafts)])
        return sched.spec_token_ids, proposals, drafted

    def micro_batch_count(self, num_tokens: int) -> int:
        """How many micro-batches a step of ``num_tokens`` goes in (the same on every stage)."""
        if self.micro_batches is not None:
            return self.micro_batches
        return max(1, min(self.stage.size, num_tokens // MIN_MICRO_BATCH_TOKENS))

    def _eager_inputs(self, inputs: StepInputs) -> None:
        """Each micro-batch builds its own metadata (``_forward``)."""

    def _forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Every micro-batch through this stage's layers; the last stage
        returns the final norm's [num_tokens, hidden], the others send."""
        flat, link, outs, aux_rows = inputs.flat, self.link, [], []
        aux = self.aux
        ranges = micro_batches(flat.query_start_loc, self.micro_batch_count(len(flat.input_ids)))
        self.timeline = []
        for k, (r0, r1) in enumerate(ranges):
            part = slice_flat(flat, r0, r1)
            meta = part.metadata(self.block_size, self.device, self.kv_cache.dtype, self.triton)
            if k == len(ranges) - 1 and self.connector is not None:
                # The last micro-batch: once it wrote layer i, every request's KV of it is there
                meta.kv_transfer = self.connector.step
            tag = (self.steps_run, k)
            residual = None if link.prev is None else recv_tensor(link.prev, tag, _POLL_MS, link.alive)
            # The EAGLE-3 streams the stages before computed: a tensor from each that computes some
            aux_in = [recv_tensor(link.prev, tag, _POLL_MS, link.alive) for _ in (aux.incoming if aux else ())]
            start = time.monotonic()
            h = self.model(self._to_device(part.input_ids), self._to_device(part.positions), self.kv_cache, meta,
                           residual=residual)
            if link.next is not None:
                send_tensor(link.next, tag, h)
                for columns in [*aux_in, self.model.aux_hidden] if aux is not None and aux.own else aux_in:
                    send_tensor(link.next, tag, columns)  # as they came, then this stage's own
            else:
                outs.append(h)
                if self._keeps_aux:
                    aux_rows.append(aux.whole_rows(self.model.aux_hidden, aux_in, h))
            self.timeline.append((k, start, time.monotonic()))
        if aux is not None:  # the last stage: the step's [T, 3H] rows, as the head reads them (record_aux)
            self.model.aux_hidden = (None if not aux_rows else aux_rows[0] if len(aux_rows) == 1
                                     else torch.cat(aux_rows))
        if not outs:
            return None
        return outs[0] if len(outs) == 1 else torch.cat(outs)
