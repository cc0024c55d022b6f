"""``kvferry serve --ray ADDRESS --mode disagg``: the prefill and decode cores
as Ray actors on a real two-node Ray cluster (two ``ray start`` nodes on this
host, one offering resource "pnode", the other "dnode"), reached over real
HTTP through the openai client.

Greedy outputs equal the offline engine's; each core lands on the node its
resources name (the node ids /v1/admin/workers reports are the cluster's);
a core whose process is killed (SIGKILL) ends only its own streams, Ray
starts its actor again, and the server re-joins it and serves as before.

One server for the module, on the fleet tests' one cluster (conftest.py): Ray is
heavy on a 2-core host."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'kvferry[ray]')")

import openai  # noqa: E402

from kvferry import LLM, SamplingParams  # noqa: E402
from tests.serve.server_process import ServerProcess, start_server  # noqa: E402
from tests.tiny_models import make_tiny_checkpoint  # noqa: E402

MODEL = "tiny"
PROMPTS = ["The quick brown fox", "Hello world! How are", "the cat sat on the mat; the dog"]
MAX_TOKENS = 16
LONG_TOKENS = 400  # a stream still running when a core is killed
RESTART_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("ray-tiny"), arch="llama", num_hidden_layers=2,
                                    max_position_embeddings=1024))


@pytest.fixture(scope="module")
def expected(tiny) -> dict[tuple[str, int], str]:
    """The offline engine's greedy text of each (prompt, max_tokens)."""
    llm = LLM(model=tiny, dtype="float32")
    params = {n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (MAX_TOKENS, LONG_TOKENS)}
    out = {(p, n): llm.generate([p], params[n])[0].outputs[0].text for p in PROMPTS for n in params}
    del llm
    return out


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster  # the fleet tests' one cluster (conftest.py)


@pytest.fixture(scope="module")
def server(cluster, tiny, tmp_path_factory):
    log = tmp_path_factory.mktemp("ray-serve") / "server.log"
    try:
        srv = start_server(log, [tiny, "--served-model-name", MODEL, "--ray", cluster.address, "--mode", "disagg",
                                 "--prefill", "1", "--decode", "1",
                                 "--ray-prefill-resources", json.dumps({"pnode": 1}),
                                 "--ray-decode-resources", json.dumps({"dnode": 1})])
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n--- Ray cluster:\n{cluster.logs()}") from None
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=180)


def _workers(srv: ServerProcess) -> dict[str, dict]:
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=10)
    assert r.status_code == 200, r.text
    return {w["name"]: w for w in r.json()["data"]}


def _greedy(c: openai.OpenAI, prompt: str, max_tokens: int = MAX_TOKENS, stream: bool = False) -> str:
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return c.completions.create(**kwargs).choices[0].text
    return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kwargs) if ch.choices)


def _title(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0]


