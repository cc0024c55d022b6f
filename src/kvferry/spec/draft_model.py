"""Method "draft": a small model with the target's tokenizer proposes k
tokens per step, with the distribution each was drawn from (for exact
rejection sampling, ``kvferry.spec.rejection``).

The draft keeps its own paged KV: its own cache tensor, indexed by the
target's block tables (same block ids, same slots), so it needs no block
bookkeeping of its own. Each step, inside the runner, before the target's
forward pass::

    pass 0        every scheduled request: the draft computes its tokens
                  from where its KV is valid up to ``end`` (the target's
                  new real tokens, plus any accepted draft the draft has not
                  computed yet), and, for a request with k drafts, gives q_1
                  at the last one; x_1 ~ q_1
    pass i (<k)   x_i at position end - 1 + i   -> q_{i+1}; x_{i+1} ~ q_{i+1}

    sequence   | ........ real tokens ........ | x_1 | x_2 | .. | x_k |
                 0                          end-1  end              end+k-1
    draft KV     valid up to ``num_computed``, written up to end + k - 2

The scheduler reserved slots for the target's 1 + k tokens from end - 1,
so every draft write lands in an allocated block. After verification with
a drafts accepted the draft's KV is valid up to end + min(a, k - 1) (x_k
was drawn, never fed); the next pass 0 catches up from there.

A request (re)admitted (new, after preemption, swap-in, or a prefix-cache
hit) starts over at position 0: blocks that arrive from elsewhere carry the
target's KV, not necessarily the draft's. Recomputing costs a draft prefill;
stale draft KV would only cost acceptance, never correctness. The exception
is a disaggregated decode core: the prefill core's draft computed the prompt
and its KV came with the target's (``add(..., num_computed_tokens)``), so
the draft here starts at the first token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvferry.model.input_batch import InputBatch, flatten
from kvferry.model.fused_ops import argmax_rows
from kvferry.model.llama import allocate_kv_cache
from kvferry.model.loader import LoadedModel
from kvferry.model.sampler import exponential_, position_generator
from kvferry.sampling import SamplingParams



@dataclass(slots=True)
class DraftRequest:
    """One scheduled request, as the draft sees it this step."""

    request_id: str
    row: int  # its InputBatch row
    end: int  # one past the last real token the target computes this step
    num_drafts: int  # k (0: only keep the draft's KV in step)
    params: SamplingParams
    # Output index the first draft would take (the target's sampler keys a
    # seeded request's noise by it: ``position_generator``).
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0  # (counts the draft's prompt work)


@dataclass(slots=True)
class DraftVocab:
    """A draft vocabulary (FR-Spec): the draft scores only these ids, the
    most frequent in the text it learned from, so a drafting step's LM head
    reads D rows of the embedding matrix instead of V."""

    ids: torch.Tensor  # [D] int64, sorted
    size: int  # V, the target's vocabulary size


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]  # the k drafts
    # [k, V] float32 distributions the drafts were drawn from; None when the
    # drafts are deterministic (greedy requests: argmax of the draft).
    probs: torch.Tensor | None
    # A draft tree's parents (``spec.tree``; a head's tree, spec/head_tree.py); None: a chain.
    parents: list[int] | None = None


class DraftModelProposer:
    # Its KV must follow every scheduled token, drafting or not: the runner
    # calls ``propose`` every step.
    every_step = True

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, target_vocab_size: int) -> None:
        if loaded.config.vocab_size != target_vocab_size:
            raise ValueError(f"speculative.model has a vocabulary of {loaded.config.vocab_size} tokens; "
                             f"the target's has {target_vocab_size} (they must share the tokenizer)")
        self.model = loaded.model
        self.device = next(loaded.model.parameters()).device
        self.block_size = block_size
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] of the draft's shapes
        self.kv_cache = allocate_kv_cache(loaded.config, num_blocks, block_size, loaded.dtype, self.device)
        self.num_computed: dict[str, int] = {}  # positions [0, n) hold valid draft KV
        self._prompt_tokens_computed = 0  # since the last take_prompt_tokens_computed

    def add(self, request_id: str, num_computed_tokens: int = 0) -> None:
        """``num_computed_tokens``: leading positions whose draft KV is
        already in the request's blocks (received from a prefill core with
        the target's); 0 starts over."""
        self.num_computed[request_id] = num_computed_tokens

    def take_prompt_tokens_computed(self) -> int:
        """Prompt positions the draft computed since the last call."""
        n, self._prompt_tokens_computed = self._prompt_tokens_computed, 0
        return n

    def remove(self, request_id: str) -> None:
        self.num_computed.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, requests: list[DraftRequest]) -> dict[str, Proposal]:
        """Run the draft over ``requests`` and write each one's drafts into
        its batch row (over the scheduler's placeholders)."""
        if not requests:
            return {}
        logits = self._catch_up(batch, requests)  # [num drafting, V], in requests order
        chain = DraftChain(batch, [r for r in requests if r.num_drafts > 0])
        for i in range(chain.num_steps):
            if i > 0:
                logits = self._feed(batch, chain.active, i)
            chain.draw(logits, i)
        return chain.proposals()

    def advance(self, request: DraftRequest, num_accepted: int) -> None:
        """After verification: the draft's KV is valid through the accepted
        drafts it fed itself (all but the last)."""
        fed = min(num_accepted, request.num_drafts - 1) if request.num_drafts > 0 else 0
        self.num_computed[request.request_id] = request.end + fed

    def _catch_up(self, batch: InputBatch, requests: list[DraftRequest]) -> torch.Tensor:
        """Pass 0 over every scheduled request; the logits at the last token
        of each request that drafts, [num drafting, V]."""
        starts = np.array([min(self.num_computed.get(r.request_id, 0), r.end - 1) for r in requests], np.int64)
        ends = np.array([r.end for r in requests], dtype=np.int64)
        prompts = np.array([r.num_prompt_tokens for r in requests], dtype=np.int64)
        self._prompt_tokens_computed += int(np.maximum(np.minimum(ends, prompts) - starts, 0).sum())
        order = np.argsort(ends - starts == 1, kind="stable")  # multi-token first
        rows = np.array([requests[i].row for i in order], dtype=np.int64)
        flat = flatten(batch, rows, starts[order], (ends - starts)[order], self.block_size)
        hidden = self._forward(flat)  # [num_tokens, hidden]
        last = flat.query_start_loc[1:] - 1  # [num_reqs]: each request's last token
        position_of = {int(i): p for p, i in enumerate(order)}
        picks = [last[position_of[i]] for i, r in enumerate(requests) if r.num_drafts > 0]
        return self.model.compute_logits(hidden[torch.as_tensor(np.array(picks, dtype=np.int64))])

    def _feed(self, batch: InputBatch, active: list[DraftRequest], i: int) -> torch.Tensor:
        """Feed x_i (at position end - 1 + i) for each active request: [A, V]."""
        rows = np.array([r.row for r in active], dtype=np.int64)
        starts = np.array([r.end - 1 + i for r in active], dtype=np.int64)
        flat = flatten(batch, rows, starts, np.ones(len(active), dtype=np.int64), self.block_size)
        return self.model.compute_logits(self._forward(flat))

    def _forward(self, flat) -> torch.Tensor:  # noqa: ANN001 - a FlatStep
        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

        return self.model(dev(flat.input_ids), dev(flat.positions), self.kv_cache,
                          flat.metadata(self.block_size, self.device))


