"""``kvferry serve --autoscale PROFILE`` through a real server: a burst of
requests makes the autoscaler add an engine core, and once the load is gone
it drains it away again; every request succeeds, and each decision is shown
by GET /v1/admin/scale.

The profile is a slow machine's (a decode step of 20 ms + 10 ms per
sequence, against a 30 ms TPOT SLO: one sequence per core keeps the SLO),
so a burst at a few requests per second needs two cores."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.plan.helpers import write_profile
from tests.serve.server_process import MODEL_NAME, start_server


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("autoscale-serve")
    profile = write_profile(folder / "profile.json", (0.01, 0.0005, 0, 0), (0.02, 0.01, 0))
    srv = start_server(folder / "server.log", [
        "--autoscale", str(profile), "--autoscale-slo", "ttft:1000,tpot:30", "--autoscale-max", "engine=2",
        "--autoscale-interval-s", "1", "--autoscale-window-s", "5", "--autoscale-min-requests", "5",
        "--autoscale-down-after", "2", "--autoscale-cooldown-s", "0"])
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"


def _state(srv) -> dict:
    r = httpx.get(f"{srv.base_url}/v1/admin/scale", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for_engines(srv, n: int, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = _state(srv)
        if state["counts"] == {"engine": n} and not state["scaling"]:
            return state
        assert time.monotonic() < deadline, f"not {n} engines: {state}\n{srv.log()[-4000:]}"
        time.sleep(0.3)


def test_a_burst_scales_up_and_the_quiet_after_it_scales_down(autoscaled):
    state = _state(autoscaled)
    assert state["counts"] == {"engine": 1} and state["autoscale"]["bounds"]
    client = openai.OpenAI(base_url=autoscaled.api_url, api_key="unused", max_retries=0, timeout=120)

    def ask(i: int) -> str:
        return client.completions.create(model=MODEL_NAME, prompt=f"Count to {i}:", max_tokens=8,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(36)))
    assert len(answers) == 36 and all(isinstance(a, str) for a in answers)
    # Up while the burst ran (the decision came at the first interval with enough requests).
    deadline = time.monotonic() + 120
    while not any(e["after"] == {"engine": 2} for e in _state(autoscaled)["history"]):
        assert time.monotonic() < deadline, f"no scale-up: {_state(autoscaled)}\n{autoscaled.log()[-4000:]}"
        time.sleep(0.3)
    state = _state(autoscaled)
    event = next(e for e in state["history"] if e["after"] == {"engine": 2})
    assert event["source"] == "autoscale" and event["ok"]
    decisions = state["autoscale"]["decisions"]
    assert decisions[0]["from_counts"] == {"engine": 1} and decisions[0]["to_counts"] == {"engine": 2}
    assert decisions[0]["direction"] == "up" and decisions[0]["rate"] > 0 and decisions[0]["reason"]

    # Nothing arrives any more: after the window empties and two intervals agree, back to one.
    down = _wait_for_engines(autoscaled, 1)
    last = down["autoscale"]["decisions"][-1]
    assert last["to_counts"] == {"engine": 1} and last["direction"] == "down" and last["applied"] is True
    assert down["history"][-1]["source"] == "autoscale"
    # And it still serves.
    assert ask(3) == answers[3]