def _wait_restarted(srv: ServerProcess, name: str, old_pid: int) -> dict:
    """The worker once it is back: alive, a new process, restarted once more."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        w = _workers(srv)[name]
        if w["alive"] and not w["restarting"] and w["pid"] != old_pid:
            return w
        assert time.monotonic() < deadline, f"{name} not back: {w}\n{srv.log()[-5000:]}"
        time.sleep(0.5)


def test_cores_are_actors_on_the_nodes_their_resources_name(server, cluster):
    workers = _workers(server)
    assert {n: w["role"] for n, w in workers.items()} == {"prefill-0": "prefill", "decode-0": "decode"}
    assert workers["prefill-0"]["node_id"] == cluster.node_ids["pnode"]
    assert workers["decode-0"]["node_id"] == cluster.node_ids["dnode"]
    assert cluster.node_ids["pnode"] != cluster.node_ids["dnode"]
    for name, w in workers.items():
        # Bound on the interface the node is known by in the cluster.
        node = "pnode" if name.startswith("prefill") else "dnode"
        assert w["ray_actor"] and w["address"].startswith(f"tcp://{cluster.node_hosts[node]}:")
        assert _title(w["pid"]) == f"kvferry: {name}".encode()
    assert workers["prefill-0"]["ray_actor"] != workers["decode-0"]["ray_actor"]


def test_greedy_identical_to_the_offline_engine(server, expected):
    with _client(server) as c:
        for prompt in PROMPTS:
            assert _greedy(c, prompt) == expected[(prompt, MAX_TOKENS)]
        assert _greedy(c, PROMPTS[0], stream=True) == expected[(PROMPTS[0], MAX_TOKENS)]
    workers = _workers(server)
    assert workers["prefill-0"]["num_routed"] > 0 and workers["decode-0"]["num_routed"] >= len(PROMPTS) + 1


def test_a_core_no_node_can_host_fails_the_start_clearly(cluster, tiny, tmp_path):
    """Resources no node offers: the actor stays pending, the server says
    so at once in its log, exits 2 at --engine-start-timeout naming the
    core, and leaves no actor behind (the other core's included)."""
    cmd = [sys.executable, "-m", "kvferry.cli", "serve", tiny, "--port", "0", "--ray", cluster.address,
           # The prefill core can be placed (a CPU: the module's server holds "pnode").
           "--mode", "disagg", "--ray-prefill-resources", json.dumps({"CPU": 1}),
           "--ray-decode-resources", json.dumps({"nowhere": 1}), "--engine-start-timeout", "10"]
    before = _num_titled("kvferry: prefill-0")  # the module's server's, if it runs
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "no node of the Ray cluster offers {'nowhere': 1.0}, which decode-0 asks for" in out.stderr
    assert "did not place decode-0 (resources {'nowhere': 1.0})" in out.stderr
    deadline = time.monotonic() + 60
    while _num_titled("kvferry: prefill-0") > before:  # its prefill actor is ended
        assert time.monotonic() < deadline
        time.sleep(0.5)


def test_the_decode_pool_scales_up_on_its_node_and_down_while_a_stream_runs(server, cluster, expected):
    """A new decode actor lands where the decode resources name, serves, and
    is drained away again; the stream running throughout never fails."""
    prompt = PROMPTS[2]
    with _client(server) as c:
        stream = iter(c.completions.create(model=MODEL, prompt=prompt, max_tokens=LONG_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
        text = next(stream).choices[0].text
        r = httpx.post(f"{server.base_url}/v1/admin/scale", json={"decode": 2}, timeout=RESTART_TIMEOUT_S)
        assert r.status_code == 200 and r.json()["ok"], r.text
        added = _workers(server)["decode-1"]
        assert added["alive"] and added["node_id"] == cluster.node_ids["dnode"] and added["ray_actor"]
        assert added["ray_actor"] != _workers(server)["decode-0"]["ray_actor"]
        assert _title(added["pid"]) == b"kvferry: decode-1"
        # Both decode cores serve, with the offline engine's outputs.
        for p in PROMPTS * 2:
            assert _greedy(c, p) == expected[(p, MAX_TOKENS)]
        assert _workers(server)["decode-1"]["num_routed"] > 0
        # Down to one: the long stream (on whichever core) finishes untouched.
        r = httpx.post(f"{server.base_url}/v1/admin/scale", json={"decode": 1}, timeout=RESTART_TIMEOUT_S)
        assert r.status_code == 200 and r.json()["ok"], r.text
        text += "".join(ch.choices[0].text for ch in stream if ch.choices)
        assert text == expected[(prompt, LONG_TOKENS)]
    # The newer core goes (the stream, routed before it existed, is decode-0's, or over).
    assert sorted(_workers(server)) == ["decode-0", "prefill-0"]
    gone = added
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{gone['pid']}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{gone['pid']}"), "the removed core's actor process is still running"


def _num_titled(title: str) -> int:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return sum(line.strip() == title for line in ps.splitlines())


def test_a_killed_core_ends_only_its_streams_and_is_rejoined_after_ray_restarts_it(server, cluster, expected):
    """Runs last on this server: it kills both cores, one after the other."""
    before = _workers(server)
    prompt = PROMPTS[1]
    with _client(server) as c:
        # The prefill core dies while a request decodes: that stream is the
        # decode core's and goes on to the end, unchanged.
        stream = iter(c.completions.create(model=MODEL, prompt=prompt, max_tokens=LONG_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
        text = next(stream).choices[0].text
        os.kill(before["prefill-0"]["pid"], signal.SIGKILL)
        chunks = list(stream)
        text += "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == expected[(prompt, LONG_TOKENS)]
        prefill = _wait_restarted(server, "prefill-0", before["prefill-0"]["pid"])
        assert prefill["num_restarts"] == 1 and prefill["node_id"] == cluster.node_ids["pnode"]
        assert prefill["ray_actor"] == before["prefill-0"]["ray_actor"]  # the same actor, restarted by Ray
        assert _title(prefill["pid"]) == b"kvferry: prefill-0"

        # The decode core dies mid-stream: its stream ends with an error.
        stream = iter(c.completions.create(model=MODEL, prompt=prompt, max_tokens=LONG_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
        next(stream)
        os.kill(before["decode-0"]["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(openai.APIError, match="decode-0"):
            for _ in stream:
                pass
        assert time.monotonic() - killed_at < 30
        decode = _wait_restarted(server, "decode-0", before["decode-0"]["pid"])
        assert decode["num_restarts"] == 1 and decode["node_id"] == cluster.node_ids["dnode"]
        assert httpx.get(f"{server.base_url}/health", timeout=10).json()["status"] == "ok"
        # Served again, with the same greedy outputs.
        for p in PROMPTS:
            assert _greedy(c, p) == expected[(p, MAX_TOKENS)]
