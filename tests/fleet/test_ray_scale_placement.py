"""Scaling past what the Ray cluster can place, through a real ``kvferry
serve --ray`` on the fleet tests' real two-node cluster (one CPU a node),
the real ``kvferry scale`` command and real HTTP.

One colocated core takes one CPU; a scale to three engines needs two more
and the cluster has one free. The scale fails within --scale-timeout-s,
names the resources missing, and changes nothing (the one new core that
could be placed is not kept: its reserved CPU is free again, as the next
scale shows); a later scale that fits works. GET and POST /v1/admin/scale
name the counts with the same keys. A SIGTERM while a scale waits for room
ends the server in seconds, with no traceback.

One server for the module (a Ray core's start costs seconds of a 2-core
host); the last test stops it."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'kvferry[ray]')")

from kvferry.fleet.reservations import bundle_of, why_unplaced  # noqa: E402
from tests.serve.server_process import ServerProcess, start_server  # noqa: E402
from tests.tiny_models import make_tiny_checkpoint  # noqa: E402

# Each of the two failing scales below waits it out in full. It bounds only
# the placement of the new cores' groups (reservations.py: a group Ray can
# place is CREATED in well under a second), never a core's start.
SCALE_TIMEOUT_S = 5
BEGIN_TIMEOUT_S = 5  # a POSTed scale shows as "scaling" within this
# The scale's answer may come this much after --scale-timeout-s on a loaded 2-core host.
MARGIN_S = 45
ADD_TIMEOUT_S = 300  # a core that fits: placed, then its model loaded


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-scale")
    tiny = str(make_tiny_checkpoint(tmp / "tiny", arch="llama", num_hidden_layers=2, max_position_embeddings=1024))
    try:
        srv = start_server(tmp / "server.log", [tiny, "--ray", ray_cluster.address, "--data-parallel-size", "1",
                                                "--ray-engine-resources", json.dumps({"CPU": 1}),
                                                "--scale-timeout-s", str(SCALE_TIMEOUT_S)])
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n--- Ray cluster:\n{ray_cluster.logs()}") from None
    yield srv
    srv.stop()  # the last test stopped it already (and checked how)


def test_the_reason_names_the_core_what_it_needs_and_what_is_free():
    assert bundle_of({"CPU": 1.0, "GPU": 0.0}) == {"CPU": 1.0} and bundle_of({"CPU": 0.0}) is None
    assert why_unplaced("engine-2", "engine", {"CPU": 1.0}, {"CPU": 0.0}, {"CPU": 2.0}) == \
        "cannot place engine core engine-2: needs {CPU: 1}, cluster has {CPU: 0} free of 2"
    # Several resources; one that no node offers at all is said to be so.
    assert why_unplaced("decode-1", "decode", {"CPU": 0.5, "GPU": 1.0}, {"CPU": 3.0}, {"CPU": 4.0}) == (
        "cannot place decode core decode-1: needs {CPU: 0.5, GPU: 1}, cluster has {CPU: 3, GPU: 0} free of "
        "{CPU: 4, GPU: 0} (no node offers GPU enough: ray status lists each node's resources)")
    # Free in sum, but split over nodes.
    assert why_unplaced("engine-1", "engine", {"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 2.0}).endswith(
        "(free across nodes, but no single node has it all)")


def _state(srv: ServerProcess) -> dict:
    r = httpx.get(f"{srv.base_url}/v1/admin/scale", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _workers(srv: ServerProcess) -> dict[str, dict]:
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=30)
    assert r.status_code == 200, r.text
    return {w["name"]: w for w in r.json()["data"]}


def test_a_scale_the_cluster_cannot_place_fails_in_time_naming_the_resources(server):
    before = _workers(server)
    assert list(before) == ["engine-0"] and _state(server)["counts"] == {"engine": 1}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvferry.cli", "scale", "--url", server.base_url, "--engines", "3"],
                          capture_output=True, text=True, timeout=SCALE_TIMEOUT_S + MARGIN_S + 60)
    took = time.monotonic() - start
    print(f"the scale failed after {took:.1f} s")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert SCALE_TIMEOUT_S - 1 <= took <= SCALE_TIMEOUT_S + MARGIN_S, took
    # The one line names the core, what it needs and what the cluster has free (the one free CPU
    # is held by the new core that could be placed, until the scale gives up).
    assert re.search(r"kvferry scale: error: cannot place engine core engine-[12]: needs \{CPU: 1\}, "
                     r"cluster has \{CPU: 0\} free of 2", done.stderr), done.stderr
    assert "1 of this scale's 2 new cores could be placed" in done.stderr
    assert "Traceback" not in done.stderr
    assert "failed engine-1 (engine)" in done.stdout and "pools: engine 1 -> engine 1" in done.stdout, done.stdout

    # Nothing changed, and the server is free for the next scale.
    state = _state(server)
    assert state["counts"] == {"engine": 1} and state["scaling"] is False and state["target"] is None
    event = state["history"][-1]
    assert event["ok"] is False and event["before"] == event["after"] == {"engine": 1}
    assert "needs {CPU: 1}" in event["error"] and {s["name"] for s in event["steps"]} == {"engine-1", "engine-2"}
    workers = _workers(server)
    assert list(workers) == ["engine-0"] and workers["engine-0"]["pid"] == before["engine-0"]["pid"]

    # The same through the API: an OpenAI-style error beside the event.
    r = httpx.post(f"{server.base_url}/v1/admin/scale", json={"engine": 4}, timeout=SCALE_TIMEOUT_S + MARGIN_S)
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["error"]["code"] == "insufficient_resources" and "cannot place engine core" in body["error"]["message"]
    assert body["state"]["counts"] == {"engine": 1} and body["state"]["scaling"] is False


def test_get_and_post_use_the_same_keys_and_a_scale_that_fits_works(server, ray_cluster):
    counts = _state(server)["counts"]
    assert set(counts) == {"engine"}
    # The GET's key is the POST's: one more core fits in the CPU the failed scale left free.
    r = httpx.post(f"{server.base_url}/v1/admin/scale", json={"engine": counts["engine"] + 1}, timeout=ADD_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["ok"], r.text
    assert r.json()["after"] == {"engine": 2} and _state(server)["counts"] == {"engine": 2}
    workers = _workers(server)
    assert workers["engine-1"]["alive"] and workers["engine-1"]["ray_actor"]
    assert {w["node_id"] for w in workers.values()} == set(ray_cluster.node_ids.values())  # one a node
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                   json={"model": _model(server), "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    # "engines" (the CLI's flag) is the same count; both at once is a clear 400.
    r = httpx.post(f"{server.base_url}/v1/admin/scale", json={"engine": 1, "engines": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "engines", r.text
    r = httpx.post(f"{server.base_url}/v1/admin/scale", json={"engines": 1}, timeout=ADD_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["ok"], r.text
    assert _state(server)["counts"] == {"engine": 1} and list(_workers(server)) == ["engine-0"]


def _model(srv: ServerProcess) -> str:
    return httpx.get(f"{srv.base_url}/v1/models", timeout=30).json()["data"][0]["id"]


def test_sigterm_while_a_scale_waits_for_room_is_quick_and_clean(server):
    """Runs last: it stops the module's server."""
    answers: list[httpx.Response | BaseException] = []

    def post() -> None:
        try:
            answers.append(httpx.post(f"{server.base_url}/v1/admin/scale", json={"engine": 3}, timeout=120))
        except httpx.HTTPError as exc:
            answers.append(exc)

    thread = threading.Thread(target=post)
    thread.start()
    deadline = time.monotonic() + BEGIN_TIMEOUT_S
    while not _state(server)["scaling"]:
        assert time.monotonic() < deadline, "the scale did not begin"
        time.sleep(0.1)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(60)
    took = time.monotonic() - signalled
    print(f"the server exited {took:.1f} s after SIGTERM")
    thread.join(60)
    log = server.log()
    assert code == 0, log[-5000:]
    assert took < 10, f"{took:.1f} s to exit:\n{log[-5000:]}"
    assert "Traceback" not in log, log[-5000:]
    # The waiting POST was answered (or its connection closed), never left hanging.
    assert answers, "the scale's POST got no answer"
    if isinstance(answers[0], httpx.Response):
        assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "server_shutting_down"
