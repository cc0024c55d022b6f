"""Batched sampling for one engine step: penalties, min_tokens, temperature,
top-k / top-p / min-p, per-request seeds and logprobs.

Order within a step follows vLLM::

    raw logits [B, V] ──▶ logprobs: log_softmax of the model output (rows that ask)
        │
        ▼
    grammar bitmask: ids the request's grammar forbids set to -inf
        ▼
    repetition penalty (prompt + output tokens)
        ▼
    frequency / presence penalties (output tokens only)
        ▼
    min_tokens: stop ids and EOS set to -inf while the output is too short
        ▼
    greedy rows: argmax        other rows: / temperature ─▶ top-k ─▶ top-p ─▶ min-p
                                            ─▶ softmax ─▶ exponential race

Unseeded rows draw by inverse CDF, one uniform a row (``_inverse_cdf``).
Seeded rows, and every row of a speculative verify, sample by an
"exponential race": with q_i ~ Exp(1) drawn independently,
``argmax_i p_i / q_i`` is distributed as Categorical(p), because
``q_i / p_i ~ Exp(p_i)`` and the smallest of independent exponentials is
index ``i`` with probability ``p_i / sum(p)``. The race lets each seeded row
take its noise from its own generator (exactly V draws per step), so a seeded
request gives the same tokens whatever else shares the batch, while the whole
batch still samples in one vectorized argmax.

The host reads the device once per step: the final ``.tolist()``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from kvferry.core.outputs import TokenLogprobs
from kvferry.model.fused_ops import argmax_rows
from kvferry.sampling import SamplingParams
from kvferry.model.rejection import rejection_sample
from kvferry.structured.bitmask import apply_token_bitmask


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one request for this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Made by the engine from ``params.seed`` and the row's output position
    # (the runner's ``position_generator``), so a token's noise does not
    # depend on how many rows a step holds. None when unseeded. It must live
    # on the same device as the logits.
    generator: torch.Generator | None = None
    # The model's EOS ids; masked with ``stop_token_ids`` under min_tokens.
    eos_token_ids: list[int] = field(default_factory=list)
    # Output length as of this row, when it differs from
    # ``len(output_token_ids)`` (a draft position k counts k drafts).
    num_output_tokens: int | None = None

    @property
    def output_len(self) -> int:
        if self.num_output_tokens is not None:
            return self.num_output_tokens
        return len(self.output_token_ids)


@dataclass(slots=True)
class SamplingBatch:
    """Per-step tensors, built once by :meth:`build` and read by the sampler.

    Host-side ``need_*`` flags choose which kernels run, so the sampler never
    reads a tensor back to decide what to do.
    """

    num_rows: int
    vocab_size: int
    # [B] each, on the logits' device.
    temperature: torch.Tensor  # float32; 1.0 on greedy rows so dividing is safe
    top_k: torch.Tensor  # int64; vocab_size where disabled
    top_p: torch.Tensor  # float32; 1.0 where disabled
    min_p: torch.Tensor  # float32; 0.0 where disabled
    repetition_penalty: torch.Tensor  # float32; 1.0 where disabled
    presence_penalty: torch.Tensor  # float32
    frequency_penalty: torch.Tensor  # float32
    greedy: torch.Tensor  # bool
    all_greedy: bool
    any_greedy: bool
    need_temperature: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    need_repetition: bool
    need_freq_presence: bool
    # Built only when some row penalizes. [B, V] float32 / bool.
    output_counts: torch.Tensor | None
    prompt_mask: torch.Tensor | None
    # min_tokens: (rows [M], token ids [M]) to set to -inf this step.
    stop_mask_index: tuple[torch.Tensor, torch.Tensor] | None
    # Seeded rows that sample randomly. Greedy rows never draw, so a greedy
    # request does not advance its generator.
    seeded: list[tuple[int, torch.Generator]]
    any_unseeded_random: bool
    # logprobs: per-row n (None: not asked), the rows that ask, and max n.
    num_logprobs: list[int | None]
    logprob_row_ids: list[int]
    logprob_rows: torch.Tensor | None  # [R] int64
    max_num_logprobs: int
    # Structured outputs: the constrained rows [G] int64 and their token
    # bitmask [G, words] int32 (kvferry.structured.bitmask layout). Set by the
    # runner after build, once the worker thread has filled the mask.
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        rows: list[SamplingRow],
        vocab_size: int,
        device: torch.device | str,
        output_counts: torch.Tensor | None = None,
        prompt_mask: torch.Tensor | None = None,
        knobs: np.ndarray | None = None,
    ) -> "SamplingBatch":
        """State the caller may keep per request instead of having it rebuilt
        from the rows: ``output_counts`` [B, V] float32 and ``prompt_mask``
        [B, V] bool (penalties; else the rows' token lists are scanned), and
        ``knobs`` [B, 8] float32 (each row ``row_knobs(params, V)``)."""
        if not rows:
            raise ValueError("SamplingBatch needs at least one row")
        device = torch.device(device)
        params = [r.params for r in rows]
        if knobs is None:
            knobs = np.array([row_knobs(p, vocab_size) for p in params], dtype=np.float32).reshape(-1, 8)
        # Which kernels run, read off the knobs on the host. Greedy rows hold
        # neutral sampling knobs, so they never switch a kernel on.
        is_greedy = knobs[:, 7] > 0.5
        need_repetition = bool((knobs[:, 4] != 1.0).any())
        need_freq_presence = bool(((knobs[:, 5] != 0.0) | (knobs[:, 6] != 0.0)).any())
        greedy = is_greedy.tolist()
        knobs_t = torch.from_numpy(np.ascontiguousarray(knobs)).to(device)  # [B, 8], one copy
        if not (need_repetition or need_freq_presence):
            output_counts = prompt_mask = None
        elif output_counts is None:
            output_counts = token_counts(
                [r.output_token_ids for r in rows], vocab_size, device
            )
        if not need_repetition:
            prompt_mask = None
        elif prompt_mask is None:
            prompt_mask = token_counts(
                [r.prompt_token_ids for r in rows], vocab_size, device
            ) > 0
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            temperature=knobs_t[:, 0],
            top_k=knobs_t[:, 1].long(),
            top_p=knobs_t[:, 2],
            min_p=knobs_t[:, 3],
            repetition_penalty=knobs_t[:, 4],
            presence_penalty=knobs_t[:, 5],
            frequency_penalty=knobs_t[:, 6],
            greedy=knobs_t[:, 7] > 0.5,
            all_greedy=bool(is_greedy.all()),
            any_greedy=bool(is_greedy.any()),
            need_temperature=bool((knobs[:, 0] != 1.0).any()),
            need_top_k=bool((knobs[:, 1] < vocab_size).any()),
            need_top_p=bool((knobs[:, 2] < 1.0).any()),
            need_min_p=bool((knobs[:, 3] > 0.0).any()),
            need_repetition=need_repetition,
            need_freq_presence=need_freq_presence,
            output_counts=output_counts,
            prompt_mask=prompt_mask,
            stop_mask_index=_stop_mask_index(rows, vocab_size, device),
            seeded=[
                (i, r.generator)
                for i, (r, g) in enumerate(zip(rows, greedy))
                if not g and r.generator is not None
            ],
            any_unseeded_random=any(
                not g and r.generator is None for r, g in zip(rows, greedy)
            ),
            num_logprobs=[p.logprobs for p in params],
            logprob_row_ids=lp_rows,
            logprob_rows=(
                torch.tensor(lp_rows, dtype=torch.int64, device=device) if lp_rows else None
            ),
            max_num_logprobs=max((params[i].logprobs or 0 for i in lp_rows), default=0),
        )


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows that did not ask


def row_knobs(p: SamplingParams, vocab_size: int) -> list[float]:
    """One row of the knob table: temperature, top_k, top_p, min_p,
    repetition / presence / frequency penalty, greedy. Greedy rows get
    neutral sampling knobs so they never switch on a top-k / top-p / min-p
    kernel for the batch."""
    greedy = p.greedy
    top_k = vocab_size if greedy or p.top_k == 0 else min(p.top_k, vocab_size)
    return [
        1.0 if greedy else p.temperature,
        float(top_k),
        1.0 if greedy else p.top_p,
        0.0 if greedy else p.min_p,
        p.repetition_penalty,
        p.presence_penalty,
        p.frequency_penalty,
        1.0 if greedy else 0.0,
    ]


def token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[B, V] float32: how often each token id occurs in each row's list.

    Flattens all rows into one index ``row * V + token`` and adds ones with a
    single ``index_add_``, so there is no Python loop over tokens. Adding
    exact ones keeps the result deterministic even with atomics.
    """
    num_rows = len(token_lists)
    lengths = torch.tensor([len(t) for t in token_lists], device=device)
    flat = torch.tensor(
        list(chain.from_iterable(token_lists)), dtype=torch.int64, device=device
    )  # [sum(lengths)]
    row_of = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    counts.index_add_(0, row_of * vocab_size + flat, torch.ones_like(flat, dtype=torch.float32))
    return counts.view(num_rows, vocab_size)


def _stop_mask_index(
    rows: list[SamplingRow], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) pairs banned by min_tokens this step, or None.

    EOS is banned unless ``ignore_eos`` (then it is not a stop token at all).
    Ids outside the vocabulary are dropped: they can never be sampled anyway.
    """
    pairs: list[tuple[int, int]] = []
    for i, r in enumerate(rows):
        p = r.params
        if r.output_len >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids or [])
        if not p.ignore_eos:
            stop_ids.update(r.eos_token_ids)
        pairs.extend((i, t) for t in stop_ids if 0 <= t < vocab_size)
    if not pairs:
        return None
    index = torch.tensor(pairs, dtype=torch.int64, device=device)  # [M, 2]
    return index[:, 0], index[:, 1]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, then frequency and presence penalties. [B, V] -> [B, V].

    Never mutates ``logits``: the raw tensor is still needed for logprobs.
    Returns ``logits`` itself when no row penalizes.
    """
    if batch.need_repetition:
        assert batch.prompt_mask is not None and batch.output_counts is not None
        seen = batch.prompt_mask | (batch.output_counts > 0)  # [B, V]
        penalty = batch.repetition_penalty[:, None]  # [B, 1]
        # HF/vLLM: shrink positive logits, push negative ones further down.
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    if batch.need_freq_presence:
        assert batch.output_counts is not None
        counts = batch.output_counts  # [B, V]
        logits = (
            logits
            - batch.frequency_penalty[:, None] * counts
            - batch.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
        )
    return logits


def apply_grammar(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Forbidden ids to -inf on the constrained rows (out of place)."""
    if batch.grammar_rows is None or batch.grammar_bitmask is None:
        return logits
    rows = batch.grammar_rows.to(logits.device)
    masked = apply_token_bitmask(logits.index_select(0, rows), batch.grammar_bitmask)  # [G, V]
    return logits.index_copy(0, rows, masked)


def apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Stop ids and EOS to -inf for rows still short of min_tokens (out of place)."""
    if batch.stop_mask_index is None:
        return logits
    return logits.index_put(batch.stop_mask_index, logits.new_tensor(float("-inf")))


def apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask tokens outside each row's top-k, then outside its top-p nucleus.

    One descending sort serves both. Top-p is measured on the top-k
    renormalized distribution (vLLM's order) and keeps the smallest prefix
    whose mass reaches top_p: a token stays if the mass *before* it is below
    top_p, so the most likely token always stays.
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [B, V] each
    if batch.need_top_k:
        position = torch.arange(batch.vocab_size, device=logits.device)  # [V]
        sorted_logits = sorted_logits.masked_fill(
            position[None, :] >= batch.top_k[:, None], float("-inf")
        )
    if batch.need_top_p:
        probs = sorted_logits.softmax(dim=-1)  # [B, V]
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p == 1 keep everything; rounding in the cumsum could
        # otherwise drop their far tail.
        drop = (mass_before >= batch.top_p[:, None]) & (batch.top_p < 1.0)[:, None]
        # The most likely token stays whatever top_p is (mass_before is 0
        # there, and a top_p that rounded to 0 would drop it).
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Zero tokens below ``min_p * max prob`` of their row. The race needs no
    renormalization: argmax(p / q) is unchanged by scaling p."""
    threshold = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return probs.masked_fill(probs < threshold, 0.0)


def exponential_(out: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``out`` with Exp(1) draws in place (one uniform per value) and
    return it: what ``out.exponential_(generator=generator)`` does, faster.

    Drawn as ``-log1p(-u)`` with u ~ U[0, 1): on CPU torch's own
    ``exponential_`` takes a scalar log per value, 15 ms of one core for
    16 x 49152 (a third of a decode step at batch 16), while ``uniform_``
    plus a vectorized ``log1p`` takes 3 ms. Every request that samples (the
    OpenAI default temperature is 1) pays this every step. Draft proposers
    call it too, so a seeded draft races the very noise its verifier draws."""
    return out.uniform_(generator=generator).neg_().log1p_().neg_()


def _inverse_cdf(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of Categorical(probs), [B, V] (rows need not sum
    to 1) -> [B] int64: the first token whose running sum passes u * total.

    One uniform per row instead of the race's V exponentials: at batch 64
    over 49152 tokens the race's noise alone took 8 ms of one core (uniform_
    plus log1p), this whole draw 4 ms. It serves the unseeded rows, which
    promise no particular stream; seeded rows keep the race, so that a
    seeded request gives the same tokens with or without speculation.

    The token found always has p > 0: the running sum only rises at such
    tokens, and u * total is kept strictly below the total (the factor
    1 - 2^-23 outweighs the two float32 roundings of the product)."""
    cdf = probs.cumsum(dim=-1)  # [B, V], non-decreasing
    u = torch.rand(probs.shape[0], 1, dtype=cdf.dtype, device=cdf.device)
    target = u.mul_(cdf[:, -1:]).mul_(1.0 - 2.0**-23)  # [B, 1], in [0, total)
    # A row with no mass (every token masked) or a NaN total has no index
    # past the target: searchsorted answers V, outside the vocabulary.
    # _to_host clamps every sampled id into [0, V), so such a row (reachable
    # only through knobs that overflow its logits) still yields a real token.
    return torch.searchsorted(cdf, target, right=True).squeeze(1)  # first index with cdf > target


def _exponential_noise(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """q ~ Exp(1), [B, V]: one batch-wide draw for unseeded rows, then each
    seeded row overwritten from its own generator (exactly V draws a step)."""
    q = torch.empty_like(probs)
    if batch.any_unseeded_random:
        exponential_(q)
    for row, generator in batch.seeded:
        exponential_(q[row], generator)
    # A zero draw would make p / q inf or nan (nan wins argmax) even for a
    # masked token with p == 0.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


class Sampler:
    """Turns one step's logits into one token per row (plus logprobs)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.shape != (batch.num_rows, batch.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} != "
                f"({batch.num_rows}, {batch.vocab_size})"
            )
        raw = logits.float()  # [B, V]; no copy when already float32
        # Grammar first: penalties and temperature then act on allowed ids only.
        logits = apply_min_tokens(apply_penalties(apply_grammar(raw, batch), batch), batch)
        if batch.all_greedy:
            sampled = argmax_rows(logits)  # [B]
        else:
            sampled = self._sample_random(logits, batch)
            if batch.any_greedy:
                sampled = torch.where(batch.greedy, argmax_rows(logits), sampled)
        return _to_host(raw, sampled, batch)

    @staticmethod
    def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Unseeded rows draw one uniform each (inverse CDF); seeded rows
        race their own generator's noise (see module doc)."""
        probs = _random_probs(logits, batch)  # [B, V]
        sampled = _inverse_cdf(probs)  # [B]
        if batch.seeded:
            rows = torch.tensor([r for r, _ in batch.seeded], dtype=torch.int64, device=probs.device)
            seeded_probs = probs.index_select(0, rows)  # [S, V]
            noise = torch.empty_like(seeded_probs)
            for i, (_, generator) in enumerate(batch.seeded):
                exponential_(noise[i], generator)
            raced = seeded_probs.div_(noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
            sampled = sampled.index_copy_(0, rows, raced)
        return sampled

    def verify(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        draft_token_ids: list[int],
        draft_probs: torch.Tensor | None = None,
        has_draft_probs: list[bool] | None = None,
    ) -> SamplerOutput:
        """One token per row, verifying drafts (``kvferry.spec.rejection``):
        ``draft_token_ids`` [B] holds the draft each row checks (NO_DRAFT at
        bonus rows), ``draft_probs`` [B, V] the draft's distribution on rows
        flagged in ``has_draft_probs`` (others are deterministic drafts).
        A row's token equals its draft exactly when the draft is accepted."""
        if logits.shape != (batch.num_rows, batch.vocab_size):
            raise ValueError(f"logits shape {tuple(logits.shape)} != ({batch.num_rows}, {batch.vocab_size})")
        raw = logits.float()  # [B, V]
        logits = apply_min_tokens(apply_penalties(apply_grammar(raw, batch), batch), batch)
        with_q = draft_probs is not None and has_draft_probs is not None and any(has_draft_probs)
        if batch.all_greedy and not with_q:
            # p is one-hot at the argmax: accept exactly the drafts equal to it.
            return _to_host(raw, argmax_rows(logits), batch)
        probs = _target_probs(logits, batch)  # [B, V]
        noise = _exponential_noise(probs, batch)  # [B, V]
        draft_ids = torch.tensor(draft_token_ids, dtype=torch.int64, device=probs.device)  # [B]
        if not with_q:
            return _to_host(raw, rejection_sample(probs, draft_ids, noise), batch)
        flags = torch.tensor(has_draft_probs, dtype=torch.bool, device=probs.device)  # [B]
        tokens = rejection_sample(probs, draft_ids, noise, _uniforms(batch, probs.device), draft_probs, flags)
        return _to_host(raw, tokens, batch)


def _random_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] sampling distribution of each row (greedy rows: whatever the
    neutral knobs give; callers override them). Min-p leaves rows
    unnormalized: fine for the race, which is scale-free."""
    if batch.need_temperature:
        logits = logits / batch.temperature[:, None]
    if batch.need_top_k or batch.need_top_p:
        logits = apply_top_k_top_p(logits, batch)
    probs = logits.softmax(dim=-1)  # [B, V]
    if batch.need_min_p:
        probs = apply_min_p(probs, batch)
    return probs


def _target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] normalized distribution each row samples from: one-hot at the
    argmax on greedy rows (rejection sampling compares it with q)."""
    probs = _random_probs(logits, batch)
    if batch.need_min_p:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if batch.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(batch.greedy[:, None], one_hot, probs)
    return probs


def _uniforms(batch: SamplingBatch, device: torch.device) -> torch.Tensor:
    """[B] U[0, 1) acceptance draws; seeded rows draw from their own
    generator after their exponential noise (one draw a row)."""
    u = torch.rand(batch.num_rows, device=device)
    for row, generator in batch.seeded:
        u[row] = torch.rand((), device=device, generator=generator)
    return u


def _to_host(raw: torch.Tensor, sampled: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Everything the host needs, read back with one ``.tolist()``.

    With logprobs, all results are packed into one float64 vector (token ids
    and ranks are exact in float64) laid out as::

        | sampled ids [B] | sampled lp [R] | rank [R] | top ids [R*n] | top lp [R*n] |
    """
    num_rows = batch.num_rows
    # The last guard of the vocabulary: whatever the knobs did to the
    # distribution (a float underflow, a masked-out row), no id outside
    # [0, V) may reach the embedding of the next step.
    sampled = sampled.clamp(0, batch.vocab_size - 1)
    if batch.logprob_rows is None:
        return SamplerOutput(token_ids=sampled.tolist(), logprobs=[None] * num_rows)
    lp = torch.log_softmax(raw.index_select(0, batch.logprob_rows), dim=-1)  # [R, V]
    token = sampled.index_select(0, batch.logprob_rows)  # [R]
    token_lp = lp.gather(1, token[:, None])  # [R, 1]
    # 1-based; ties with the sampled token share its rank.
    rank = (lp > token_lp).sum(dim=-1) + 1  # [R]
    top_lp, top_ids = lp.topk(batch.max_num_logprobs, dim=-1)  # [R, n] each
    parts = (sampled, token_lp.view(-1), rank, top_ids.reshape(-1), top_lp.reshape(-1))
    flat = torch.cat([p.to(torch.float64) for p in parts]).tolist()
    return _unpack(flat, batch)


def _unpack(flat: list[float], batch: SamplingBatch) -> SamplerOutput:
    num_rows, n = batch.num_rows, batch.max_num_logprobs
    r = len(batch.logprob_row_ids)
    token_ids = [int(t) for t in flat[:num_rows]]
    token_lps = flat[num_rows : num_rows + r]
    ranks = flat[num_rows + r : num_rows + 2 * r]
    top_ids_start = num_rows + 2 * r
    top_lp_start = top_ids_start + r * n
    logprobs: list[TokenLogprobs | None] = [None] * num_rows
    for j, row in enumerate(batch.logprob_row_ids):
        k = batch.num_logprobs[row] or 0
        ids = flat[top_ids_start + j * n : top_ids_start + j * n + k]
        lps = flat[top_lp_start + j * n : top_lp_start + j * n + k]
        logprobs[row] = TokenLogprobs(
            token_id=token_ids[row],
            logprob=token_lps[j],
            rank=int(ranks[j]),
            top_token_ids=[int(t) for t in ids],
            top_logprobs=lps,
        )
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def position_generator(
    seed: int | None, position: int, device: torch.device | str, salt: int = 0
) -> torch.Generator | None:
    """The generator a seeded request samples its output token ``position``
    with (None when unseeded). Keyed by position, not a running stream: how
    many rows a step verifies depends on the batch (adaptive k), and the
    noise behind each output token must not. ``salt`` separates other
    streams of the same request (the draft model's own sampling)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(_splitmix64(_splitmix64(seed ^ salt) ^ position))
    return generator


def _splitmix64(x: int) -> int:
    """A 64-bit mix (Steele et al.), so nearby (seed, position) pairs give
    unrelated generator seeds; returned below 2**63 (manual_seed's range)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1

