"""The lease race, forced with two real in-process engine cores (real
transfer sockets, agents and threads; the test plays the router): the
decode core D's lease ends while the prefill core P, slow, is still
computing; P then reports its first token, which the router streams, and
only afterwards does the router read D's report of the failed transfer.
D must never emit a first token of its own then, and must continue from
the token the client got."""
from __future__ import annotations

import random
import time

import pytest

from kvferry import LLM, SamplingParams
from kvferry.core.kv_connector.disagg import first_token_word
from kvferry.engine.core import EngineCore
from kvferry.messages import EngineCoreOutput
from tests.disagg.driver import Result, decode_side, finish_decode, make_core, prefill_side, settle
from tests.tiny_models import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LEASE_S = 0.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("race"), arch="llama", num_hidden_layers=3,
                                    max_position_embeddings=1024))


@pytest.fixture(scope="module")
def colocated(checkpoint):
    return LLM(model=checkpoint, dtype="float32")


@pytest.fixture(scope="module")
def pair(checkpoint):
    """A prefill core and a decode core with a short lease, sharing one model."""
    prefill = make_core(checkpoint)
    decode = make_core(checkpoint, prefill.loaded, kv_transfer_timeout_s=LEASE_S)
    yield prefill, decode
    prefill.close()
    decode.close()


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def race(prefill: EngineCore, decode: EngineCore, rid: str, prompt: list[int],
         params: SamplingParams) -> tuple[EngineCoreOutput, list[int]]:
    """D's lease ends before P computes (P is slow); then P's first token is
    streamed, and D's report of the failed transfer is read after it.
    Returns that report and the streamed first token."""
    dest = decode_side(decode, rid, prompt, params)
    time.sleep(max(0.0, dest.deadline - time.monotonic()) + 0.6)  # past the lease and the receiver's grace
    report = None
    deadline = time.monotonic() + 10
    while report is None:  # D notices: its report waits, unread, in the router's socket
        assert time.monotonic() < deadline, "the decode core never reported the failed transfer"
        report = next((o for o in decode.step().outputs if o.request_id == rid and o.kv_transfer_error), None)
    first = prefill_side(prefill, rid, prompt, params, dest)
    assert first.finish_reason == "prefilled" and len(first.new_token_ids) == 1
    return report, list(first.new_token_ids)


def test_a_decode_core_never_emits_its_own_first_token_after_the_prefill_cores_was_streamed(pair, colocated):
    prefill, decode = pair
    prompt = prompt_of(60, seed=3)
    report, streamed = race(prefill, decode, "r", prompt, GREEDY)
    assert report.new_token_ids == [] and not report.finished
    # Until the router's word D samples nothing, however long the word takes.
    for _ in range(30):
        emitted = [o.new_token_ids for o in decode.step().outputs if o.request_id == "r" and o.new_token_ids]
        assert emitted == [], f"the decode core emitted {emitted} before the router's word"
    assert report.kv_first_token_wanted
    # The router streamed P's token and says so: D continues from it, and
    # emits no first token of its own.
    first_token_word(decode.scheduler.connector, "r", streamed)
    result = finish_decode(decode, "r", Result(tokens=list(streamed)))
    assert result.tokens == list(colocated.generate([prompt], GREEDY)[0].outputs[0].token_ids)
    settle(decode, prefill)


def test_a_sampled_sequence_continues_from_the_streamed_first_token(pair):
    """Unseeded sampling: D's own first token would likely differ from P's,
    and the client's text would go on from a token it never got."""
    prefill, decode = pair
    params = SamplingParams(max_tokens=6, temperature=1.5, ignore_eos=True)
    prompt = prompt_of(60, seed=5)
    report, streamed = race(prefill, decode, "s", prompt, params)
    assert report.kv_first_token_wanted
    first_token_word(decode.scheduler.connector, "s", streamed)
    tokens = list(streamed)
    for o in decode.step().outputs:  # the prompt and the streamed token again: it samples the second
        tokens += o.new_token_ids if o.request_id == "s" else []
    assert len(tokens) == 2 and decode.scheduler.requests["s"].output_token_ids == tokens
    result = finish_decode(decode, "s", Result(tokens=tokens))
    assert len(result.tokens) == 6 and result.finish_reason == "length"
    settle(decode, prefill)


def test_with_no_first_token_streamed_the_decode_core_samples_it(pair, colocated):
    """The router got no token of P's before D's report: its word is empty,
    D samples the first token, and P's late one is the router's to drop."""
    prefill, decode = pair
    prompt = prompt_of(60, seed=7)
    dest = decode_side(decode, "t", prompt, GREEDY)
    time.sleep(max(0.0, dest.deadline - time.monotonic()) + 0.6)
    result = finish_decode(decode, "t", Result())
    assert result.transfer_errors and "timeout" in result.transfer_errors[0]
    assert result.tokens == list(colocated.generate([prompt], GREEDY)[0].outputs[0].token_ids)
    settle(decode)
