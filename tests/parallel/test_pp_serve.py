"""A real ``kvferry serve -pp 2`` through the openai client, on tiny random
Llama, Qwen2 and Qwen3 checkpoints of 3 layers (one server a model, shared
by the module's tests): greedy output equals HF transformers (float32),
alone and with concurrent requests cut into micro-batches;
``/v1/admin/workers`` lists the core's two stages with the pids of its real
processes; a stage killed with SIGKILL ends its core whole, after which
the server restarts it and serves again. A standalone ``kvferry
engine-core -pp 2`` joined by a server serves the same text."""
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
from tests.parallel.test_tensor_parallel_serve import _alive, _children, _title
from tests.serve.server_process import start_server
from tests.serve.test_core_join_secret import _free_port_pair, _secret
from tests.serve.test_flag_errors import assert_one_line_error
from tests.tiny_models import make_tiny_checkpoint

PROMPTS = [[5, 17, 33, 100, 200, 7, 7, 9], [11, 12], list(range(40, 100)), [300, 2, 301, 3, 302, 4]]
MAX_NEW = 8


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def served(request, tmp_path_factory):
    """(arch, checkpoint, server -pp 2, each prompt's offline greedy text and HF's token ids)."""
    arch = request.param
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp(f"pp-{arch}"), arch=arch, num_hidden_layers=3,
                                    vocab_size=387, max_position_embeddings=1024))
    hf = load_hf(path)
    offline = LLM(model=path, dtype="float32", kv_cache_memory_gb=0.02)
    try:
        ref = offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    finally:
        offline.engine.core.close()
    for prompt, r in zip(PROMPTS, ref):
        assert r.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_NEW)
    srv = start_server(tmp_path_factory.mktemp(f"pp-{arch}-log") / "server.log",
                       ["--model", path, "--pipeline-parallel-size", "2", "--cpu-threads-per-rank", "1"])
    yield arch, path, srv, [r.outputs[0].text for r in ref]
    assert srv.stop() == 0, srv.log()[-5000:]  # SIGTERM drains: stage 0 stops the other stage


def complete(srv, prompt: list[int]) -> str:
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_NEW
    return r.choices[0].text


def test_served_greedy_output_equals_hf(served):
    _, _, srv, expected = served
    assert complete(srv, PROMPTS[0]) == expected[0]


def test_concurrent_requests_in_micro_batches_equal_hf(served):
    _, _, srv, expected = served
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(lambda p: complete(srv, p), PROMPTS)) == expected


def stages(srv) -> tuple[int, dict]:
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=30)
    assert r.status_code == 200, r.text
    [worker] = r.json()["data"]
    return worker["pid"], worker


def assert_live_stages(srv, name: str = "engine-0") -> list[int]:
    """Two live stages whose pids are the core's real processes: stage 0 is
    the core itself, stage 1 its child titled "kvferry: NAME rank 1"."""
    core, worker = stages(srv)
    assert worker["pipeline_parallel_size"] == 2 and worker["tensor_parallel_size"] == 1, worker
    listed = worker["ranks"]
    assert [r["rank"] for r in listed] == [0, 1] and all(r["alive"] and r["cpu_threads"] == 1 for r in listed)
    assert listed[0]["pid"] == core and _alive(core) and "rank" not in _title(core)
    assert _title(listed[1]["pid"]).startswith(f"kvferry: {name} rank 1") and listed[1]["pid"] in _children(core)
    return [r["pid"] for r in listed]


@pytest.mark.parametrize("served", ["llama"], indirect=True)
def test_admin_workers_lists_the_stages(served):
    _, _, srv, _ = served
    core, worker = assert_live_stages(srv)
    assert core in _children(srv.proc.pid)
    time.sleep(3)  # a heartbeat later: still there, still alive
    assert assert_live_stages(srv) == [core, worker]


@pytest.mark.parametrize("served", ["llama"], indirect=True)
def test_a_standalone_pp_core_joined_by_a_server(served, tmp_path, monkeypatch):
    """``kvferry engine-core -pp 2`` on its own; a server joins it by address,
    lists its two stages and gets HF's text."""
    _, path, _, expected = served
    monkeypatch.delenv(envs.SOCKET_SECRET, raising=False)  # the core and the server agree through the file
    secret = _secret(tmp_path / "secret")
    address = f"tcp://127.0.0.1:{_free_port_pair()}"
    log = tmp_path / "core.log"
    core = subprocess.Popen([sys.executable, "-m", "kvferry.cli", "engine-core", "--address", address,
                             "--name", "engine-pp", "--model", path, "--dtype", "float32", "--num-kv-blocks", "64",
                             "--max-model-len", "1024", "--no-warm-up", "--check-kv-integrity", "-pp", "2",
                             "--cpu-threads-per-rank", "1", "--cache-secret-file", secret],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        srv = start_server(tmp_path / "server.log", ["--data-parallel-size", "0", "--worker", address,
                                                     "--model", path, "--cache-secret-file", secret,
                                                     "--engine-start-timeout", "300"], serve_args=[])
        try:
            pids = assert_live_stages(srv, "engine-pp")
            assert pids[0] == core.pid
            assert complete(srv, PROMPTS[0]) == expected[0]
        finally:
            assert srv.stop() == 0, srv.log()[-3000:]
    finally:
        stop_core(core)
    deadline = time.monotonic() + 30  # a stage exits at its core's word, or once it sees the core gone
    while _alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pids[1]), "a stage outlived its core"
    assert "Traceback" not in log.read_text(errors="replace")


@pytest.mark.parametrize("served", ["llama"], indirect=True)
def test_a_killed_stage_ends_its_core_and_the_server_restarts_it(served):
    _, _, srv, expected = served
    core, stage = assert_live_stages(srv)
    os.kill(stage, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while _alive(core) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(core), "the core outlived its killed stage"
    assert "pipeline stage 1" in srv.log() and "SIGKILL" in srv.log()
    deadline = time.monotonic() + 300
    while True:  # restarted whole (new stages), it serves the same text again
        try:
            assert complete(srv, PROMPTS[0]) == expected[0]
            break
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    pids = assert_live_stages(srv)
    assert not {core, stage} & set(pids)


def test_engine_core_refuses_a_bad_pp_size_in_one_line():
    r = subprocess.run([sys.executable, "-m", "kvferry.cli", "engine-core", "--address", "tcp://127.0.0.1:9",
                        "-pp", "0"], capture_output=True, text=True, timeout=120)
    line = assert_one_line_error(r.returncode, r.stderr)
    assert "pipeline_parallel_size" in line, line
