"""Resizing a live ``kvferry serve --mode afd``'s FFN workers (a tiny random
Qwen3-MoE, 8 experts, top-2; one server for the module, started at 1+1):

- ``kvferry scale --ffn 2`` under four clients' streams: every stream ends
  with all its tokens (each core moves to the new workers between two steps),
  the admin lists two new FFN workers (4 experts each), the old one exits,
  and greedy output still equals HF transformers;
- ``kvferry scale --attention 2 --ffn 1`` together: the workers first,
  then a second core that finds them; back to 1+1 the same way;
- a count the model does not split over, or out of range, is refused in
  one line and the server keeps serving;
- an FFN worker killed while the core is idle: requests sent at once do
  not fail (the idle core waits at its next step for the workers the pool
  restarts, instead of ending), and the core is never restarted."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from kvferry.shm_segments import pid_alive
from tests.parallel.afd_helpers import PROMPTS, _alive, complete_all, ffn_pids, reference, start_afd, workers
from tests.tiny_moe_models import make_tiny_moe_checkpoint

SHORT = 24  # tokens of each stream of the load that spans a resize


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(make_tiny_moe_checkpoint(tmp_path_factory.mktemp("afd-scale-moe"), "qwen3_moe_top2",
                                        max_position_embeddings=1024))
    expected = reference(path)
    srv = start_afd(tmp_path_factory.mktemp("afd-scale"), path, 1, 1)
    yield srv, expected
    assert srv.stop() == 0, srv.log()[-5000:]


def scale(srv, *argv: str) -> subprocess.CompletedProcess:  # noqa: ANN001
    return subprocess.run([sys.executable, "-m", "kvferry.cli", "scale", "--url", srv.base_url, *argv],
                          capture_output=True, text=True, timeout=600)


def _wait_gone(pids: list[int], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, pids)), f"a retired FFN worker is still running: {pids}"


def _listed(srv, count: int, name: str = "engine-0", timeout_s: float = 60) -> list[int]:  # noqa: ANN001
    """The FFN workers core ``name`` lists once it lists ``count`` (its
    heartbeat carries them; a core moves to new workers at its next step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        [worker] = [w for w in workers(srv) if w["name"] == name]
        if worker["ffn_workers"] == count or time.monotonic() > deadline:
            return ffn_pids(srv, name, count)
        time.sleep(0.2)


def _stream_until(srv, i: int, done: threading.Event, started: threading.Barrier, outcomes: list) -> None:  # noqa: ANN001
    """Streams one after another until ``done`` (and one more after it),
    each ``SHORT`` tokens: the load spans the resize however fast this machine is."""
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300) as client:
        model, first = client.models.list().data[0].id, True
        while True:
            last = done.is_set()
            try:
                chunks = client.completions.create(model=model, prompt=[7 + i, 8, 9], max_tokens=SHORT,
                                                   temperature=0, stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
                tokens = 0
                for chunk in chunks:
                    if first:
                        started.wait(120)
                        first = False
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                outcomes.append(tokens)
            except openai.APIError as exc:
                outcomes.append(f"failed: {exc}")
            if last:
                return


def test_scale_ffn_while_streams_run(served):
    srv, expected = served
    [old] = ffn_pids(srv)
    started, done, outcomes = threading.Barrier(5), threading.Event(), []
    threads = [threading.Thread(target=_stream_until, args=(srv, i, done, started, outcomes)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(120)  # every client streams: the resize happens under them
    up = scale(srv, "--ffn", "2")
    done.set()
    assert up.returncode == 0, up.stdout + up.stderr
    assert "ffn workers: 1 -> 2" in up.stdout, up.stdout
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a stream hung across the resize"
    assert len(outcomes) >= 8 and outcomes == [SHORT] * len(outcomes), outcomes  # none failed, none cut short
    assert complete_all(srv, PROMPTS) == expected  # 4 experts on each worker, partial sums added
    new = _listed(srv, 2)
    assert old not in new
    _wait_gone([old])  # retired once idle


def test_scale_attention_and_ffn_together(served):
    srv, expected = served
    before = _listed(srv, 2)
    up = scale(srv, "--attention", "2", "--ffn", "1")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "ffn workers: 2 -> 1" in up.stdout, up.stdout
    assert sorted(w["name"] for w in workers(srv)) == ["engine-0", "engine-1"]
    [ffn] = _listed(srv, 1, "engine-1")  # the new core found the new worker
    assert ffn not in before
    assert complete_all(srv, PROMPTS * 2) == expected * 2
    _wait_gone(before)  # every core moved off the old workers
    down = scale(srv, "--attention", "1")
    assert down.returncode == 0, down.stdout + down.stderr
    assert len(workers(srv)) == 1


def test_a_count_that_does_not_split_is_refused_and_the_server_keeps_serving(served):
    srv, expected = served
    bad = scale(srv, "--ffn", "3")
    assert bad.returncode == 2 and "--ffn 3:" in bad.stderr and "divisible" in bad.stderr, bad.stderr
    r = httpx.post(f"{srv.base_url}/v1/admin/scale", json={"ffn": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ffn", r.text
    r = httpx.post(f"{srv.base_url}/v1/admin/scale", json={"ffn": "2"}, timeout=30)
    assert r.status_code == 400, r.text
    r = httpx.post(f"{srv.base_url}/v1/admin/scale", json={}, timeout=30)  # no count at all
    assert r.status_code == 400, r.text
    assert complete_all(srv, PROMPTS) == expected
    assert httpx.get(f"{srv.base_url}/v1/admin/scale", timeout=30).json()["ffn_workers"] == 1


def test_no_request_fails_once_an_idle_cores_ffn_worker_died(served):
    srv, expected = served
    complete_all(srv, PROMPTS)  # the core has stepped on the current workers
    [ffn] = ffn_pids(srv)
    restarts = srv.log().count("FFN workers restarted")
    os.kill(ffn, signal.SIGKILL)
    # SIGKILL returns before the worker has exited; a request that reached
    # the core first would step on it and be cut by the death (the core then
    # ends whole, as the leader's rule says). The case here is the idle
    # core's: the death lies before its next step.
    deadline = time.monotonic() + 30
    while pid_alive(ffn) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not pid_alive(ffn), f"FFN worker {ffn} survived SIGKILL"
    # At once, while the pool restarts the workers: the idle core's next
    # step waits for the new one instead of failing its requests.
    assert complete_all(srv, PROMPTS) == expected
    assert srv.log().count("FFN workers restarted") == restarts + 1
    [new] = map(int, re.findall(r"FFN workers restarted \(pids (\d+)\)", srv.log())[-1:])
    deadline = time.monotonic() + 60
    while workers(srv)[0]["ranks"][1]["pid"] != new and time.monotonic() < deadline:
        time.sleep(0.2)  # the core's next heartbeat lists it
    assert ffn_pids(srv) == [new]
    assert workers(srv)[0]["num_restarts"] == 0  # the core itself never ended
