"""The runner's side of speculation that is not verification: which drafter
a configuration makes (``make_drafter``), what each drafting request looks
like to it this step (``draft_requests``), which row of a step's sampled
hidden states a draft head reads next (``hidden_rows``), and a received
hidden state's bytes (``hidden_from_bytes``, a P/D decode core's).

Verification (sampling against the drafts) stays in runner.py: it is the
target's sampling, drafts or not.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kvferry.config import EngineConfig
from kvferry.core.outputs import SchedulerOutput
from kvferry.disagg.transport import Received
from kvferry.model.input_batch import InputBatch
from kvferry.model.loader import LoadedModel, iter_safetensors
from kvferry.sampling import SamplingParams
from kvferry.spec.draft_model import DraftModelProposer, DraftRequest, Proposal
from kvferry.spec.eagle3 import Eagle3Head
from kvferry.spec.eagle3_proposer import Eagle3Proposer
from kvferry.spec.head import EagleHead, HeadProposer


def make_drafter(loaded: LoadedModel, config: EngineConfig, num_blocks: int, block_size: int,
                 draft: LoadedModel | None = None,
                 head: EagleHead | Eagle3Head | None = None) -> DraftModelProposer | HeadProposer | None:
    """The drafter of the runner over ``loaded``: the draft model's proposer
    (method "draft"), an EAGLE-3 head's or a draft head's (method "head"),
    or None (the scheduler's drafts, or none)."""
    tree = bool(getattr(config.speculative, "draft_tree", 0))
    model = loaded.model
    if draft is not None:
        return DraftModelProposer(draft, num_blocks, block_size, loaded.config.vocab_size)
    if isinstance(head, Eagle3Head):  # an EAGLE-3 head: the target copies its aux layers' rows
        shard = getattr(model, "shard", None)
        if shard is not None and shard.size > 1:
            # Over tensor-parallel ranks rank 0 drafts alone (drafts_alone) and
            # the workers get its drafts with the step: a worker keeps no aux rows.
            if shard.rank != 0:
                return None
            if head.embed_tokens is None:  # rank 0 holds a vocabulary slice; a draft may be any id
                return Eagle3Proposer(head, model, tree=tree, embed=whole_embedding(loaded))
        return Eagle3Proposer(head, model, tree=tree)
    if head is not None:
        return HeadProposer(head, model, tree=tree)
    return None


def drafts_alone(drafter: DraftModelProposer | HeadProposer | None) -> bool:
    """Whether rank 0's drafter drafts by itself, outside the ranks'
    collectives, so that the workers get the step once its drafts are known:
    a draft model (whole on rank 0) and an EAGLE-3 head (its own weights,
    the aux rows every rank holds after each layer's all-reduce). A draft
    head drafts on every rank in step instead (its lookups and logits are
    the vocabulary-parallel collectives)."""
    return isinstance(drafter, (DraftModelProposer, Eagle3Proposer))


def whole_embedding(loaded: LoadedModel) -> torch.Tensor:
    """The target's whole token table [V, H] in its dtype, read from its
    checkpoint (a tensor-parallel rank holds only its vocabulary slice)."""
    for name, tensor in iter_safetensors(Path(loaded.model_path), lazy=True):
        if name == "model.embed_tokens.weight":
            return tensor[:].to(device=loaded.model.lm_head.device if loaded.model.lm_head is not None else "cpu",
                                dtype=loaded.dtype)
    raise ValueError(f"speculative.model: an EAGLE-3 head without its own embedding reads the target's, and "
                     f"{loaded.model_path} has no model.embed_tokens.weight")


def share_drafts(model: object, batch: InputBatch, drafted: list[DraftRequest], proposals: dict[str, Proposal],
                 samples: bool) -> None:
    """A draft head over tensor-parallel ranks: the sampling rank's drafts of
    each unseeded sampling request's path on every rank, in place of the
    rank's own (one float32 sum: the sampling rank fills, the others add
    zeros). Every rank drafts in step, but such a draft is drawn against the
    rank's own fresh noise, so the ranks' drafts differ, and a forward pass
    whose ranks embed different tokens at a position computes nothing
    meaningful there. Greedy and seeded drafts (and a tree's nodes) are the
    same bits on every rank already: nothing is sent for them."""
    shard = getattr(model, "shard", None)
    rows = [r for r in drafted if r.request_id in proposals and proposals[r.request_id].parents is None
            and not r.params.greedy and r.params.seed is None]
    if shard is None or shard.size == 1 or not rows:
        return
    sizes = [len(proposals[r.request_id].token_ids) for r in rows]
    values = ([float(t) for r in rows for t in proposals[r.request_id].token_ids] if samples
              else [0.0] * sum(sizes))
    summed = [int(v) for v in shard.all_reduce(torch.tensor(values, dtype=torch.float32)).tolist()]
    start = 0
    for r, size in zip(rows, sizes):
        ids = summed[start : start + size]
        proposals[r.request_id].token_ids = ids
        batch.token_ids[r.row, r.end : r.end + size] = ids
        start += size


def draft_requests(batch: InputBatch, sched: SchedulerOutput, states: dict) -> list[DraftRequest]:
    """Each scheduled request as the drafter sees it (``states``: the
    runner's RequestState by request id)."""
    requests = []
    for rid, num_scheduled in sched.num_scheduled_tokens.items():
        row = batch.index[rid]
        k = len(sched.spec_token_ids.get(rid, ()))
        end = int(batch.num_computed_tokens[row]) + num_scheduled - k
        state = states[rid]
        params: SamplingParams = state.params
        requests.append(DraftRequest(rid, row, end, k, params, len(state.output_token_ids),
                                     len(state.prompt_token_ids)))
    return requests


def hidden_rows(sampling: list[tuple[str, list[int]]], sampled: dict[str, list[int]],
                tree_accepted: dict[str, list[int]] | None = None) -> dict[str, int]:
    """Each request's row of the step's sampled hidden states [num_logits, H]
    that sampled its newest token: its last accepted row (a tree's: its last
    accepted node's)."""
    rows, first = {}, 0
    for rid, drafts in sampling:
        emitted = len(sampled.get(rid, ()))
        accepted = (tree_accepted or {}).get(rid)
        if accepted is not None:  # a tree: the row of its last accepted node
            rows[rid] = first + (1 + accepted[-1] if accepted else 0)
        elif emitted:
            rows[rid] = first + emitted - 1
        first += len(drafts) + 1
    return rows


_HIDDEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hidden_from_bytes(received: Received, hidden_size: int, device: torch.device) -> torch.Tensor | None:
    """[hidden_size] from a Done's raw bytes, or None when they do not fit."""
    dtype = _HIDDEN_DTYPES.get(received.hidden_state_dtype)
    if dtype is None or len(received.hidden_state) != hidden_size * torch.empty((), dtype=dtype).element_size():
        return None
    return torch.frombuffer(bytearray(received.hidden_state), dtype=dtype).to(device)

