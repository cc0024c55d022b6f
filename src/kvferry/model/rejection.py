"""Lossless verification of draft tokens: exact rejection sampling
(Leviathan et al. 2023; Chen et al. 2023).

Torch lives here, so ``kvferry.spec`` (imported by the torch-free scheduler)
does not import this module; the runner's sampler does.

A request with k drafts x_1..x_k is verified at its k + 1 last positions,
one row each. Row j holds the target's distribution p_j there (after
temperature, top-k, top-p, min-p, penalties, grammar) and, for a draft that
came with one, the draft's distribution q_j::

    row j < k:  accept x_j   with probability min(1, p_j(x_j) / q_j(x_j))
                else         a token from normalize(max(0, p_j - q_j))
    row k:      the bonus    a token from p_k (reached when all k accepted)

Each emitted token is then an exact sample of the target given the tokens
before it, whatever q was. The caller walks each request's rows to the first
rejection; nothing here depends on which rows are kept, so every row can be
decided in one vectorized pass.

Randomness comes in as arguments (``noise`` ~ Exp(1) [N, V], ``uniforms`` ~
U[0, 1) [N]) so a seeded request draws them from its own generator. Sampling
from a distribution r is the exponential race ``argmax r / noise``.

Drafts without a distribution (prompt lookup: a deterministic guess) are the
q = one-hot case. There acceptance is p_j(x_j) and the residual is p_j with
x_j removed; the race over p_j itself gives both at once: its winner is x_j
with probability p_j(x_j), and any other winner is a sample of the residual.
The emitted token is then exactly what plain sampling draws with the same
noise, so prompt lookup never changes a seeded output.

In every case a row's token equals its draft exactly when the draft is
accepted (a rejected draft has no residual mass), so the host needs only the
tokens to find where each request stops.
"""
from __future__ import annotations

import torch

NO_DRAFT = -1  # draft id of a bonus row


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    noise: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    has_draft_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token of every verified row, [N] int64.

    target_probs     [N, V] float, each row sums to 1 (p)
    draft_token_ids  [N] int64, the draft verified at each row; NO_DRAFT at bonus rows
    noise            [N, V] float, Exp(1) draws, all > 0
    uniforms         [N] float in [0, 1); needed when any row has a draft distribution
    draft_probs      [N, V] float (q); read only on rows where has_draft_probs
    has_draft_probs  [N] bool; rows without it are the one-hot (deterministic draft) case
    """
    race = (target_probs / noise).argmax(dim=-1)  # [N]: a sample of p per row
    if draft_probs is None or has_draft_probs is None:
        return race
    if uniforms is None:
        raise ValueError("uniforms are needed with draft_probs")
    drafted = draft_token_ids.clamp_min(0)[:, None]  # [N, 1]; bonus rows read id 0, ignored below
    p_x = target_probs.gather(1, drafted).squeeze(1)  # [N]
    q_x = draft_probs.gather(1, drafted).squeeze(1)  # [N]
    # u < p/q without dividing (q_x may be 0 on rows that are not used).
    accept = uniforms * q_x < p_x  # [N]
    residual = (target_probs - draft_probs).clamp_min(0.0)  # [N, V]
    # p == q leaves no residual mass; rejection then has probability 0, but
    # guard the race against an all-zero row (rounding) by falling back to p.
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # [N, 1]
    residual = torch.where(empty, target_probs, residual)
    recovered = (residual / noise).argmax(dim=-1)  # [N]
    verified = torch.where(accept, draft_token_ids, recovered)
    use_q = has_draft_probs & (draft_token_ids != NO_DRAFT)  # [N]
    return torch.where(use_q, verified, race)


def accepted_prefix(drafts: list[int], tokens: list[int]) -> list[int]:
    """The tokens a request emits from its k + 1 verified rows: the drafts up
    to the first rejected one (its row's token differs from it), then that
    row's token (the recovered sample, or the bonus when all were accepted)."""
    for j, draft in enumerate(drafts):
        if tokens[j] != draft:
            return tokens[: j + 1]
    return tokens[: len(drafts) + 1]
