"""Scaling each pool on its own while requests stream, through a real
disagg server, real HTTP (the openai client, POST /v1/admin/scale) and the
real ``kvferry scale`` command: cores are added and drained away with no
request failed, and greedy outputs stay those of the single-core server."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.serve.server_process import MODEL_NAME, ServerProcess

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea:",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def disagg(disagg_server):
    """The session's disaggregated server (conftest.py), at 1 prefill + 1
    decode core; test_kvferry_scale_command leaves it so again."""
    return disagg_server


def _greedy(client: openai.OpenAI, prompt: str, stream: bool) -> str:
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)


@pytest.fixture(scope="module")
def reference(client) -> dict[str, str]:
    """Greedy answers of the single-core (colocated) session server."""
    return {p: _greedy(client, p, stream=False) for p in PROMPTS}


def _scale(srv: ServerProcess, **body) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/v1/admin/scale", json=body, timeout=600)


def _state(srv: ServerProcess) -> dict:
    r = httpx.get(f"{srv.base_url}/v1/admin/scale", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _workers(srv: ServerProcess) -> dict[str, dict]:
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=10)
    return {w["name"]: w for w in r.json()["data"]}


class Streams:
    """Requests streaming in the background, round after round, until stopped:
    every answer is kept, every failure too."""

    def __init__(self, srv: ServerProcess, width: int = 3) -> None:
        self.client = openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300)
        self.answers: list[tuple[str, str]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(width)]
        for t in self._threads:
            t.start()

    def _run(self, offset: int) -> None:
        i = offset
        while not self._stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            try:
                self.answers.append((prompt, _greedy(self.client, prompt, stream=i % 2 == 0)))
            except BaseException as exc:  # noqa: BLE001 - every failure is the finding
                self.errors.append(exc)
            i += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)


def test_scale_decode_up_and_down_while_streams_run(disagg, reference):
    streams = Streams(disagg)
    try:
        time.sleep(1.0)
        started = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            up = pool.submit(_scale, disagg, decode=2)
            time.sleep(0.5)
            # One scale at a time: a second one while the first runs is refused.
            busy = _scale(disagg, decode=3)
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "scale_in_progress", busy.text
            r = up.result()
        assert r.status_code == 200, r.text
        event = r.json()
        assert event["ok"] and event["before"] == {"prefill": 1, "decode": 1}
        assert event["after"] == {"prefill": 1, "decode": 2}
        assert [(s["action"], s["name"]) for s in event["steps"]] == [("added", "decode-1")]
        assert 0 < event["steps"][0]["seconds"] <= time.monotonic() - started
        workers = _workers(disagg)
        assert workers["decode-1"]["alive"] and workers["decode-1"]["accepting"]
        # The new core serves: it takes its share of what is routed from now on.
        routed = workers["decode-1"]["num_routed"]
        deadline = time.monotonic() + 120
        while _workers(disagg)["decode-1"]["num_routed"] == routed and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _workers(disagg)["decode-1"]["num_routed"] > routed

        # Down again, and the prefill pool up at once: each pool on its own.
        r = _scale(disagg, decode=1, prefill=2)
        assert r.status_code == 200, r.text
        event = r.json()
        assert event["after"] == {"prefill": 2, "decode": 1}
        assert sorted(s["action"] for s in event["steps"]) == ["added", "removed"]
        assert set(_workers(disagg)) == {"prefill-0", "prefill-1", "decode-0"} or \
            set(_workers(disagg)) == {"prefill-0", "prefill-1", "decode-1"}
        time.sleep(1.0)
    finally:
        streams.stop()
    assert not streams.errors, streams.errors[:3]
    assert len(streams.answers) >= 6
    for prompt, answer in streams.answers:
        assert answer == reference[prompt], prompt
    history = _state(disagg)["history"]
    assert [e["after"] for e in history[-2:]] == [{"prefill": 1, "decode": 2}, {"prefill": 2, "decode": 1}]


def test_kvferry_scale_command(disagg, reference):
    before = _state(disagg)["counts"]
    assert before["prefill"] >= 1
    cmd = [sys.executable, "-m", "kvferry.cli", "scale", "--url", disagg.base_url, "--prefill", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    if before["prefill"] > 1:
        assert "removed prefill-" in done.stdout
    assert "-> prefill 1, decode 1" in done.stdout, done.stdout
    shown = subprocess.run(cmd[:6], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "mode disagg, pools: prefill 1, decode 1" in shown.stdout, shown.stdout
    client = openai.OpenAI(base_url=disagg.api_url, api_key="unused", max_retries=0, timeout=120)
    assert _greedy(client, PROMPTS[0], stream=True) == reference[PROMPTS[0]]


@pytest.mark.parametrize("body, param", [
    ({"engines": 2}, "engines"),  # a disagg server has no engine pool
    ({"engine": 2}, "engine"),  # ... by either spelling (GET's counts say "engine")
    ({"decode": 0}, "decode"),
    ({"decode": 65}, "decode"),
    ({"decode": "2"}, "decode"),  # strict: a count is a JSON integer
    ({}, None),
    ({"decode": 1, "replicas": 2}, "replicas"),
])
def test_bad_scale_requests_get_a_400_naming_the_field(disagg, body, param):
    r = _scale(disagg, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert httpx.get(f"{disagg.base_url}/health", timeout=10).status_code == 200


def test_kvferry_scale_command_errors(disagg):
    cmd = [sys.executable, "-m", "kvferry.cli", "scale", "--url", disagg.base_url, "--engines", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "engines: this server runs in disagg mode" in done.stderr, done.stderr
    done = subprocess.run(cmd[:6] + ["--engines", "1", "--decode", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "not both" in done.stderr
