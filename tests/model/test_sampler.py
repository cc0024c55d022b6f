"""Sampler: greedy, seeded reproducibility, distributions, penalties,
logprobs and min_tokens. CPU only, a few seconds in all."""
from __future__ import annotations

import math

import pytest
import torch

from kvferry.model.sampler import (
    Sampler,
    SamplingBatch,
    SamplingRow,
    apply_penalties,
    exponential_,
)
from kvferry.sampling import SamplingParams

scipy_stats = pytest.importorskip("scipy.stats")

# Fixed logits for the distribution tests: V = 8, distinct probabilities.
DIST_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
NUM_DRAWS = 20_000
P_MIN = 1e-3


def _row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator: torch.Generator | None = None,
    eos: list[int] | None = None,
    **params: object,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params),
        prompt_token_ids=list(prompt or []),
        output_token_ids=list(output or []),
        generator=generator,
        eos_token_ids=list(eos or []),
    )


def _sample(logits: torch.Tensor, rows: list[SamplingRow]):
    batch = SamplingBatch.build(rows, logits.shape[1], "cpu")
    return Sampler()(logits, batch)


# ---------------------------------------------------------------- noise


def test_exponential_noise_is_exp1_and_seeded_draws_repeat() -> None:
    """The race's noise: Exp(1) by a Kolmogorov-Smirnov test, never negative
    or infinite, and a generator's draws repeat from the same seed."""
    draws = exponential_(torch.empty(100_000), torch.Generator().manual_seed(0))
    assert torch.isfinite(draws).all() and (draws >= 0).all()
    assert scipy_stats.kstest(draws.numpy(), "expon").pvalue > P_MIN
    again = exponential_(torch.empty(100_000), torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)
    assert not torch.equal(draws, exponential_(torch.empty(100_000)))


# ---------------------------------------------------------------- greedy


def test_all_greedy_is_argmax_and_ignores_sampling_knobs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    rows = [
        _row(temperature=0.0),
        _row(temperature=0.0, top_p=0.1),
        _row(temperature=0.0, top_k=3),
        _row(temperature=0.0, min_p=0.9),
        _row(temperature=0.0, seed=1, generator=torch.Generator().manual_seed(1)),
        _row(temperature=1e-6, top_k=1, top_p=0.5),
    ]
    before = logits.clone()
    out = _sample(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6
    assert torch.equal(logits, before), "sampler must not mutate the caller's logits"


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 30)
    rows = [
        _row(temperature=0.0) if i % 2 == 0 else _row(temperature=1.3, top_k=5, top_p=0.8)
        for i in range(8)
    ]
    out = _sample(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in range(0, 8, 2)] == argmax[0::2]


def test_greedy_seeded_row_does_not_advance_its_generator() -> None:
    gen = torch.Generator().manual_seed(7)
    state = gen.get_state().clone()
    _sample(torch.randn(2, 10), [_row(temperature=0.0, seed=7, generator=gen), _row()])
    assert torch.equal(gen.get_state(), state)


# ------------------------------------------------- seeded reproducibility

VOCAB = 40
TARGET_SEED = 1234


def _target_logits(step: int) -> torch.Tensor:
    """The target request's logits at each step: fixed, independent of batch."""
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(VOCAB, generator=g) * 1.5  # [V]


def _target_params() -> dict[str, object]:
    return dict(temperature=0.9, top_p=0.95, top_k=30, presence_penalty=0.3, seed=TARGET_SEED)


def _run_seeded(companions: list[dict[str, object]], position: int, steps: int = 12) -> list[int]:
    """Simulate ``steps`` engine steps; the target row sits at ``position``
    among ``companions`` (whose logits change freely) and carries one
    generator across all steps, as the engine does."""
    target_gen = torch.Generator().manual_seed(TARGET_SEED)
    companion_gens = [
        torch.Generator().manual_seed(c["seed"]) if c.get("seed") is not None else None
        for c in companions
    ]
    target_out: list[int] = []
    companion_outs: list[list[int]] = [[] for _ in companions]
    noise = torch.Generator().manual_seed(99 + len(companions))
    for step in range(steps):
        rows = [
            _row(prompt=[1, 2], output=o, generator=g, **c)
            for c, g, o in zip(companions, companion_gens, companion_outs)
        ]
        rows.insert(position, _row(prompt=[1, 2], output=target_out, generator=target_gen,
                                   **_target_params()))
        logits = torch.randn(len(rows), VOCAB, generator=noise) * 3.0
        logits[position] = _target_logits(step)
        out = _sample(logits, rows)
        target_out.append(out.token_ids[position])
        others = out.token_ids[:position] + out.token_ids[position + 1 :]
        for o, t in zip(companion_outs, others):
            o.append(t)
    return target_out


