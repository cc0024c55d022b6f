"""Prompt lookup on hand-built sequences."""
from __future__ import annotations

import random

import numpy as np

from kvferry.core.request import Request
from kvferry.sampling import SamplingParams
from kvferry.spec.ngram import NgramProposer, propose_ngram


def reference(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The rule spelled out with loops: longest n in [min, max] down from
    max, latest earlier occurrence with at least one token after it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_proposes_what_followed_the_suffix():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2], k=3, max_n=4, min_n=2) == [3, 4, 5]


def test_longest_match_wins_over_a_later_shorter_one():
    # Suffix [7, 1, 2]: "1 2" occurs last at index 5 (followed by 9), but
    # "7 1 2" occurs at index 0 (followed by 3).
    tokens = [7, 1, 2, 3, 4, 1, 2, 9, 7, 1, 2]
    assert propose_ngram(tokens, k=2, max_n=3, min_n=2) == [3, 4]
    assert propose_ngram(tokens, k=2, max_n=2, min_n=2) == [9, 7]


def test_latest_of_equally_long_matches():
    assert propose_ngram([5, 6, 1, 5, 6, 2, 5, 6], k=1, max_n=2, min_n=2) == [2]


def test_no_match_or_too_short_gives_nothing():
    assert propose_ngram([1, 2, 3, 4], k=3, max_n=4, min_n=2) == []
    assert propose_ngram([1, 9, 1], k=3, max_n=4, min_n=2) == []  # only a 1-gram matches
    assert propose_ngram([1, 9, 1], k=3, max_n=4, min_n=1) == [9, 1]
    assert propose_ngram([], k=3, max_n=4, min_n=1) == []
    assert propose_ngram([4], k=3, max_n=4, min_n=1) == []


def test_proposal_is_cut_at_the_end_of_the_context():
    # Periodic text: the latest match of [1, 2] ends two tokens from the end.
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], k=5, max_n=2, min_n=2) == [3, 1, 2]


def test_repeated_single_token_matches_itself_shifted():
    assert propose_ngram([8, 8, 8, 8], k=3, max_n=3, min_n=2) == [8]


def test_matches_the_loop_reference_on_random_sequences():
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        k, max_n = rng.randrange(1, 6), rng.randrange(1, 5)
        min_n = rng.randrange(1, max_n + 1)
        assert propose_ngram(tokens, k, max_n, min_n) == reference(tokens, k, max_n, min_n), (tokens, k, max_n, min_n)


def test_searches_prompt_and_output_of_that_request_only():
    a = Request("a", [10, 11, 12, 13], SamplingParams())
    b = Request("b", [20, 10, 11], SamplingParams())  # "10 11" is only in a's text
    proposer = NgramProposer(num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=2)
    assert proposer.propose(b) == []
    for t in (30, 10, 11):
        a.append_output_token(t)  # a: 10 11 12 13 30 10 11
    assert proposer.propose(a) == [12, 13]
    b.append_output_token(20)
    b.append_output_token(10)  # b: 20 10 11 20 10
    assert proposer.propose(b) == [11, 20]


def test_accepts_numpy_input_and_long_contexts():
    tokens = np.arange(100_000) % 997
    assert propose_ngram(tokens, k=4, max_n=4, min_n=2) == [int(t) for t in (np.arange(100_000, 100_004) % 997)]
