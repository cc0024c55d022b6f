"""Prefill/decode disaggregation between pools of different tensor-parallel
sizes: a real ``kvferry serve --mode disagg --prefill-tp A --decode-tp B``
through the openai client. The prefill ranks send each decode rank exactly
the KV heads it holds (kvferry.disagg.heads), layer by layer, and the
greedy output equals colocated serving at TP 1 and HF transformers in
float32, on tiny random-weight Llama and Qwen2 configs.

``--kv-transfer-failure fail``: a transfer that did not land whole fails the
request (HTTP 503) instead of being recomputed on the decode core, so equal
output here means the resharded KV itself was right."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from kvferry import LLM, SamplingParams, envs
from tests.parallel.prefetch import ServerPipeline
from tests.parallel.ranks import stop_core
from tests.engine.hf_reference import hf_greedy, load_hf
from tests.serve.server_process import start_server
from tests.serve.test_core_join_secret import _free_port_pair, _secret
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 8
# A short prompt (one partial block), one over several blocks that the
# prefill core computes in several chunks (--max-num-batched-tokens 48: a
# block sent partly, then again whole), and one that ends on a block edge.
PROMPTS = [
    [5, 17, 33, 100, 200, 7, 7, 9],
    [(i * 37 + 11) % 380 + 3 for i in range(150)],
    [(i * 53 + 5) % 380 + 3 for i in range(64)],
]
# (arch, prefill ranks, decode ranks, transport): over tcp the decode core's
# rank 0 copies each piece into the rank that holds its heads.
LAYOUTS = [("llama", 2, 1, "shm"), ("llama", 1, 2, "shm"), ("qwen2", 2, 1, "shm"), ("qwen2", 1, 2, "shm"),
           ("llama", 2, 2, "shm"), ("qwen2", 2, 1, "tcp"), ("llama", 1, 2, "tcp")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pd-tp")
    return {arch: str(make_tiny_checkpoint(root, arch=arch, num_attention_heads=8, num_key_value_heads=4,
                                           vocab_size=387, max_position_embeddings=1024))
            for arch in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def expected(checkpoints, pd_pipeline) -> dict[str, list[str]]:
    """Per arch: colocated TP 1's greedy text of each prompt, whose tokens
    are HF float32's. (After pd_pipeline: the first server starts meanwhile.)"""
    out = {}
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for arch, path in checkpoints.items():
        hf = load_hf(path)
        results = LLM(model=path, dtype="float32", kv_cache_memory_gb=0.02).generate(PROMPTS, params)
        assert [r.outputs[0].token_ids for r in results] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
        out[arch] = [r.outputs[0].text for r in results]
    return out


def _start(checkpoints, tmp_path_factory, layout):
    arch, prefill_tp, decode_tp, transport = layout
    log = tmp_path_factory.mktemp(f"pd-tp-{arch}-{prefill_tp}-{decode_tp}") / "server.log"
    return start_server(log, ["--model", checkpoints[arch], "--mode", "disagg", "--prefill", "1", "--decode", "1",
                              "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
                              "--kv-transport", transport,
                              "--cpu-threads-per-rank", "1", "--max-num-batched-tokens", "48",
                              "--kv-transfer-failure", "fail", "--engine-heartbeat-timeout", "120"])


@pytest.fixture(scope="module")
def pd_pipeline(request, checkpoints, tmp_path_factory):
    """The next layout's server starts while this layout's tests run."""
    pipe = ServerPipeline(request.session, "pd_server", lambda layout: _start(checkpoints, tmp_path_factory, layout),
                          lambda srv: srv.stop())
    yield pipe
    pipe.close()


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda x: f"{x[0]}-p{x[1]}-d{x[2]}-{x[3]}")
def pd_server(request, pd_pipeline):
    arch, prefill_tp, decode_tp, _ = request.param
    srv = pd_pipeline.take(request.param)
    yield arch, prefill_tp, decode_tp, srv
    assert srv.stop() == 0, srv.log()[-5000:]


def _greedy(srv, prompt: list[int], stream: bool = False) -> str:
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300) as client:
        model = client.models.list().data[0].id
        kwargs = dict(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True})
        if stream:
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
        r = client.completions.create(**kwargs)
    assert r.usage.completion_tokens == MAX_NEW
    return r.choices[0].text


