"""Prefill/decode disaggregation between pools of different pipeline-parallel
sizes, through the real server and the openai client, on a tiny random
Llama of 3 layers (stages of 2 hold layers [0, 2) and [2, 3)):

- P(pp 2) / D(pp 1): a prefill core started apart (``kvferry engine-core
  -pp 2 --kv-transfer-address``) joined by a server whose decode core runs
  one stage; each prefill stage sends the layers it holds as it computes them
  (prompts alone, and together in steps cut into 2 micro-batches).
- P(pp 1) / D(pp 2): ``kvferry serve --mode disagg --decode-pp 2``; the
  decode core's stage 0 receives every layer into the stage that holds it.

Greedy output equals colocated PP 1 and HF transformers in float32.
``--kv-transfer-failure fail``: a transfer that did not land whole fails the
request instead of being recomputed, so equal text means the layers moved
right. A decode stage killed with SIGKILL restarts its core at its size."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kvferry import LLM, SamplingParams, envs
from tests.parallel.ranks import stop_core
from tests.engine.hf_reference import hf_greedy, load_hf
from tests.serve.server_process import start_server
from tests.serve.test_core_join_secret import _free_port_pair, _secret
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 8
# A short prompt, one the prefill core computes in several chunks
# (--max-num-batched-tokens 48), one ending on a block edge.
PROMPTS = [
    [5, 17, 33, 100, 200, 7, 7, 9],
    [(i * 37 + 11) % 380 + 3 for i in range(150)],
    [(i * 53 + 5) % 380 + 3 for i in range(64)],
]
SERVE = ["--mode", "disagg", "--decode", "1", "--cpu-threads-per-rank", "1", "--max-num-batched-tokens", "48",
         "--kv-transfer-failure", "fail", "--engine-heartbeat-timeout", "120", "--engine-start-timeout", "300"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("pd-pp"), num_hidden_layers=3, vocab_size=387,
                                    max_position_embeddings=1024))


def _expected(checkpoint: str) -> list[str]:
    """Colocated PP 1's greedy text of each prompt, whose tokens are HF float32's."""
    hf = load_hf(checkpoint)
    offline = LLM(model=checkpoint, dtype="float32", kv_cache_memory_gb=0.02)
    try:
        results = offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    finally:
        offline.engine.core.close()
    assert [r.outputs[0].token_ids for r in results] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    return [r.outputs[0].text for r in results]


@pytest.fixture(scope="module")
def started(checkpoint, tmp_path_factory):
    """(server --decode-pp 2, expected texts): the server starts while HF and
    the offline engine compute the expected text (they overlap on two cores)."""
    log = tmp_path_factory.mktemp("pd-pp-d2") / "server.log"
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start_server, log, ["--model", checkpoint, *SERVE, "--prefill", "1",
                                                   "--prefill-pp", "1", "--decode-pp", "2"])
        try:
            texts = _expected(checkpoint)
        except BaseException:
            if starting.exception() is None:
                starting.result().stop()
            raise
    srv = starting.result()
    yield srv, texts
    assert srv.stop() == 0, srv.log()[-5000:]


@pytest.fixture(scope="module")
def expected(started) -> list[str]:
    return started[1]


@pytest.fixture(scope="module")
def decode_pp2(started):
    return started[0]


def _greedy(srv, prompt: list[int]) -> str:
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300) as client:
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_NEW
    return r.choices[0].text


def _workers(srv) -> dict[str, dict]:
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=30)
    assert r.status_code == 200, r.text
    return {w["name"]: w for w in r.json()["data"]}


def test_prefill_pp1_decode_pp2_equals_colocated_and_hf(decode_pp2, expected):
    for prompt, want in zip(PROMPTS, expected):
        assert _greedy(decode_pp2, prompt) == want, len(prompt)
    assert _greedy(decode_pp2, PROMPTS[1]) == expected[1]  # a prefix hit on the decode core: only the tail moves
    workers = _workers(decode_pp2)
    assert workers["decode-0"]["pipeline_parallel_size"] == 2 and len(workers["decode-0"]["ranks"]) == 2
    assert workers["prefill-0"]["pipeline_parallel_size"] == 1
    log = decode_pp2.log()
    assert "KV transfer failed" not in log and "Traceback" not in log, log[-3000:]


def test_a_killed_decode_stage_restarts_its_core_at_its_size(decode_pp2, expected):
    old = _workers(decode_pp2)["decode-0"]
    os.kill(old["ranks"][1]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 300
    while True:
        new = _workers(decode_pp2)["decode-0"]
        if new["pid"] != old["pid"] and new["alive"] and new["ranks"] and all(r["alive"] for r in new["ranks"]):
            break
        assert time.monotonic() < deadline, decode_pp2.log()[-3000:]
        time.sleep(0.5)
    assert new["pipeline_parallel_size"] == 2 and len(new["ranks"]) == 2
    deadline = time.monotonic() + 120
    while True:  # the router takes the new core once its handshake is done
        try:
            assert _greedy(decode_pp2, PROMPTS[1]) == expected[1]
            break
        except openai.APIError:
            assert time.monotonic() < deadline, decode_pp2.log()[-3000:]
            time.sleep(0.2)


def test_prefill_pp2_started_apart_decode_pp1(checkpoint, expected, tmp_path, monkeypatch):
    """``kvferry engine-core -pp 2 --kv-transfer-address`` as the prefill
    pool, joined by a server whose decode core runs one stage."""
    monkeypatch.delenv(envs.SOCKET_SECRET, raising=False)  # the core and the server agree through the file
    secret = _secret(tmp_path / "secret")
    address = f"tcp://127.0.0.1:{_free_port_pair()}"
    log = tmp_path / "prefill.log"
    core = subprocess.Popen([sys.executable, "-m", "kvferry.cli", "engine-core", "--address", address,
                             "--name", "prefill-apart", "--model", checkpoint, "--dtype", "float32",
                             "--num-kv-blocks", "64", "--max-model-len", "1024", "--no-warm-up",
                             "--max-num-batched-tokens", "48", "-pp", "2", "--pp-micro-batches", "2",
                             "--cpu-threads-per-rank", "1",
                             "--kv-transfer-address", "tcp://127.0.0.1:0", "--cache-secret-file", secret],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        srv = start_server(tmp_path / "server.log", ["--model", checkpoint, *SERVE, "--prefill", "0",
                                                     "--decode-pp", "1", "--worker", f"prefill={address}",
                                                     "--cache-secret-file", secret])
        try:
            for prompt, want in zip(PROMPTS, expected):
                assert _greedy(srv, prompt) == want, len(prompt)
            # Together: a step of several prompts cut into 2 micro-batches, whose last sends each layer
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                assert list(pool.map(lambda p: _greedy(srv, p), PROMPTS)) == expected
            assert _workers(srv)["prefill-0"]["pipeline_parallel_size"] == 2
        finally:
            assert srv.stop() == 0, srv.log()[-3000:]
    finally:
        stop_core(core)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
