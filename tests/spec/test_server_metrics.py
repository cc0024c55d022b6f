"""Speculative-decoding counters on a real server's /metrics
(``kvferry serve --speculative-config ...``, the real openai client)."""
from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from tests.serve.server_process import MODEL_NAME, SERVE_ARGS, start_server

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PASSAGE = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
           "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.")


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("spec-server") / "server.log",
                       ["--speculative-config", json.dumps(SPEC)])
    yield srv
    assert srv.stop() == 0, srv.log()[-5000:]


def test_spec_counters_follow_a_copy_request(spec_server):
    srv = spec_server
    before = srv.metrics()
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=120) as client:
        r = client.completions.create(model=MODEL_NAME, prompt=f"{PASSAGE}\n\nRepeat the text above.\n\n{PASSAGE[:60]}",
                                      max_tokens=40, temperature=0.0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40
    srv.wait_for_metric("kvferry:e2e_request_latency_seconds_count", lambda v: v >= 1)
    after = srv.metrics()

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    drafts = delta("kvferry:spec_decode_num_drafts_total")
    draft_tokens = delta("kvferry:spec_decode_num_draft_tokens_total")
    accepted = delta("kvferry:spec_decode_num_accepted_tokens_total")
    per_pos = [delta("kvferry:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))
               for i in range(SPEC["num_speculative_tokens"])]
    assert drafts > 0 and drafts <= draft_tokens <= drafts * SPEC["num_speculative_tokens"]
    # Copying a passage: many drafts hold, so there are far fewer decode steps
    # than tokens. (Per draft token the rate is lower than it would be with
    # backoff: where verification costs about a plain step, k stays high.)
    assert accepted >= 8 and accepted > draft_tokens / 4, (accepted, draft_tokens)
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert after[("kvferry:spec_decode_mean_accepted_length", ())] == pytest.approx(
        1 + after[("kvferry:spec_decode_num_accepted_tokens_total", ())] / after[("kvferry:spec_decode_num_drafts_total", ())])
    # Every output token is either a verified draft or a sampled one, one sample per step.
    assert delta("kvferry:generation_tokens_total") == 40


def test_bad_speculative_config_is_a_usage_error_naming_the_field():
    proc = subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", *SERVE_ARGS,
                           "--speculative-config", '{"num_speculative_tokens": -1}'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "speculative.num_speculative_tokens" in proc.stderr