def keeps_distribution(params: SamplingParams) -> bool:
    """Whether a draft for this request is verified against the distribution
    it was drawn from (exact rejection sampling). Greedy drafts are argmaxes;
    a seeded request's drafts are coupled to the target's own noise (see
    ``draw_drafts``) and verified as deterministic guesses."""
    return not params.greedy and params.seed is None


def draw_drafts(logits: torch.Tensor, active: list[DraftRequest], i: int,
                vocab: "DraftVocab | None" = None) -> tuple[list[int], torch.Tensor | None]:
    """Draft i + 1 (0-based ``i``) for each active request from its logits
    [A, V] and, when any samples, the [A, V] distributions they were drawn
    from (greedy rows: argmax, their q row unused). With ``vocab`` (a
    draft vocabulary; logits are then [A, D], a column per id it holds) the drafts
    are drawn among those ids and q is zero elsewhere, still a distribution
    over the whole vocabulary, as rejection sampling needs.

    Unseeded rows race q against fresh noise; their q goes to rejection
    sampling. A seeded row races q against the very noise the target's
    sampler will draw for the output position this draft stands at (same
    generator, same [V] draw). The target then emits its plain sample
    ``argmax p / noise`` there, and the draft is accepted exactly when it
    equals it (the race, as for prompt lookup). So a seeded request's tokens
    are those of plain seeded sampling, whatever k, the drafts, the batch or
    the step timings that steer the adaptive k; the coupled race still
    accepts often where q resembles p."""
    greedy = [r.params.greedy for r in active]
    if all(greedy):
        drawn = argmax_rows(logits)  # [A]
        return (drawn if vocab is None else vocab.ids[drawn]).tolist(), None
    temperature = torch.tensor([1.0 if g else r.params.temperature for g, r in zip(greedy, active)],
                               device=logits.device)
    q = torch.softmax(logits.float() / temperature[:, None], dim=-1)  # [A, D]
    noise = exponential_(torch.empty_like(q))
    full_noise = None  # [V]: a seeded row's draw spans the whole vocabulary, as the sampler's does
    for j, r in enumerate(active):
        # The sampler's generator for the row verifying this draft: output index + i.
        gen = position_generator(r.params.seed, r.num_output_tokens + i, q.device)
        if gen is None:
            continue
        if vocab is None:
            exponential_(noise[j], gen)
        else:
            if full_noise is None:
                full_noise = torch.empty(vocab.size, dtype=q.dtype, device=q.device)
            noise[j] = exponential_(full_noise, gen)[vocab.ids]
    drawn = (q / noise.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)
    drawn = torch.where(torch.tensor(greedy, device=q.device), logits.argmax(dim=-1), drawn)  # [A] in [0, D)
    if vocab is None:
        return drawn.tolist(), q
    full_q = q.new_zeros(q.shape[0], vocab.size)  # [A, V]
    full_q[:, vocab.ids] = q
    return vocab.ids[drawn].tolist(), full_q


