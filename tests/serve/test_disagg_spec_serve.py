"""``kvferry serve --mode disagg --speculative-config ...``: real processes
(a prefill core and a decode core), real HTTP through the openai client.
For each method, greedy text equals plain colocated decoding, the decode
core drafts (and accepts) while computing no prompt position, and a decode
core whose speculation differs from the server's is refused at join. (The
engine-level tests, tests/disagg/test_disagg_spec.py, show the decode
core's draft counters equal colocated speculation's.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from kvferry import LLM, SamplingParams
from tests.serve.server_process import ServerProcess, start_server
from tests.serve.test_router import _core_args, _free_port_pair, _workers
from tests.disagg.test_disagg_spec import repetitive_prompt
from tests.tiny_models import make_tiny_checkpoint, make_random_head

TINY = "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("disagg-spec-serve"), arch="llama",
                                    num_hidden_layers=2, max_position_embeddings=1024))


def tiny_prompt() -> list[int]:
    """Every id once, then a passage three times: prompt lookup finds a
    match whatever the first token, and the tiny model's greedy loops."""
    return repetitive_prompt()


def serve_disagg(tmp_path, spec: dict, model: list[str]) -> ServerProcess:
    return start_server(tmp_path / "server.log", [*model, "--mode", "disagg", "--prefill", "1", "--decode", "1",
                                                  "--speculative-config", json.dumps(spec),
                                                  "--cache-secret-file", cache_secret(tmp_path)])


def cache_secret(tmp_path) -> str:
    """The file the server and a core joining it apart share (else the join is refused)."""
    path = tmp_path / "cache-secret"
    if not path.exists():
        path.write_text(os.urandom(32).hex())
    return str(path)


def complete(srv: ServerProcess, model: str, prompt: list[int], max_tokens: int) -> str:
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=180) as client:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == max_tokens
    return r.choices[0].text


def plain_text(llm: LLM, prompt: list[int], max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([prompt], params)[0].outputs[0].text


def check_decode_core(srv: ServerProcess, num_prompt_tokens: int, accepts: bool = True) -> dict:
    """The decode core drafted, accepted, and computed no prompt position;
    the prefill core computed the whole prompt."""
    workers = _workers(srv)
    decode, prefill = workers["decode-0"], workers["prefill-0"]
    assert decode["num_drafts"] > 0 and decode["num_draft_tokens"] > 0, decode
    if accepts:
        assert decode["num_accepted_tokens"] > 0, decode
    assert decode["prompt_tokens_computed"] == 0 and decode["draft_prompt_tokens_computed"] == 0, decode
    assert prefill["prompt_tokens_computed"] == num_prompt_tokens, prefill
    assert prefill["num_drafts"] == 0  # a prefill core never decodes
    return workers


@pytest.fixture(scope="module")
def head_file(tiny, tmp_path_factory):
    return make_random_head(tiny, tmp_path_factory.mktemp("disagg-spec-serve-head"))


@pytest.mark.parametrize("method", ["ngram", "head", "draft"])
def test_tiny_model_greedy_equals_plain_and_decode_recomputes_nothing(tiny, head_file, tmp_path, method):
    # k fixed: on a loaded 2-core box the cost-aware controller may stop drafting
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False,
            "cost_aware": False}
    if method == "draft":
        spec["model"] = tiny  # the target as its own draft: its greedy drafts all hold
    elif method == "head":
        spec["model"] = head_file  # random: it drafts from the first step, rarely right
    srv = serve_disagg(tmp_path, spec, ["--model", tiny, "--served-model-name", TINY])
    try:
        prompt = tiny_prompt()
        text = complete(srv, TINY, prompt, 40)
        assert text == plain_text(LLM(model=tiny, dtype="float32"), prompt, 40)
        workers = check_decode_core(srv, len(prompt), accepts=method != "head")
        signature = workers["decode-0"]["speculative"]
        assert workers["prefill-0"]["speculative"] == signature
        assert signature == method if method != "draft" else signature.startswith("draft:")
        if method == "draft":
            assert workers["prefill-0"]["draft_prompt_tokens_computed"] == len(prompt)
        if method == "head":
            _join_is_refused_for_other_speculation(srv, tiny, tmp_path)
    finally:
        assert srv.stop() == 0, srv.log()[-5000:]


def _join_is_refused_for_other_speculation(srv: ServerProcess, tiny: str, tmp_path) -> None:
    """A decode core started with speculation off cannot join a head pair
    (the head's hidden state travels with the KV): the 400 names the field
    and both values. Token-only methods ship nothing, so their pairs agree
    with any of them (spec.shipped)."""
    address = f"tcp://127.0.0.1:{_free_port_pair()}"
    log = open(tmp_path / "core.log", "w")
    core = subprocess.Popen([sys.executable, "-m", "kvferry.cli", "engine-core", "--address", address,
                             "--name", "decode-plain", "--model", tiny, *_core_args(),
                             "--cache-secret-file", cache_secret(tmp_path), "--speculative-config", "off",
                             "--kv-transfer-address", "tcp://127.0.0.1:0"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        r = httpx.post(f"{srv.base_url}/v1/admin/workers", json={"address": address, "role": "decode"}, timeout=240)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "speculative" in message and "'head'" in message and "''" in message, message
        assert "decode-plain" not in _workers(srv)
    finally:
        core.send_signal(signal.SIGTERM)
        assert core.wait(60) == 0, (tmp_path / "core.log").read_text()[-3000:]
