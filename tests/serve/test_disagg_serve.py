"""``kvferry serve --mode disagg``: a router over prefill and decode cores,
through real processes, real HTTP (the openai client) and real signals.
Greedy and seeded outputs are identical to a colocated server, streamed and
not; a prefill core killed before the first token is replaced by another."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.serve.server_process import MODEL_NAME, ServerProcess, start_server
from tests.serve.test_router import PROMPTS, _all_greedy, _client, _greedy, _workers


LEASE_S = 6


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("disagg") / "server.log",
                       ["--mode", "disagg", "--prefill", "2", "--decode", "1",
                        # Short leases, so that a frozen prefill core is given up on fast.
                        "--kv-transfer-timeout-s", str(LEASE_S),
                        # The tests freeze prefill cores on purpose (stuck transfers), longer than a
                        # loaded machine keeps within the default heartbeat deadline: not hangs.
                        "--engine-heartbeat-timeout", "120"])
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"


def test_cores_are_named_by_role(disagg):
    workers = _workers(disagg)
    assert {w["name"]: w["role"] for w in workers.values()} == {
        "prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}
    for name, w in workers.items():
        with open(f"/proc/{w['pid']}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == f"kvferry: {name}".encode()


def test_greedy_identical_to_colocated_streamed_and_not(disagg, client):
    expected = _all_greedy(client, PROMPTS)
    with _client(disagg) as c:
        assert _all_greedy(c, PROMPTS) == expected
        assert _all_greedy(c, PROMPTS, stream=True) == expected
        # A prompt longer than a few blocks, so that KV goes over in several blocks.
        long_prompt = "Summarize: " + " ".join(f"item {i}" for i in range(120))
        assert _greedy(c, long_prompt) == _greedy(client, long_prompt)
        # One token: the prefill core's token is the whole answer.
        assert _greedy(c, PROMPTS[0], max_tokens=1) == _greedy(client, PROMPTS[0], max_tokens=1)
    workers = _workers(disagg)
    assert workers["decode-0"]["num_routed"] >= 2 * len(PROMPTS) + 2
    assert workers["prefill-0"]["num_routed"] > 0 and workers["prefill-1"]["num_routed"] > 0


def test_seeded_sampling_identical_to_colocated(disagg, client):
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=16, temperature=0.9, seed=1234, n=2)
    expected = [c.text for c in client.completions.create(**kwargs).choices]
    with _client(disagg) as c:
        assert [ch.text for ch in c.completions.create(**kwargs).choices] == expected


def test_a_stuck_transfer_ends_in_a_recompute_on_the_decode_core(disagg, client):
    """Both prefill cores frozen: the decode core's lease runs out, it
    computes the prompt itself, and the client gets the same greedy text
    (no tokens from partial KV, no slot held forever)."""
    prefill_pids = [w["pid"] for w in _workers(disagg).values() if w["role"] == "prefill"]
    for pid in prefill_pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        with _client(disagg) as c:
            t0 = time.monotonic()
            assert _greedy(c, PROMPTS[2], stream=True) == _greedy(client, PROMPTS[2])
            assert LEASE_S - 1 < time.monotonic() - t0 < LEASE_S + 60
    finally:
        for pid in prefill_pids:
            os.kill(pid, signal.SIGCONT)
    # The frozen cores come back: their stale work changes nothing, and
    # every core goes back to idle (no request, no queued prefill).
    with _client(disagg) as c:
        assert _all_greedy(c, PROMPTS[:2]) == _all_greedy(client, PROMPTS[:2])
    deadline = time.monotonic() + 30
    while any(w["num_requests"] or w["queued_prefill_tokens"] or w["num_running"]
              for w in _workers(disagg).values()):
        assert time.monotonic() < deadline, _workers(disagg)
        time.sleep(0.2)


def test_a_prefill_core_killed_before_the_first_token_is_replaced(disagg, client):
    """Runs last on this server: it kills one prefill core (which is restarted)."""
    workers = _workers(disagg)
    prefill_pids = {n: w["pid"] for n, w in workers.items() if w["role"] == "prefill"}
    for pid in prefill_pids.values():
        os.kill(pid, signal.SIGSTOP)  # frozen: the request cannot get past its prefill
    try:
        with _client(disagg) as c, ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_greedy, c, PROMPTS[1])
            deadline = time.monotonic() + 30
            while not (busy := [n for n, w in _workers(disagg).items() if w["queued_prefill_tokens"] > 0]):
                assert time.monotonic() < deadline, _workers(disagg)
                time.sleep(0.05)
            victim = busy[0]
            os.kill(prefill_pids[victim], signal.SIGKILL)
            for name, pid in prefill_pids.items():
                if name != victim:
                    os.kill(pid, signal.SIGCONT)
            assert pending.result(timeout=120) == _greedy(client, PROMPTS[1])
            # Another prefill core was up throughout: never a 503, and the
            # dead one comes back (a new process).
            deadline = time.monotonic() + 120
            while True:
                health = httpx.get(f"{disagg.base_url}/health", timeout=10)
                assert health.status_code == 200, health.text
                if health.json()["status"] == "ok":
                    break
                assert health.json()["status"] == "degraded" and health.json()["workers"][victim] is False
                assert time.monotonic() < deadline, disagg.log()[-3000:]
                time.sleep(0.1)
            assert _workers(disagg)[victim]["pid"] != prefill_pids[victim]
            assert _all_greedy(c, PROMPTS[:2]) == _all_greedy(client, PROMPTS[:2])
    finally:
        for pid in prefill_pids.values():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
