"""The runner's side of speculation that is not verification: which drafter
a configuration makes (``make_drafter``), what each drafting request looks
like to it this step (``draft_requests``), which row of a step's sampled
hidden states a draft head reads next (``hidden_rows``), and a received
hidden state's bytes (``hidden_from_bytes``, a P/D decode core's).

Verification (sampling against the drafts) stays in runner.py: it is the
target's sampling, drafts or not.
"""
from __future__ import annotations

import torch

from kvferry.config import EngineConfig
from kvferry.core.outputs import SchedulerOutput
from kvferry.disagg.transport import Received
from kvferry.model.input_batch import InputBatch
from kvferry.model.llama import LlamaModel
from kvferry.model.loader import LoadedModel
from kvferry.sampling import SamplingParams
from kvferry.spec.draft_model import DraftModelProposer, DraftRequest
from kvferry.spec.eagle3 import Eagle3Head
from kvferry.spec.eagle3_proposer import Eagle3Proposer
from kvferry.spec.head import EagleHead, HeadProposer


def make_drafter(model: LlamaModel, config: EngineConfig, num_blocks: int, block_size: int, vocab_size: int,
                 draft: LoadedModel | None = None,
                 head: EagleHead | Eagle3Head | None = None) -> DraftModelProposer | HeadProposer | None:
    """The drafter of the runner over ``model``: the draft model's proposer
    (method "draft"), an EAGLE-3 head's or a draft head's (method "head"),
    or None (the scheduler's drafts, or none)."""
    tree = bool(getattr(config.speculative, "draft_tree", 0))
    if draft is not None:
        return DraftModelProposer(draft, num_blocks, block_size, vocab_size)
    if isinstance(head, Eagle3Head) and getattr(getattr(model, "shard", None), "size", 1) > 1:
        raise ValueError("speculative.model: an EAGLE-3 head does not run over tensor-parallel ranks yet")
    if isinstance(head, Eagle3Head):  # an EAGLE-3 head: the target copies its aux layers' rows
        return Eagle3Proposer(head, model, tree=tree)
    if head is not None:
        return HeadProposer(head, model, tree=tree)
    return None


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