class DraftChain:
    """The drafts of one ``propose`` call, drawn a position at a time for
    every request still drafting: each draft goes into its request's batch
    row (over the scheduler's placeholder) and into its proposal, with q
    where the request is verified against it. ``active`` then holds the
    requests that draw another, in the order of the previous call's
    ``logits`` rows; ``kept`` indexes those rows."""

    def __init__(self, batch: InputBatch, drafting: list[DraftRequest]) -> None:
        self.batch = batch
        self.active = list(drafting)
        self.kept: list[int] = list(range(len(drafting)))
        self.num_steps = max((r.num_drafts for r in drafting), default=0)
        self.tokens: dict[str, list[int]] = {r.request_id: [] for r in drafting}
        self.probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in drafting}

    def draw(self, logits: torch.Tensor, i: int, vocab: DraftVocab | None = None) -> list[int]:
        """Draft i + 1 of each active request from its row of ``logits``
        ([A, V], or [A, D] over ``vocab``); returns the drawn ids [A]."""
        drawn, q = draw_drafts(logits, self.active, i, vocab)
        for j, r in enumerate(self.active):
            self.batch.token_ids[r.row, r.end + i] = drawn[j]
            self.tokens[r.request_id].append(drawn[j])
            if q is not None and keeps_distribution(r.params):
                self.probs[r.request_id].append(q[j])
        # Requests with fewer drafts fall out of the next pass: keep the rows that go on.
        self.kept = [j for j, r in enumerate(self.active) if r.num_drafts > i + 1]
        self.active = [self.active[j] for j in self.kept]
        return drawn

    def proposals(self) -> dict[str, Proposal]:
        return {rid: Proposal(ids, torch.stack(self.probs[rid]) if self.probs[rid] else None)
                for rid, ids in self.tokens.items()}
