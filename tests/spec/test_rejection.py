"""The verification function on hand-built probability tables.

Deterministic cases pin the rule (accept when u < p(x)/q(x); a rejected
draft is never emitted; the bonus is a sample of p). Distribution cases
draw many rows at once and compare frequencies with the exact answer
within a stated bound: with N draws of a distribution m over V ids,
E[TV] <= 1/2 sum_i sqrt(m_i (1 - m_i) / N) and, TV moving by at most 1/N
per draw, P(TV > E[TV] + t) <= exp(-2 N t^2) (McDiarmid); t = 0.01 at
N = 60000 gives 6e-6.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry.spec.rejection import NO_DRAFT, accepted_prefix, rejection_sample

N = 60_000
SLACK = 0.01
P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=torch.float64)
Q = torch.tensor([0.05, 0.10, 0.50, 0.05, 0.20, 0.10], dtype=torch.float64)


def tv(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(tokens, minlength=len(probs)).double() / len(tokens)
    return 0.5 * float((freq - probs).abs().sum())


def tv_bound(probs: torch.Tensor, n: int = N) -> float:
    return 0.5 * float((probs * (1 - probs) / n).sqrt().sum()) + SLACK


def draws(n: int, v: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    noise = torch.empty(n, v, dtype=torch.float64).exponential_(generator=gen)  # [n, V]
    return noise, torch.rand(n, dtype=torch.float64, generator=gen)  # [n]


def verify_one_position(p, q, gen, verifier=rejection_sample):
    """N independent single-draft rows: x ~ q, verified against p. Returns
    (tokens [N], drafts [N])."""
    v = len(p)
    drafts = torch.multinomial(q, N, replacement=True, generator=gen)  # [N]
    noise, u = draws(N, v, gen)
    tokens = verifier(p.expand(N, v), drafts, noise, u, q.expand(N, v), torch.ones(N, dtype=torch.bool))
    return tokens, drafts


def test_accepts_with_probability_min_1_p_over_q_and_emits_p():
    gen = torch.Generator().manual_seed(0)
    tokens, drafts = verify_one_position(P, Q, gen)
    accepted = tokens == drafts
    # P(accept) = sum_x q(x) min(1, p(x)/q(x)) = sum_x min(p(x), q(x))
    expected = float(torch.minimum(P, Q).sum())
    assert abs(accepted.double().mean().item() - expected) < 4 * (expected * (1 - expected) / N) ** 0.5
    assert tv(tokens, P) < tv_bound(P)


def test_rejected_tokens_follow_the_normalized_residual():
    gen = torch.Generator().manual_seed(1)
    tokens, drafts = verify_one_position(P, Q, gen)
    rejected = tokens[tokens != drafts]
    residual = (P - Q).clamp_min(0)
    residual /= residual.sum()
    assert tv(rejected, residual) < tv_bound(residual, len(rejected))
    # Ids where q >= p have no residual mass: never a recovered token.
    assert not torch.isin(rejected, torch.nonzero(Q >= P).flatten()).any()


def test_deterministic_edges():
    v = len(P)
    gen = torch.Generator().manual_seed(2)
    noise, u = draws(v, v, gen)
    ones = torch.ones(v, dtype=torch.bool)
    ids = torch.arange(v)
    # q == p: every draft accepted whatever the uniform.
    assert rejection_sample(P.expand(v, v), ids, noise, torch.full((v,), 0.999999, dtype=torch.float64),
                            P.expand(v, v), ones).tolist() == ids.tolist()
    # p(x) = 0: the draft is always rejected and a token with p > 0 comes out.
    p = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0], dtype=torch.float64)
    out = rejection_sample(p.expand(v, v), torch.zeros(v, dtype=torch.int64), noise, torch.zeros(v, dtype=torch.float64),
                           Q.expand(v, v), ones)
    assert set(out.tolist()) <= {1, 2}
    # p(x) >= q(x): accepted even at u close to 1.
    assert rejection_sample(P[None], torch.tensor([0]), noise[:1], torch.tensor([0.999999], dtype=torch.float64),
                            Q[None], ones[:1]).item() == 0
    # Greedy (p one-hot): only the argmax is accepted, and it is what a rejection emits.
    one_hot = torch.zeros(v, dtype=torch.float64)
    one_hot[3] = 1.0
    out = rejection_sample(one_hot.expand(v, v), ids, noise, u, Q.expand(v, v), ones)
    assert out.tolist() == [3] * v


def test_bonus_rows_and_rows_without_q_sample_p():
    gen = torch.Generator().manual_seed(3)
    v = len(P)
    noise, u = draws(N, v, gen)
    bonus = rejection_sample(P.expand(N, v), torch.full((N,), NO_DRAFT), noise, u, Q.expand(N, v),
                             torch.ones(N, dtype=torch.bool))
    assert tv(bonus, P) < tv_bound(P)
    # A deterministic draft (q one-hot at 2): accepted with probability p(2),
    # and the rows together are still a sample of p.
    tokens = rejection_sample(P.expand(N, v), torch.full((N,), 2), noise)
    assert abs((tokens == 2).double().mean().item() - P[2].item()) < 4 * (0.15 * 0.85 / N) ** 0.5
    assert tv(tokens, P) < tv_bound(P)
    # With draft_probs given but the row not flagged, it is still the one-hot case.
    same = rejection_sample(P.expand(N, v), torch.full((N,), 2), noise, u, Q.expand(N, v),
                            torch.zeros(N, dtype=torch.bool))
    assert torch.equal(same, tokens)


def test_accepted_prefix():
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accepted_prefix([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accepted_prefix([], [3]) == [3]


# -- two chained positions: the second token's marginal ----------------------
P1 = torch.tensor([  # p(t1 | t0), row t0
    [0.70, 0.10, 0.05, 0.05, 0.05, 0.05],
    [0.05, 0.05, 0.60, 0.10, 0.10, 0.10],
    [0.10, 0.10, 0.10, 0.50, 0.10, 0.10],
    [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    [0.05, 0.05, 0.05, 0.05, 0.05, 0.75],
    [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
], dtype=torch.float64)
Q1 = P1.roll(1, dims=1) * 0.5 + 0.5 / 6  # a draft that is wrong about half the time


def resample_from_p_on_reject(p, ids, noise, u, q, flags):
    """The classic bug: a rejected draft is replaced by a fresh sample of p
    instead of the residual max(0, p - q) (p's mass on tokens the draft
    already favoured is then counted twice)."""
    tokens = rejection_sample(p, ids, noise, u, q, flags)
    return torch.where(tokens == ids, ids, (p / noise).argmax(dim=-1))


def two_step_second_tokens(verifier, gen) -> torch.Tensor:
    """N requests with k = 2 drafts from q (x0 ~ Q, x1 ~ Q1[x0]); returns
    each request's second emitted token (from its second round when the
    first draft is rejected, as decoding would continue)."""
    v = len(P)
    x0 = torch.multinomial(Q, N, replacement=True, generator=gen)  # [N]
    x1 = torch.multinomial(Q1[x0], 1, generator=gen).squeeze(1)  # [N]
    # Rows per request: draft 0 (p = P), draft 1 (p = P1[x0]), bonus (p = P1[x1]).
    p = torch.stack([P.expand(N, v), P1[x0], P1[x1]], 1).reshape(3 * N, v)
    q = torch.stack([Q.expand(N, v), Q1[x0], Q1[x0]], 1).reshape(3 * N, v)
    ids = torch.stack([x0, x1, torch.full((N,), NO_DRAFT)], 1).reshape(-1)
    noise, u = draws(3 * N, v, gen)
    tokens = verifier(p, ids, noise, u, q, torch.ones(3 * N, dtype=torch.bool)).view(N, 3)
    second = tokens[:, 1].clone()
    first_rejected = tokens[:, 0] != x0
    # A rejected first draft: the next round samples t1 from P1[t0] plainly.
    t0 = tokens[first_rejected, 0]
    noise2, _ = draws(len(t0), v, gen)
    second[first_rejected] = (P1[t0] / noise2).argmax(dim=-1)
    return second


@pytest.mark.parametrize("verifier, exact", [(rejection_sample, True), (resample_from_p_on_reject, False)])
def test_second_token_marginal_within_the_tv_bound_and_a_biased_verifier_fails(verifier, exact):
    marginal = P @ P1  # [V]: sum_t0 p(t0) p(t1 | t0)
    got = tv(two_step_second_tokens(verifier, torch.Generator().manual_seed(4)), marginal)
    bound = tv_bound(marginal)
    print(f"TV {got:.4f} (bound {bound:.4f}, {'exact' if exact else 'biased'} verifier)")
    assert (got < bound) == exact
