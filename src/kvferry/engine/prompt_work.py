"""Work at prompt positions, for the few requests that ask for it.

A request normally needs logits only where it samples (the runner's
``logits_indices``: the last position of its prompt, then one per decode).
Two kinds of request read more of the forward pass:

* prompt logprobs (``SamplingParams.prompt_logprobs``): at each prompt
  position j < P - 1, the hidden state gives the distribution of prompt token
  j + 1; its logprob, rank and top-n are kept (position 0 has no context:
  None, as in vLLM and OpenAI's echo);
* pooling (``SamplingParams.pooling``, embeddings): the final hidden state
  (after the final norm) at the last prompt position, or its mean over every
  prompt position, L2-normalized.

Both are computed per step, over the positions the step covers (so a
chunked prefill adds up chunk by chunk), and reported once, on the step that
computes the end of the prompt (``RunnerOutput.prompt_logprobs`` /
``pooled``). A ``prompt_only`` request is also never sampled: the scheduler
finishes it once its prompt is computed.

The runner consults this only while some request holds a task here, so a
step without such requests does no extra work.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvferry.core.outputs import RunnerOutput, TokenLogprobs
from kvferry.sampling import SamplingParams

# Prompt positions whose logits are materialized at once ([rows, vocab] fp32:
# 256 x 152k = 150 MiB at most, for the largest vocabularies served).
_LOGITS_CHUNK = 256


@dataclass(slots=True)
class PromptTask:
    """One request's prompt-position work, kept across its steps (and a
    preemption: a recomputed position overwrites, a pooled one is not added twice)."""

    prompt_token_ids: list[int]
    num_logprobs: int | None
    pooling: str | None
    prompt_only: bool
    # Index j: prompt token j's entry (0 stays None).
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    pooled: torch.Tensor | None = None  # [hidden] float32: the sum ("mean") or the last row ("last")
    num_pooled: int = 0  # prompt positions already summed ("mean")
    done: bool = False


@dataclass(slots=True)
class PromptStep:
    """What one step computes at prompt positions (built before the forward)."""

    # Rows of the flattened batch whose logits give a prompt token's logprob,
    # the prompt token each one scores, and (request id, its position).
    lp_rows: list[int] = field(default_factory=list)
    lp_targets: list[int] = field(default_factory=list)
    lp_owners: list[tuple[str, int]] = field(default_factory=list)
    # (request id, first row, row count) to pool.
    pool: list[tuple[str, int, int]] = field(default_factory=list)
    # Requests whose prompt ends this step: their results are reported.
    completes: list[str] = field(default_factory=list)


class PromptWork:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tasks: dict[str, PromptTask] = {}

    def add(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        if not params.has_prompt_work:
            return
        task = PromptTask(list(prompt_token_ids), params.prompt_logprobs, params.pooling, params.prompt_only)
        if task.num_logprobs is not None:
            task.logprobs = [None] * len(prompt_token_ids)
        self.tasks[request_id] = task

    def remove(self, request_id: str) -> None:
        self.tasks.pop(request_id, None)

    def plan(self, order: list[str], starts: np.ndarray, lens: np.ndarray, query_start_loc: np.ndarray,
             samples: np.ndarray) -> PromptStep | None:
        """The step's prompt-position rows (None: none); clears ``samples``
        [num_reqs] for prompt-only requests (they are never sampled)."""
        step = PromptStep()
        for i, rid in enumerate(order):
            task = self.tasks.get(rid)
            if task is None:
                continue
            if task.prompt_only:
                samples[i] = False
            if task.done:
                continue
            num_prompt = len(task.prompt_token_ids)
            start, end, first_row = int(starts[i]), int(starts[i] + lens[i]), int(query_start_loc[i])
            if task.num_logprobs is not None:
                for j in range(start, min(end, num_prompt - 1)):
                    step.lp_rows.append(first_row + j - start)
                    step.lp_targets.append(task.prompt_token_ids[j + 1])
                    step.lp_owners.append((rid, j + 1))
            if task.pooling == "mean":
                lo, hi = max(start, task.num_pooled), min(end, num_prompt)
                if hi > lo:
                    step.pool.append((rid, first_row + lo - start, hi - lo))
                    task.num_pooled = hi
            elif task.pooling == "last" and start <= num_prompt - 1 < end:
                step.pool.append((rid, first_row + num_prompt - 1 - start, 1))
            if end >= num_prompt:
                step.completes.append(rid)
        if not (step.lp_rows or step.pool or step.completes):
            return None
        return step

    def run(self, model: torch.nn.Module, hidden: torch.Tensor, step: PromptStep, out: RunnerOutput) -> None:
        """Compute the step's rows from ``hidden`` [num_tokens, H] and report
        the requests whose prompt ended."""
        if step.lp_rows:
            self._logprobs(model, hidden, step)
        for rid, first, count in step.pool:
            task = self.tasks[rid]
            rows = hidden[first:first + count].float()
            if task.pooling == "mean":
                total = rows.sum(dim=0)
                task.pooled = total if task.pooled is None else task.pooled + total
            else:
                task.pooled = rows[0]
        for rid in step.completes:
            task = self.tasks[rid]
            task.done = True
            if task.num_logprobs is not None:
                out.prompt_logprobs[rid] = task.logprobs
                task.logprobs = []
            if task.pooling is not None and task.pooled is not None:
                vector = task.pooled / len(task.prompt_token_ids) if task.pooling == "mean" else task.pooled
                out.pooled[rid] = torch.nn.functional.normalize(vector, dim=0).tolist()
                task.pooled = None
            if not task.prompt_only:
                del self.tasks[rid]  # nothing left to do at its prompt

    def _logprobs(self, model: torch.nn.Module, hidden: torch.Tensor, step: PromptStep) -> None:
        k = max(self.tasks[rid].num_logprobs or 0 for rid, _ in step.lp_owners)
        rows = torch.tensor(step.lp_rows, dtype=torch.int64, device=self.device)
        targets = torch.tensor(step.lp_targets, dtype=torch.int64, device=self.device)
        token_lps, ranks, top_lps, top_ids = [], [], [], []
        for s in range(0, len(step.lp_rows), _LOGITS_CHUNK):
            lp = torch.log_softmax(model.compute_logits(hidden[rows[s:s + _LOGITS_CHUNK]]), dim=-1)
            token_lp = lp.gather(1, targets[s:s + _LOGITS_CHUNK, None])  # [r, 1]
            token_lps.append(token_lp.view(-1))
            ranks.append((lp > token_lp).sum(dim=-1) + 1)  # 1-based; ties share the token's rank
            if k:
                values, ids = lp.topk(k, dim=-1)
                top_lps.append(values)
                top_ids.append(ids)
        token_lp_list = torch.cat(token_lps).tolist()
        rank_list = torch.cat(ranks).tolist()
        top_lp_list = torch.cat(top_lps).tolist() if k else None
        top_id_list = torch.cat(top_ids).tolist() if k else None
        for n, (rid, position) in enumerate(step.lp_owners):
            task = self.tasks[rid]
            kr = task.num_logprobs or 0
            task.logprobs[position] = TokenLogprobs(
                token_id=step.lp_targets[n],
                logprob=token_lp_list[n],
                rank=int(rank_list[n]),
                top_token_ids=top_id_list[n][:kr] if kr else [],
                top_logprobs=top_lp_list[n][:kr] if kr else [],
            )
