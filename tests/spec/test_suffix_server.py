"""Suffix decoding on a real server with two tenants (``kvferry serve
--api-keys ... --speculative-config '{"method": "suffix", ...}'``, the real
openai client): greedy text is plain decoding's, a tenant's repeated
request drafts from its first answer, and another tenant's identical
request drafts exactly as if that answer did not exist (its accepted-draft
count equals the first request's, drafted with an empty tenant trie).

k is fixed (no adaptive or cost-aware controller), so that the drafts, and
so the counts, depend only on the proposer's tries."""
from __future__ import annotations

import json

import openai
import pytest

from kvferry import LLM, SamplingParams
from tests.serve.server_process import MAX_MODEL_LEN, MODEL_NAME, start_server

SPEC = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False, "cost_aware": False}
KEYS = {"sk-a": {"tenant": "a"}, "sk-b": {"tenant": "b"}, "sk-root": {"tenant": "ops", "admin": True}}
PROMPT = ("Here is a Python function:\n\ndef area(width, height):\n    return width * height\n\n"
          "Rewrite it with type hints and a docstring.\n\n")
MAX_TOKENS = 48
ACCEPTED = "kvferry:spec_decode_num_accepted_tokens_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("suffix-server")
    (d / "keys.json").write_text(json.dumps(KEYS))
    (d / "secret").write_bytes(b"0123456789abcdef0123456789abcdef")
    srv = start_server(d / "server.log", ["--api-keys", str(d / "keys.json"), "--cache-secret-file", str(d / "secret"),
                                          "--speculative-config", json.dumps(SPEC)])
    srv.metrics_key = "sk-root"
    yield srv
    assert srv.stop() == 0, srv.log()[-5000:]


def complete(srv, key: str) -> tuple[str, float]:
    """The completion's text and the drafts accepted while it ran."""
    before = srv.metric(ACCEPTED)
    done = srv.metric("kvferry:e2e_request_latency_seconds_count")
    with openai.OpenAI(base_url=srv.api_url, api_key=key, max_retries=0, timeout=300) as client:
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_TOKENS
    srv.wait_for_metric("kvferry:e2e_request_latency_seconds_count", lambda v: v >= done + 1)
    return r.choices[0].text, srv.metric(ACCEPTED) - before


def test_tenant_drafts_from_its_own_answers_only_and_text_is_plain_decodings(server):
    first, accepted_first = complete(server, "sk-a")
    again, accepted_again = complete(server, "sk-a")
    other, accepted_other = complete(server, "sk-b")
    # Tenant a's second request drafts its first answer: nearly all of it holds.
    assert accepted_again >= MAX_TOKENS // 2 and accepted_again > accepted_first + 8, (accepted_first, accepted_again)
    # Tenant b's drafts are those of an empty tenant trie: a's answer never reached them.
    assert accepted_other == accepted_first, (accepted_first, accepted_other, accepted_again)
    plain = LLM(dtype="float32", max_model_len=MAX_MODEL_LEN).generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0].text
    assert first == again == other == plain
