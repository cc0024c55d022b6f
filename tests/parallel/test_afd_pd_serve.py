"""Attention/FFN disaggregation composed with prefill/decode disaggregation:
``kvferry serve --mode disagg --prefill 1 --decode 1 --ffn 1`` on a tiny
random Llama splits the decode pool alone (its core runs attention over
the KV the prefill core sent, the FFN worker its MLPs); greedy output
equals HF transformers (float32), alone and concurrent, and the admin
lists the FFN worker under the decode core only."""
from __future__ import annotations

from functools import partial

import pytest

from tests.parallel.afd_helpers import PROMPTS, complete, complete_all, ffn_pids, reference, servers_at_once, workers
from tests.serve.server_process import start_server
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("afd-pd"), arch="llama", num_hidden_layers=3,
                                    vocab_size=387, max_position_embeddings=1024))
    start = partial(start_server, tmp_path_factory.mktemp("afd-pd-log") / "server.log",
                    ["--model", path, "--mode", "disagg", "--prefill", "1", "--decode", "1", "--ffn", "1",
                     "--cpu-threads-per-rank", "1"])
    with servers_at_once({"pd": start}, meanwhile=partial(reference, path)) as (started, expected):
        yield started["pd"], expected


def test_the_decode_pool_splits_and_the_output_equals_hf(served):
    srv, expected = served
    listed = {w["name"]: w for w in workers(srv)}
    assert sorted(listed) == ["decode-0", "prefill-0"]
    assert listed["prefill-0"]["ffn_workers"] == 0 and listed["prefill-0"]["ranks"] == []
    assert len(ffn_pids(srv, "decode-0")) == 1
    assert complete(srv, PROMPTS[2]) == expected[2]
    assert complete_all(srv, PROMPTS) == expected
    after = {w["name"]: w for w in workers(srv)}
    # The prompts were computed on the prefill core and their KV sent, not computed again on the decode core.
    prefilled, decoded = (after[n]["prompt_tokens_computed"] for n in ("prefill-0", "decode-0"))
    assert prefilled >= sum(map(len, PROMPTS)) and decoded < prefilled, (prefilled, decoded)
