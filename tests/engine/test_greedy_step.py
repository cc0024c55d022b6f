"""The runner's plain-greedy shortcut (engine/greedy_step.py): the sampler's
tokens to the bit where it applies, and no shortcut where the sampler's
other stages could act. CPU only, well under a second."""
from __future__ import annotations

import pytest
import torch

from kvferry.engine.greedy_step import plain_greedy_tokens
from kvferry.engine.runner import RequestState
from kvferry.model.sampler import Sampler, SamplingBatch, SamplingRow
from kvferry.sampling import SamplingParams
from kvferry.spec.rejection import NO_DRAFT

V = 1000


def _state(output: list[int] | None = None, **params: object) -> RequestState:
    return RequestState(params=SamplingParams(**{"temperature": 0.0, **params}), prompt_token_ids=[1, 2, 3],
                        output_token_ids=list(output or []), eos_token_ids=[7])


def _sampler_tokens(logits: torch.Tensor, states: list[RequestState]) -> list[int]:
    rows = [SamplingRow(params=s.params, prompt_token_ids=s.prompt_token_ids, output_token_ids=s.output_token_ids,
                        eos_token_ids=s.eos_token_ids) for s in states]
    return Sampler()(logits, SamplingBatch.build(rows, V, "cpu")).token_ids


def test_the_sampler_tokens_on_plain_greedy_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g)
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1  # a tie: the first maximum
    logits[2, 30] = float("nan")  # a NaN wins, as argmax's
    logits[3] = float("-inf")  # nothing finite: index 0
    logits[4, 999] = float("inf")
    states = [_state(), _state(seed=5), _state(output=[4, 5], min_tokens=2), _state(max_tokens=3), _state(),
              _state(ignore_eos=True, output=[1])]
    sampling = [(f"r{i}", []) for i in range(6)]
    got = plain_greedy_tokens(logits, sampling, {rid: s for (rid, _), s in zip(sampling, states)}, V)
    assert got == _sampler_tokens(logits, states)
    assert got[1] == 10 and got[2] == 30 and got[3] == 0 and got[4] == 999


@pytest.mark.parametrize("state,drafts", [
    (_state(temperature=0.7), []),
    (_state(repetition_penalty=1.2), []),
    (_state(presence_penalty=0.5), []),
    (_state(logprobs=2), []),
    (_state(min_tokens=3, output=[1]), []),  # min_tokens still bans EOS
    (_state(), [5, 6]),  # drafts to verify
])
def test_no_shortcut_where_the_sampler_could_act(state, drafts):
    assert plain_greedy_tokens(torch.zeros(1 + len(drafts), V), [("r", drafts)], {"r": state}, V) is None


def test_the_sampler_tokens_on_greedy_verify_rows():
    """A verify step's rows (a chain's drafts, a tree's one-hot nodes) where
    no draft has a distribution: Sampler.verify's tokens, row for row."""
    g = torch.Generator().manual_seed(1)
    sampling = [("chain", [11, 12, 13]), ("tree", [21, 22]), ("plain", [])]
    states = {"chain": _state(output=[1]), "tree": _state(seed=3), "plain": _state(min_tokens=1, output=[2])}
    logits = torch.randn(4 + 3 + 1, V, generator=g)
    logits[0, 11] = logits[1, 12] = logits[0].max() + 5  # the chain's first two drafts hold
    logits[4, 22] = logits[4].max() + 5  # the tree's root picks its second node
    rows = [SamplingRow(params=states[rid].params, prompt_token_ids=states[rid].prompt_token_ids,
                        output_token_ids=states[rid].output_token_ids, eos_token_ids=states[rid].eos_token_ids,
                        num_output_tokens=len(states[rid].output_token_ids) + j)
            for rid, drafts in sampling for j in range(len(drafts) + 1)]
    draft_ids = [11, 12, 13, NO_DRAFT, NO_DRAFT, NO_DRAFT, NO_DRAFT, NO_DRAFT]
    expected = Sampler().verify(logits, SamplingBatch.build(rows, V, "cpu"), draft_ids).token_ids
    got = plain_greedy_tokens(logits, sampling, states, V, with_drafts=True)
    assert got == expected
    assert got[:2] == [11, 12] and got[4] == 22
    assert plain_greedy_tokens(logits, sampling, states, V) is None  # drafts, unless the caller vouches for them


@pytest.mark.parametrize("state", [_state(temperature=0.7), _state(logprobs=1), _state(repetition_penalty=1.1),
                                   _state(min_tokens=5, output=[1])])
def test_no_verify_shortcut_where_the_sampler_could_act(state):
    assert plain_greedy_tokens(torch.zeros(3, V), [("r", [5, 6])], {"r": state}, V, with_drafts=True) is None
