"""Speculation by default on a real server (``kvferry serve`` with no
``--speculative-config``, the real openai client, the spec-decode counters
of /metrics): a batch-1 repetitive request drafts, and its greedy text is
that of ``--speculative-config off``; a large batch drafts nothing (the
controller's off switch: the plain step); ``off`` drafts nothing at all.
The start's log says what the default does."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.serve.server_process import MODEL_NAME, start_server
from tests.spec.test_server_metrics import PASSAGE

DRAFTS = "kvferry:spec_decode_num_draft_tokens_total"
RUNNING = "kvferry:num_requests_running"
PROMPT = f"{PASSAGE}\n\nRepeat the text above.\n\n{PASSAGE[:60]}"
# A batch at which the default drafts nothing: num_running * 2 > batch_token_threshold (24).
LARGE_BATCH = 16
NO_DRAFTS_FROM = 13
FAILING_TOKENS = 120
FAILING_DRAFTS_BOUND = 60
FAILING_REQUESTS_MOST = 20
SHORT_TOKENS = 5  # decode steps before a request that does not draft would probe: 8


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("spec-default") / "server.log", ["--log-level", "info"])
    yield srv
    assert srv.stop() == 0, srv.log()[-5000:]


@pytest.fixture(scope="module")
def off_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("spec-off") / "server.log", ["--speculative-config", "off"])
    yield srv
    assert srv.stop() == 0, srv.log()[-5000:]


def complete(srv, prompt: str = PROMPT, max_tokens: int = 40) -> str:
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=600) as client:
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == max_tokens
    return r.choices[0].text


def finished(srv) -> float:
    return srv.metric("kvferry:e2e_request_latency_seconds_count")


def test_the_default_drafts_a_batch_1_repetitive_request_with_off_s_greedy_text(default_server, off_server):
    assert "speculative decoding: auto" in default_server.log()
    before, done = default_server.metric(DRAFTS), finished(default_server)
    text = complete(default_server)
    default_server.wait_for_metric("kvferry:e2e_request_latency_seconds_count", lambda v: v >= done + 1)
    assert default_server.metric(DRAFTS) > before
    assert default_server.metric("kvferry:spec_decode_num_accepted_tokens_total") > 0
    assert complete(off_server) == text


def test_a_batch_1_request_whose_drafts_fail_stops_drafting(default_server):
    """After a repetitive request (batch 1's costs measured, drafts paying),
    one whose repetition penalty keeps the target from every token already
    seen: the drafts of suffix decoding and prompt lookup (copies of earlier
    text) cannot hold, nor most of the head's (which knows of no penalty). It
    drafts only in its first steps and then in rare one-draft probes: the
    draft counter, read from /metrics, grows by far less than k per step."""
    srv = default_server
    done = finished(srv)
    complete(srv)
    srv.wait_for_metric("kvferry:e2e_request_latency_seconds_count", lambda v: v >= done + 1)
    before = srv.metric(DRAFTS)
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=600) as client:
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=FAILING_TOKENS, temperature=0.0,
                                      presence_penalty=2.0,
                                      extra_body={"ignore_eos": True, "repetition_penalty": 10.0})
    assert r.usage.completion_tokens == FAILING_TOKENS
    srv.wait_for_metric("kvferry:e2e_request_latency_seconds_count", lambda v: v >= done + 2)
    drafted = srv.metric(DRAFTS) - before
    # Drafting at every step would be over FAILING_TOKENS; off after a few
    # steps, with probes whose wait doubles from 8 steps, stays far below.
    assert drafted <= FAILING_DRAFTS_BOUND, drafted


def test_off_drafts_nothing(off_server):
    done = finished(off_server)
    complete(off_server)
    off_server.wait_for_metric("kvferry:e2e_request_latency_seconds_count", lambda v: v >= done + 1)
    assert off_server.metric(DRAFTS) == 0 and off_server.metric("kvferry:spec_decode_num_drafts_total") == 0


def test_a_large_batch_drafts_nothing(default_server):
    """While 16 requests decode together (no arrivals after them, so the
    batch only shrinks), the draft counter stands still: each step is the
    plain step. Counters and the running gauge come from one stats snapshot."""
    srv = default_server
    prompts = [f"{PASSAGE}\n\nRepeat the text above, version {i}.\n\n{PASSAGE[:40]}" for i in range(LARGE_BATCH)]
    with ThreadPoolExecutor(LARGE_BATCH) as pool:
        futures = [pool.submit(complete, srv, p, 48) for p in prompts]
        deadline = time.monotonic() + 300
        while srv.metric(RUNNING) < LARGE_BATCH:
            assert time.monotonic() < deadline, "the batch never formed"
            assert not any(f.done() for f in futures), "a request finished before the batch formed"
            time.sleep(0.05)
        first = srv.metrics()
        tokens = first[("kvferry:generation_tokens_total", ())]
        while True:  # some decode steps of the whole batch
            now = srv.metrics()
            if now[("kvferry:generation_tokens_total", ())] >= tokens + 4 * LARGE_BATCH:
                break
            assert time.monotonic() < deadline, "the batch made no progress"
            time.sleep(0.1)
        for f in futures:
            f.result()
    assert now[(RUNNING, ())] >= NO_DRAFTS_FROM, "the batch shrank below the off switch: nothing measured"
    assert now[(DRAFTS, ())] == first[(DRAFTS, ())]


def failing(srv, max_tokens: int, seed: int) -> None:
    """A request whose drafts fail: sampled at temperature 4, where the
    target's next token is close to a draw from its whole vocabulary, so
    drafts copied from earlier text (or the head's guesses) rarely hold.
    (Greedy text under a repetition penalty is no such request here: the
    tenant's suffix tree learns it from the earlier ones, and it holds.)"""
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=600) as client:
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=4.0,
                                      seed=seed, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == max_tokens


def drafted_by(srv, send) -> float:  # noqa: ANN001
    """Draft tokens the request ``send()`` makes, once it is counted finished."""
    done, before = finished(srv), srv.metric(DRAFTS)
    send()
    srv.wait_for_metric("kvferry:e2e_request_latency_seconds_count", lambda v: v >= done + 1)
    return srv.metric(DRAFTS) - before


def test_a_new_request_starts_from_what_recent_requests_measured(default_server):
    """Cross-request learning: after requests whose drafts failed, a new one
    of that kind starts without drafting (a short one drafts nothing: its
    first probe would come 8 steps in); after repetitive requests, a new
    repetitive request drafts from its first steps. How many failed requests
    that takes depends on their luck (at temperature 4 a few drafts still
    hold) and on the step costs measured, so the test sends them one at a
    time and checks a short one after each: without cross-request learning
    every new request starts from the neutral prior, which drafts at once."""
    srv = default_server
    for seed in range(FAILING_REQUESTS_MOST):
        drafted_by(srv, lambda: failing(srv, 16, seed))
        if drafted_by(srv, lambda: failing(srv, SHORT_TOKENS, 1000 + seed)) == 0:
            break
    else:
        pytest.fail(f"after {FAILING_REQUESTS_MOST} failed requests a short one still drafted at its start")
    for _ in range(10):
        drafted_by(srv, lambda: complete(srv, max_tokens=16))
        if drafted_by(srv, lambda: complete(srv, max_tokens=SHORT_TOKENS)) > 0:
            break
    else:
        pytest.fail("after 10 repetitive requests a short one still drafted nothing")