def test_greedy_output_equals_colocated_tp1_and_hf(expected, pd_server):  # expected first: see its fixture
    arch, prefill_tp, decode_tp, srv = pd_server
    for prompt, want in zip(PROMPTS, expected[arch]):
        assert _greedy(srv, prompt) == want, (arch, prefill_tp, decode_tp, len(prompt))
    assert _greedy(srv, PROMPTS[1], stream=True) == expected[arch][1]
    # A repeat hits the decode core's prefix cache: only the tail is sent.
    assert _greedy(srv, PROMPTS[1]) == expected[arch][1]
    log = srv.log()
    assert "KV transfer failed" not in log and "Traceback" not in log, log[-3000:]


def test_each_pool_runs_its_own_ranks(pd_server):
    _, prefill_tp, decode_tp, srv = pd_server
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=30)
    assert r.status_code == 200, r.text
    sizes = {w["name"]: (w["tensor_parallel_size"], len(w["ranks"]) or 1) for w in r.json()["data"]}
    assert sizes == {"prefill-0": (prefill_tp, prefill_tp), "decode-0": (decode_tp, decode_tp)}, sizes


def test_pools_started_apart_each_with_its_own_tp(checkpoints, expected, tmp_path, monkeypatch):
    """A prefill core started on its own with ``kvferry engine-core -tp 2
    --kv-transfer-address``, joined by a server whose one decode core runs
    ``--decode-tp 1``: the same text."""
    monkeypatch.delenv(envs.SOCKET_SECRET, raising=False)  # the core and the server agree through the file
    secret = _secret(tmp_path / "secret")
    address = f"tcp://127.0.0.1:{_free_port_pair()}"
    log = tmp_path / "prefill.log"
    core = subprocess.Popen([sys.executable, "-m", "kvferry.cli", "engine-core", "--address", address,
                             "--name", "prefill-apart", "--model", checkpoints["llama"], "--dtype", "float32",
                             "--num-kv-blocks", "64", "--max-model-len", "1024", "--no-warm-up",
                             "--max-num-batched-tokens", "48", "-tp", "2", "--cpu-threads-per-rank", "1",
                             "--kv-transfer-address", "tcp://127.0.0.1:0", "--cache-secret-file", secret],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        srv = start_server(tmp_path / "server.log", [
            "--model", checkpoints["llama"], "--mode", "disagg", "--prefill", "0", "--decode", "1",
            "--decode-tp", "1", "--worker", f"prefill={address}", "--cache-secret-file", secret,
            "--kv-transfer-failure", "fail", "--engine-start-timeout", "300"])
        try:
            for prompt, want in zip(PROMPTS, expected["llama"]):
                assert _greedy(srv, prompt) == want
        finally:
            assert srv.stop() == 0, srv.log()[-3000:]
    finally:
        stop_core(core)
    assert "Traceback" not in log.read_text(errors="replace")


def test_a_killed_decode_rank_restarts_its_pool_core_at_its_size(pd_server, expected):
    """A decode worker rank SIGKILLed ends its core whole; the server starts
    it again with --decode-tp's ranks (not -tp's), and P/D serves the same
    text through the new ranks' pools."""
    arch, prefill_tp, decode_tp, srv = pd_server
    if (arch, prefill_tp, decode_tp) != ("llama", 1, 2):
        pytest.skip("one layout is enough")
    old = _workers(srv)["decode-0"]
    os.kill(old["ranks"][1]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 300
    while True:
        workers = _workers(srv)
        new = workers["decode-0"]
        if new["pid"] != old["pid"] and new["alive"] and new["ranks"] and all(r["alive"] for r in new["ranks"]):
            break
        assert time.monotonic() < deadline, srv.log()[-3000:]
        time.sleep(0.5)
    assert new["tensor_parallel_size"] == 2 and len(new["ranks"]) == 2
    assert workers["prefill-0"]["tensor_parallel_size"] == 1
    deadline = time.monotonic() + 120
    while True:  # the router takes the new core once its handshake is done
        try:
            assert _greedy(srv, PROMPTS[1]) == expected[arch][1]
            break
        except openai.APIError:
            assert time.monotonic() < deadline, srv.log()[-3000:]
            time.sleep(0.2)


def _workers(srv) -> dict[str, dict]:
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=30)
    assert r.status_code == 200, r.text
    return {w["name"]: w for w in r.json()["data"]}
