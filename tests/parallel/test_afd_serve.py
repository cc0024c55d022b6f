"""A real ``kvferry serve --mode afd`` on a tiny random Llama (3 layers), at
1+1 and 2+1 attention cores + FFN workers (one server a layout, shared by
the module's tests), through the openai client: greedy output equals HF
transformers (float32), alone and concurrent (the step's two micro-batches
ping-pong with the FFN worker); ``/v1/admin/workers`` lists the FFN worker
with its real pid, the server's child, and at 2+1 both attention cores
list the same one (they share it); ``kvferry scale --attention`` adds a
core that finds the same worker and drains it again; 64 concurrent
streams end with none failed; an FFN worker killed under load ends the
streams in flight, and the server restarts the workers and the cores and
serves the same text again."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.parallel.afd_helpers import (MAX_NEW, PROMPTS, _alive, _children, complete, complete_all, ffn_pids,
                                        reference, start_afd, workers)
from tests.tiny_models import make_tiny_checkpoint

LAYOUTS = {"1+1": (1, 1), "2+1": (2, 1)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("afd-llama"), arch="llama", num_hidden_layers=3,
                                    vocab_size=387, max_position_embeddings=1024))
    return path, reference(path)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request, checkpoint, tmp_path_factory):
    path, expected = checkpoint
    attention, ffn = LAYOUTS[request.param]
    srv = start_afd(tmp_path_factory.mktemp(f"afd-{request.param}"), path, attention, ffn)
    yield request.param, srv, expected
    assert srv.stop() == 0, srv.log()[-5000:]  # SIGTERM drains: the owner core stops its FFN worker


def test_greedy_output_equals_hf(served):
    _, srv, expected = served
    assert complete(srv, PROMPTS[0]) == expected[0]


def test_concurrent_requests_equal_hf(served):
    _, srv, expected = served
    assert complete_all(srv, PROMPTS) == expected
    # Four times over: at 2+1 the FFN worker batches both cores' rows, and answers in its batches' order.
    assert complete_all(srv, PROMPTS[::-1] * 4) == expected[::-1] * 4


def test_admin_lists_the_ffn_worker(served):
    layout, srv, _ = served
    listed = workers(srv)
    assert sorted(w["name"] for w in listed) == [f"engine-{i}" for i in range(LAYOUTS[layout][0])]
    shared = [ffn_pids(srv, w["name"]) for w in listed]
    assert all(p == shared[0] for p in shared), shared  # one FFN worker serves every attention core
    assert shared[0][0] in _children(srv.proc.pid)  # the server's, not one core's


@pytest.mark.parametrize("served", ["1+1"], indirect=True)
def test_kvferry_scale_adds_and_drains_attention_cores_on_the_same_ffn_worker(served):
    _, srv, expected = served
    [ffn] = ffn_pids(srv)
    up = scale(srv, "--attention", "2")
    assert up.returncode == 0, up.stdout + up.stderr
    assert sorted(w["name"] for w in workers(srv)) == ["engine-0", "engine-1"]
    assert ffn_pids(srv, "engine-1") == [ffn]  # the new core found the server's FFN worker
    assert complete_all(srv, PROMPTS) == expected
    down = scale(srv, "--attention", "1")
    assert down.returncode == 0, down.stdout + down.stderr
    assert len(workers(srv)) == 1 and ffn_pids(srv, workers(srv)[0]["name"]) == [ffn]
    assert complete_all(srv, PROMPTS) == expected


def scale(srv, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvferry.cli", "scale", "--url", srv.base_url, *argv],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("served", ["1+1"], indirect=True)
def test_64_concurrent_streams_none_failed(served):
    _, srv, _ = served

    def stream(i: int) -> int:
        with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300) as client:
            chunks = client.completions.create(model=client.models.list().data[0].id, prompt=[5 + i, 17, 33 + i],
                                               max_tokens=MAX_NEW, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            return sum(1 for c in chunks if c.choices and c.choices[0].text)

    with ThreadPoolExecutor(64) as pool:
        counts = list(pool.map(stream, range(64)))
    assert len(counts) == 64 and all(n >= 1 for n in counts), counts


@pytest.mark.parametrize("served", ["1+1"], indirect=True)
def test_a_killed_ffn_worker_ends_the_streams_in_flight_and_the_server_serves_again(served):
    _, srv, expected = served
    [core] = [w["pid"] for w in workers(srv)]
    [ffn] = ffn_pids(srv)
    started, outcomes = threading.Barrier(5), []

    def long_stream(i: int) -> None:
        try:
            with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300) as client:
                chunks = client.completions.create(model=client.models.list().data[0].id, prompt=[7 + i, 8],
                                                   max_tokens=400, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True})
                first = True
                for _ in chunks:
                    if first:
                        started.wait(120)
                        first = False
            outcomes.append("done")
        except openai.APIError as exc:
            outcomes.append(f"failed: {exc}")

    threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(120)  # every stream has its first token
    os.kill(ffn, signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a stream hung after its FFN worker died"
    assert len(outcomes) == 4 and any(o.startswith("failed") for o in outcomes), outcomes
    deadline = time.monotonic() + 60
    while _alive(core) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(core), "the attention core outlived its FFN worker"
    assert "FFN worker 1" in srv.log() and "SIGKILL" in srv.log()  # the core's line, the server's pool's
    deadline = time.monotonic() + 300
    while True:  # restarted whole (a new FFN worker), it serves the same text again
        try:
            assert complete_all(srv, PROMPTS) == expected
            break
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    assert ffn_pids(srv) != [ffn]
