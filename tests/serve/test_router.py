"""The router over several engine cores, through real processes, real HTTP
(the openai client) and real signals: greedy outputs identical to one core,
prefix-aware placement, a core joining and leaving while requests run, a
core killed mid-stream, and SLO admission (429 with Retry-After)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.serve.server_process import MODEL_NAME, SERVE_ARGS, ServerProcess, start_server

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea:",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
LONG_PREFIX = "You are a careful assistant. Answer briefly and precisely. " * 6


# Each core on its own CPU where there are two (sched_setaffinity in the core).
PINNED = ["--engine-cpus", "0", "--engine-cpus", "1"] if {0, 1} <= os.sched_getaffinity(0) else []


@pytest.fixture(scope="module")
def cache_secret(tmp_path_factory) -> str:
    """The file the server and the cores that join it apart share (else a join is refused)."""
    path = tmp_path_factory.mktemp("secret") / "cache-secret"
    path.write_text(os.urandom(32).hex())
    return str(path)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, cache_secret):
    srv = start_server(tmp_path_factory.mktemp("dp2") / "server.log",
                       ["--data-parallel-size", "2", *PINNED, "--cache-secret-file", cache_secret])
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=120)


def _workers(srv: ServerProcess) -> dict[str, dict]:
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=10)
    assert r.status_code == 200, r.text
    return {w["name"]: w for w in r.json()["data"]}


def _greedy(client: openai.OpenAI, prompt: str, stream: bool = False, max_tokens: int = 12) -> str:
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)


def _all_greedy(client: openai.OpenAI, prompts: list[str], stream: bool = False) -> list[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: both cores take part
        return list(pool.map(lambda p: _greedy(client, p, stream), prompts))


def test_two_cores_run_as_processes_and_report_health(dp2):
    assert httpx.get(f"{dp2.base_url}/health", timeout=10).json() == {
        "status": "ok", "workers": {"engine-0": True, "engine-1": True}}
    workers = _workers(dp2)
    assert set(workers) == {"engine-0", "engine-1"}
    for name, w in workers.items():
        with open(f"/proc/{w['pid']}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == f"kvferry: {name}".encode()
        if PINNED:
            assert os.sched_getaffinity(w["pid"]) == {int(name[-1])}


def test_greedy_identical_to_one_core_streamed_and_not(dp2, client):
    with _client(dp2) as c2:
        before = {n: w["num_routed"] for n, w in _workers(dp2).items()}
        expected = _all_greedy(client, PROMPTS)
        assert _all_greedy(c2, PROMPTS) == expected
        assert _all_greedy(c2, PROMPTS, stream=True) == expected
        after = _workers(dp2)
    routed = {n: after[n]["num_routed"] - before[n] for n in after}
    assert sum(routed.values()) == 2 * len(PROMPTS)
    assert all(v > 0 for v in routed.values()), routed  # both cores served


def test_requests_sharing_a_prefix_go_to_the_core_holding_it(dp2):
    prefix = LONG_PREFIX + "Question number seven: "
    with _client(dp2) as c:
        _greedy(c, prefix + "why is the sky blue?", max_tokens=2)
        first = _workers(dp2)
        holder = max(first, key=lambda n: first[n]["cached_blocks"])
        assert first[holder]["cached_blocks"] >= 4
        for question in ["what is rain?", "how do birds fly?", "where is Peru?", "who wrote Hamlet?"]:
            _greedy(c, prefix + question, max_tokens=2)
        after = _workers(dp2)
    gained = {n: after[n]["num_routed"] - first[n]["num_routed"] for n in after}
    assert gained[holder] == 4, gained
    # ... and the holder served their shared blocks from its cache.
    assert after[holder]["prefix_hits"] - first[holder]["prefix_hits"] >= 4 * 4 * 16


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


def _core_args() -> list[str]:
    """The serve test flags an engine core takes (no HTTP ones)."""
    args, skip = [], {"--disable-uvicorn-access-log", "--check-kv-integrity"}
    it = iter(SERVE_ARGS)
    for a in it:
        if a == "--log-level":
            next(it)
        elif a not in skip:
            args.append(a)
    return args


def test_a_core_joins_while_requests_run_then_leaves(dp2, client, tmp_path, cache_secret):
    address = f"tcp://127.0.0.1:{_free_port_pair()}"
    log = open(tmp_path / "core.log", "w")
    core = subprocess.Popen([sys.executable, "-m", "kvferry.cli", "engine-core", "--address", address,
                             "--name", "engine-joined", "--cache-secret-file", cache_secret, *_core_args()],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        with _client(dp2) as c:
            expected = _all_greedy(client, PROMPTS)
            # A long request keeps running across the join.
            running = ThreadPoolExecutor(1).submit(_greedy, c, "Count slowly: one, two,", False, 60)
            r = httpx.post(f"{dp2.base_url}/v1/admin/workers", json={"address": address, "role": "engine"},
                           timeout=240)
            assert r.status_code == 200, r.text
            name = r.json()["name"]
            assert name not in ("engine-0", "engine-1") and r.json()["alive"]
            assert _all_greedy(c, PROMPTS) == expected
            assert running.result(timeout=120) == _greedy(client, "Count slowly: one, two,", max_tokens=60)
            workers = _workers(dp2)
            assert workers[name]["num_routed"] > 0, workers
            # Joining the same address twice is refused; a bad address is a 400 naming it.
            again = httpx.post(f"{dp2.base_url}/v1/admin/workers", json={"address": address}, timeout=30)
            assert again.status_code == 400 and again.json()["error"]["param"] == "address"
            bad = httpx.post(f"{dp2.base_url}/v1/admin/workers", json={"address": "http://x"}, timeout=30)
            assert bad.status_code == 400 and "tcp://" in bad.json()["error"]["message"]
            gone = httpx.delete(f"{dp2.base_url}/v1/admin/workers/{name}", timeout=60)
            assert gone.status_code == 200 and gone.json()["removed"]
            assert name not in _workers(dp2)
            assert _all_greedy(c, PROMPTS[:2]) == expected[:2]
        assert core.poll() is None  # a joined core is left running when it leaves
    finally:
        core.send_signal(signal.SIGTERM)
        assert core.wait(60) == 0, (tmp_path / "core.log").read_text()[-3000:]


def test_kill_9_of_one_core_ends_its_stream_promptly_and_the_other_serves(dp2, client):
    """Runs last on this server: it kills one core, which is restarted."""
    with _client(dp2) as c:
        stream = c.completions.create(model=MODEL_NAME, prompt="Tell me a very long story:", max_tokens=600,
                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)  # it runs
        busy = [w for w in _workers(dp2).values() if w["num_requests"] == 1]
        assert len(busy) == 1
        os.kill(busy[0]["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(openai.APIError, match="exited with code -9"):
            for _ in chunks:
                pass
        assert time.monotonic() - killed_at < 15
        victim = busy[0]["name"]
        health = httpx.get(f"{dp2.base_url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert health.json()["workers"][victim] is False and health.json()["restarting"] == [victim]
        # New requests go to the survivor, with the same greedy outputs.
        assert _all_greedy(c, PROMPTS[:3]) == _all_greedy(client, PROMPTS[:3])
        # The dead core alone is started again (a new process), and takes requests.
        deadline = time.monotonic() + 120
        while not (w := _workers(dp2)[victim])["alive"]:
            assert time.monotonic() < deadline, dp2.log()[-3000:]
            time.sleep(0.1)
        assert w["pid"] != busy[0]["pid"] and w["num_restarts"] == 1 and not w["restarting"]
        assert httpx.get(f"{dp2.base_url}/health", timeout=10).json()["status"] == "ok"
        routed = w["num_routed"]
        assert _all_greedy(c, PROMPTS) == _all_greedy(client, PROMPTS)
        assert _workers(dp2)[victim]["num_routed"] > routed


def test_impossible_ttft_slo_gets_429_with_retry_after(tmp_path):
    srv = start_server(tmp_path / "server.log", ["--ttft-slo-ms", "0.001"])
    try:
        with _client(srv) as c:
            # The first request is admitted: no step has been measured yet.
            assert _greedy(c, "Hello", max_tokens=3)
            with pytest.raises(openai.RateLimitError) as err:
                _greedy(c, "Hello there", max_tokens=3)
            assert err.value.response.headers["retry-after"].isdigit()
            body = err.value.response.json()["error"]
            assert body["code"] == "slo_unattainable" and "TTFT SLO" in body["message"]
            # Refused requests leave nothing behind: the server is idle and healthy.
            assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200
            assert srv.wait_for_metric("kvferry:num_requests_running", lambda v: v == 0) == 0
    finally:
        assert srv.stop() == 0, srv.log()[-5000:]
