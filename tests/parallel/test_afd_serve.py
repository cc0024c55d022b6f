"""A real ``kvferry serve --mode afd`` on a tiny random Llama (3 layers), at
1+1 and 2+1 attention cores + FFN workers, through the openai client: greedy
output equals HF transformers (float32), alone and concurrent (the step's
two micro-batches ping-pong with the FFN worker); ``/v1/admin/workers``
lists the FFN worker with its real pid, the server's child, and at 2+1 both
attention cores list the same one (they share it); ``kvferry scale
--attention`` adds a core that finds the same worker and drains it again;
64 concurrent streams end with none failed; an FFN worker killed under load
ends the streams in flight, and the server restarts the workers and the
cores and serves the same text again.

One server for the module (started at 1+1): its 2+1 is the core ``kvferry
scale --attention 2`` adds, which is what a server started at 2+1 runs too
(N attention cores are N data-parallel replicas behind the router, all on
the server's FFN workers), so every 2+1 check runs while it is scaled up."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import openai
import pytest

from tests.parallel.afd_helpers import (MAX_NEW, PROMPTS, _alive, _children, complete, complete_all, ffn_pids,
                                        reference, scale, servers_at_once, start_afd, workers)
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("afd-llama"), arch="llama", num_hidden_layers=3,
                                    vocab_size=387, max_position_embeddings=1024))
    # SIGTERM at the end drains: the owner core stops its FFN worker.
    with servers_at_once({"1+1": partial(start_afd, tmp_path_factory.mktemp("afd-1+1"), path, 1, 1)},
                         meanwhile=partial(reference, path)) as (started, expected):
        yield started["1+1"], expected


def check_greedy(srv, expected) -> None:  # noqa: ANN001
    assert complete(srv, PROMPTS[0]) == expected[0]


def check_concurrent(srv, expected) -> None:  # noqa: ANN001
    assert complete_all(srv, PROMPTS) == expected
    # Four times over: at 2+1 the FFN worker batches both cores' rows, and answers in its batches' order.
    assert complete_all(srv, PROMPTS[::-1] * 4) == expected[::-1] * 4


def check_admin(srv, cores: int) -> None:  # noqa: ANN001
    listed = workers(srv)
    assert sorted(w["name"] for w in listed) == [f"engine-{i}" for i in range(cores)]
    shared = [ffn_pids(srv, w["name"]) for w in listed]
    assert all(p == shared[0] for p in shared), shared  # one FFN worker serves every attention core
    assert shared[0][0] in _children(srv.proc.pid)  # the server's, not one core's


def test_greedy_output_equals_hf(served):
    check_greedy(*served)


def test_concurrent_requests_equal_hf(served):
    check_concurrent(*served)


def test_admin_lists_the_ffn_worker(served):
    check_admin(served[0], 1)


def test_kvferry_scale_adds_and_drains_attention_cores_on_the_same_ffn_worker(served):
    """Scaled up, the server is at 2+1: the 2+1 checks run there."""
    srv, expected = served
    [ffn] = ffn_pids(srv)
    up = scale(srv, "--attention", "2")
    assert up.returncode == 0, up.stdout + up.stderr
    assert sorted(w["name"] for w in workers(srv)) == ["engine-0", "engine-1"]
    assert ffn_pids(srv, "engine-1") == [ffn]  # the new core found the server's FFN worker
    check_admin(srv, 2)
    check_greedy(srv, expected)
    check_concurrent(srv, expected)
    down = scale(srv, "--attention", "1")
    assert down.returncode == 0, down.stdout + down.stderr
    assert len(workers(srv)) == 1 and ffn_pids(srv, workers(srv)[0]["name"]) == [ffn]
    assert complete_all(srv, PROMPTS) == expected


def test_64_concurrent_streams_none_failed(served):
    srv, _ = served

    def stream(i: int) -> int:
        with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300) as client:
            chunks = client.completions.create(model=client.models.list().data[0].id, prompt=[5 + i, 17, 33 + i],
                                               max_tokens=MAX_NEW, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            return sum(1 for c in chunks if c.choices and c.choices[0].text)

    with ThreadPoolExecutor(64) as pool:
        counts = list(pool.map(stream, range(64)))
    assert len(counts) == 64 and all(n >= 1 for n in counts), counts


def test_a_killed_ffn_worker_ends_the_streams_in_flight_and_the_server_serves_again(served):
    srv, expected = served
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
            time.sleep(0.2)
    assert ffn_pids(srv) != [ffn]