def test_seeded_request_is_reproducible_whatever_shares_the_batch() -> None:
    torch.manual_seed(2024)  # unseeded rows draw from the global RNG
    alone = _run_seeded([], 0)
    small = _run_seeded([dict(temperature=1.0), dict(temperature=0.0)], 1)
    mixed = _run_seeded(
        [
            dict(temperature=0.7, seed=5),
            dict(temperature=1.0),
            dict(temperature=0.0, repetition_penalty=1.3),
            dict(temperature=1.2, top_k=3, seed=TARGET_SEED),  # same seed, own generator
            dict(temperature=0.5, min_p=0.2, logprobs=3),
            dict(temperature=1.0, frequency_penalty=1.0),
        ],
        4,
    )
    torch.manual_seed(7)  # a different global RNG stream must not matter
    first = _run_seeded([dict(temperature=1.0, seed=8), dict(temperature=1.0)], 0)
    assert alone == small == mixed == first
    assert len(set(alone)) > 1, "the test should exercise real sampling"


def test_different_seeds_differ() -> None:
    def run(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        rows = [_row(seed=seed, generator=gen)]
        return [_sample(_target_logits(s)[None], rows).token_ids[0] for s in range(12)]

    assert run(1) == run(1)
    assert run(1) != run(2)


# ------------------------------------------------------------ distribution


def _draw(num: int, **params: object) -> torch.Tensor:
    """Counts per token from ``num`` unseeded rows of DIST_LOGITS in one call."""
    logits = DIST_LOGITS.expand(num, -1).contiguous()  # [num, V]
    rows = [_row(**params) for _ in range(num)]
    out = _sample(logits, rows)
    return torch.bincount(torch.tensor(out.token_ids), minlength=DIST_LOGITS.numel())


def _assert_matches(counts: torch.Tensor, expected_probs: torch.Tensor) -> None:
    """Pearson chi-square goodness of fit over the tokens with p > 0; tokens
    with p == 0 must never be drawn."""
    kept = expected_probs > 0
    assert counts[~kept].sum().item() == 0, f"masked tokens drawn: {counts.tolist()}"
    f_obs = counts[kept].double().numpy()
    kept_probs = expected_probs[kept].double()
    f_exp = (kept_probs / kept_probs.sum() * counts.sum().item()).numpy()
    result = scipy_stats.chisquare(f_obs, f_exp)
    assert result.pvalue > P_MIN, (counts.tolist(), f_exp.tolist(), result)


def test_temperature_distribution_chi_square() -> None:
    """Chi-square GOF: 20000 draws at T=0.7 vs softmax(logits / 0.7), p > 1e-3."""
    torch.manual_seed(11)
    _assert_matches(_draw(NUM_DRAWS, temperature=0.7), torch.softmax(DIST_LOGITS / 0.7, -1))


def test_seeded_rows_distribution_chi_square() -> None:
    """Chi-square GOF: 4000 rows, each with its own seeded generator, at T=1."""
    num = 4000
    logits = DIST_LOGITS.expand(num, -1).contiguous()
    rows = [_row(seed=s, generator=torch.Generator().manual_seed(s)) for s in range(num)]
    counts = torch.bincount(torch.tensor(_sample(logits, rows).token_ids), minlength=8)
    _assert_matches(counts, torch.softmax(DIST_LOGITS, -1))


def test_top_k_distribution_chi_square() -> None:
    """Chi-square GOF on the top-3 tokens renormalized at T=0.7; the other
    five tokens must have exactly zero draws."""
    torch.manual_seed(12)
    probs = torch.softmax(DIST_LOGITS / 0.7, -1)
    expected = torch.where(probs >= probs.topk(3).values[-1], probs, torch.zeros(()))
    assert (expected > 0).sum() == 3
    _assert_matches(_draw(NUM_DRAWS, temperature=0.7, top_k=3), expected)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference top-p: the smallest most-likely prefix with mass >= top_p."""
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for i in order.tolist():
        keep[i] = True
        mass += probs[i].item()
        if mass >= top_p:
            break
    return torch.where(keep, probs, torch.zeros(()))


def test_top_p_distribution_chi_square() -> None:
    """Chi-square GOF on the top-p=0.8 nucleus at T=0.7, renormalized; tokens
    outside the nucleus must have exactly zero draws."""
    torch.manual_seed(13)
    probs = torch.softmax(DIST_LOGITS / 0.7, -1)
    expected = _nucleus(probs, 0.8)
    assert 2 <= (expected > 0).sum() < 8
    _assert_matches(_draw(NUM_DRAWS, temperature=0.7, top_p=0.8), expected)


def test_top_k_then_top_p_distribution_chi_square() -> None:
    """Chi-square GOF: top-p applies to the top-k renormalized distribution."""
    torch.manual_seed(14)
    probs = torch.softmax(DIST_LOGITS, -1)
    top4 = torch.where(probs >= probs.topk(4).values[-1], probs, torch.zeros(()))
    expected = _nucleus(top4 / top4.sum(), 0.75)
    assert 2 <= (expected > 0).sum() < 4
    _assert_matches(_draw(NUM_DRAWS, top_k=4, top_p=0.75), expected)


def test_min_p_distribution_chi_square() -> None:
    """Chi-square GOF: min_p=0.2 keeps tokens with p >= 0.2 * max p at T=0.7."""
    torch.manual_seed(15)
    probs = torch.softmax(DIST_LOGITS / 0.7, -1)
    expected = torch.where(probs >= 0.2 * probs.max(), probs, torch.zeros(()))
    assert 2 <= (expected > 0).sum() < 8
    _assert_matches(_draw(NUM_DRAWS, temperature=0.7, min_p=0.2), expected)


# --------------------------------------------------------------- penalties


def test_penalties_exact_math() -> None:
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, -2.0, 1.0, 0.0],
            [2.0, -1.0, 0.5, -2.0, 1.0, 0.0],
            [2.0, -1.0, 0.5, -2.0, 1.0, 0.0],
        ]
    )
    rows = [
        # prompt {0, 1}, output {2: x2, 3: x1}
        _row(prompt=[0, 1, 0], output=[2, 2, 3], repetition_penalty=2.0,
             frequency_penalty=0.5, presence_penalty=0.25),
        # no penalties: untouched even though it has tokens
        _row(prompt=[0, 1], output=[2, 2, 3]),
        # frequency / presence ignore the prompt
        _row(prompt=[4], output=[0, 0, 0], frequency_penalty=-0.5, presence_penalty=1.0),
    ]
    before = logits.clone()
    out = apply_penalties(logits, SamplingBatch.build(rows, 6, "cpu"))
    expected = torch.tensor(
        [
            # 0: 2/2; 1: -1*2; 2: 0.5/2 - 0.5*2 - 0.25; 3: -2*2 - 0.5 - 0.25
            [1.0, -2.0, -1.0, -4.75, 1.0, 0.0],
            [2.0, -1.0, 0.5, -2.0, 1.0, 0.0],
            # 0: 2 + 0.5*3 - 1.0
            [2.5, -1.0, 0.5, -2.0, 1.0, 0.0],
        ]
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert torch.equal(logits, before)


def test_no_penalties_builds_no_count_tensors() -> None:
    batch = SamplingBatch.build([_row(output=[1, 2]), _row(temperature=0.0)], 10, "cpu")
    assert batch.output_counts is None and batch.prompt_mask is None
    logits = torch.randn(2, 10)
    assert apply_penalties(logits, batch) is logits


def test_token_counts_match_python_counting() -> None:
    g = torch.Generator().manual_seed(3)
    outputs = [torch.randint(0, 17, (n,), generator=g).tolist() for n in (0, 5, 40, 1)]
    prompts = [torch.randint(0, 17, (n,), generator=g).tolist() for n in (3, 0, 9, 30)]
    rows = [_row(prompt=p, output=o, repetition_penalty=1.1) for p, o in zip(prompts, outputs)]
    batch = SamplingBatch.build(rows, 17, "cpu")
    assert batch.output_counts is not None and batch.prompt_mask is not None
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        assert batch.output_counts[i].tolist() == [float(o.count(t)) for t in range(17)]
        assert batch.prompt_mask[i].tolist() == [t in p for t in range(17)]


def test_greedy_uses_penalized_logits() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
    out = _sample(logits, [_row(output=[0], temperature=0.0, presence_penalty=1.0)])
    assert out.token_ids == [1]


# ---------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits() -> None:
    torch.manual_seed(21)
    logits = torch.randn(4, 25) * 2
    rows = [
        _row(output=[3, 3], temperature=0.8, logprobs=5, frequency_penalty=0.7),
        _row(temperature=1.0),
        _row(temperature=0.0, logprobs=0),
        _row(temperature=0.5, top_k=4, logprobs=20, seed=3,
             generator=torch.Generator().manual_seed(3)),
    ]
    out = _sample(logits, rows)
    raw_lp = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for row, n in ((0, 5), (2, 0), (3, 20)):
        lp = out.logprobs[row]
        assert lp is not None
        tok = out.token_ids[row]
        assert lp.token_id == tok
        assert math.isclose(lp.logprob, raw_lp[row, tok].item(), abs_tol=1e-6)
        assert lp.rank == int((raw_lp[row] > raw_lp[row, tok]).sum()) + 1
        top = raw_lp[row].topk(n)
        assert lp.top_token_ids == top.indices.tolist()
        assert len(lp.top_logprobs) == n
        for got, want in zip(lp.top_logprobs, top.values.tolist()):
            assert math.isclose(got, want, abs_tol=1e-6)
    assert out.logprobs[2].rank == 1  # greedy, unpenalized: the raw argmax


def test_logprob_rank_of_a_penalized_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]])
    out = _sample(logits, [_row(output=[0], temperature=0.0, presence_penalty=2.0, logprobs=2)])
    lp = out.logprobs[0]
    raw = torch.log_softmax(logits[0], -1)
    assert out.token_ids == [1] and lp.rank == 2
    assert math.isclose(lp.logprob, raw[1].item(), abs_tol=1e-6)
    assert lp.top_token_ids == [0, 1]


# -------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    eos, stop = 2, 5
    logits = torch.tensor([[0.0, 0.0, 10.0, 0.0, 0.0, 9.0, 1.0]])
    common = dict(eos=[eos], temperature=0.0, min_tokens=3, stop_token_ids=[stop, 1000])
    assert _sample(logits, [_row(output=[0], **common)]).token_ids == [6]
    assert _sample(logits, [_row(output=[0, 0, 0], **common)]).token_ids == [eos]
    # ignore_eos: EOS is not a stop token, so min_tokens leaves it alone.
    ignore = _row(output=[0], **{**common, "ignore_eos": True})
    assert _sample(logits, [ignore]).token_ids == [eos]


def test_min_tokens_masks_eos_when_sampling() -> None:
    torch.manual_seed(31)
    num, eos = 2000, 0
    logits = DIST_LOGITS.expand(num, -1).contiguous()  # EOS is the likeliest token
    rows = [_row(output=[4], eos=[eos], min_tokens=2) for _ in range(num)]
    tokens = _sample(logits, rows).token_ids
    assert eos not in tokens


def test_logits_shape_mismatch_is_rejected() -> None:
    batch = SamplingBatch.build([_row()], 10, "cpu")
    with pytest.raises(ValueError, match="logits shape"):
        Sampler()(torch.randn(2, 10), batch)


@pytest.mark.parametrize("fill", [float("-inf"), float("nan"), float("inf")])
@pytest.mark.parametrize("seeded", [False, True])
def test_a_row_without_probability_mass_still_samples_inside_the_vocabulary(fill: float, seeded: bool) -> None:
    """Logits that leave a row no finite distribution (all masked, NaN,
    +inf) must not make the sampler answer V: that id killed the engine
    core at the next step's embedding lookup."""
    vocab = 8
    logits = torch.zeros(3, vocab)
    logits[1].fill_(fill)
    gen = torch.Generator().manual_seed(3) if seeded else None
    rows = [_row(temperature=1.0), _row(temperature=0.7, top_p=0.5, generator=gen), _row(temperature=0.0)]
    for _ in range(20):
        out = _sample(logits, rows)
        assert all(0 <= t < vocab for t in out.token_ids), out.token_ids


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token() -> None:
    """top_p below float32's range is refused at the edge; inside the
    sampler a knob of 0 must still keep one token, the argmax."""
    logits = DIST_LOGITS[None, :].clone()
    rows = [_row(temperature=1.0, top_p=1.2e-38)]
    batch = SamplingBatch.build(rows, logits.shape[1], "cpu")
    batch.top_p.zero_()
    for _ in range(20):
        assert Sampler()(logits, batch).token_ids == [int(DIST_LOGITS.argmax())]


@pytest.mark.parametrize("field,value", [("top_p", 1e-46), ("repetition_penalty", 1e-46), ("temperature", 1e39),
                                         ("min_p", 5e-324), ("presence_penalty", -1e-40), ("top_k", 2**70),
                                         ("min_tokens", 2**64), ("stop_token_ids", [2**63])])
def test_values_a_knob_cannot_hold_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})
