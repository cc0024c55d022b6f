"""``kvferry serve --ray ADDRESS --kv-dram-gb N``: one node KV store per Ray
node that hosts a core, on a real two-node Ray cluster (two ``ray start``
nodes on this host, "pnode" and "dnode"), reached over real HTTP through the
openai client.

Each store is a Ray actor pinned to its node, whose child process is the
store ("kvferry: kvstore"); the prefill core's node and the decode cores'
node each have one, which the two decode cores share. Greedy outputs equal the offline engine's, a prompt
whose KV the device pool lost is loaded back from its node's store, and a
store killed by a signal (its process, or its actor's) is started again by
Ray at the same address while requests keep succeeding; a core Ray
restarts finds its node's store again.

One cluster and one server for the module: Ray is heavy on a 2-core host."""
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
from tests.fleet.ray_cluster import RayCluster  # noqa: E402
from tests.serve.server_process import ServerProcess, start_server  # noqa: E402
from tests.tiny_models import make_tiny_checkpoint  # noqa: E402

MODEL = "tiny"
BLOCK = 16
PROMPTS = ["The quick brown fox", "Hello world! How are"]
# Several blocks long: its blocks are written to the store, then loaded back.
LONG = "the cat sat on the mat; the dog sat on the log; they are friends and they play. " * 4
FLUSH = [f"{i} Paris is the capital of France. Numbers: 0 1 2 3 42 1234. " * 5 for i in range(3)]
MAX_TOKENS = 8
RESTART_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("store-tiny"), arch="llama", num_hidden_layers=2,
                                    max_position_embeddings=1024))


@pytest.fixture(scope="module")
def expected(tiny) -> dict[str, str]:
    """The offline engine's greedy text of each prompt."""
    llm = LLM(model=tiny, dtype="float32")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = {p: llm.generate([p], params)[0].outputs[0].text for p in [*PROMPTS, LONG]}
    del llm
    return out


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster  # the fleet tests' one cluster (conftest.py)


@pytest.fixture(scope="module")
def server(cluster, tiny, tmp_path_factory):
    log = tmp_path_factory.mktemp("store-serve") / "server.log"
    try:
        # A device pool of 24 blocks: the FLUSH prompts push LONG's blocks out of it.
        srv = start_server(log, [tiny, "--served-model-name", MODEL, "--ray", cluster.address, "--mode", "disagg",
                                 # Two decode cores on the "dnode" node: they share its store.
                                 "--prefill", "1", "--decode", "2",
                                 "--ray-prefill-resources", json.dumps({"pnode": 1}),
                                 "--ray-decode-resources", json.dumps({"dnode": 0.5}),
                                 "--kv-dram-gb", "0.05", "--num-kv-blocks", "24", "--block-size", str(BLOCK)])
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n--- Ray cluster:\n{cluster.logs()}") from None
    yield srv
    stores = _stores(cluster)
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"
    # The stores (and their actors) end with the server.
    deadline = time.monotonic() + 30
    while any(_alive(s["pid"]) or _alive(s["actor_pid"]) for s in stores.values()):
        assert time.monotonic() < deadline, f"a node store outlived its server: {stores}"
        time.sleep(0.2)
    # Stopped cleanly: each removed its socket file.
    assert not any(os.path.exists(s["address"][len("ipc://"):]) for s in stores.values())


# A driver of its own (this test process stays free of Ray): every node
# store of the cluster, as its actor reports it.
_STORES_SCRIPT = """
import json, sys, time, ray
from ray.exceptions import ActorUnavailableError
ray.init(address=sys.argv[1], logging_level="ERROR")

def info_of(actor):
    deadline = time.monotonic() + 120
    while True:
        try:
            return ray.get(actor.info.remote(), timeout=120)
        except ActorUnavailableError:  # restarting right now (a test killed it): ask again
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)

out = {}
for entry in ray.util.list_named_actors(all_namespaces=True):
    if entry["name"].startswith("kvferry-kvstore-"):
        info = info_of(ray.get_actor(entry["name"], namespace=entry["namespace"]))
        out[info.node_id] = dict(name=entry["name"], address=info.address, pid=info.pid,
                                 actor_pid=info.actor_pid, actor_id=info.actor_id)
print(json.dumps(out))
"""


def _stores(cluster: RayCluster) -> dict[str, dict]:
    """By Ray node id: the store's name, address, pid, its actor's pid and id."""
    out = subprocess.run([sys.executable, "-c", _STORES_SCRIPT, cluster.address], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=180)


def _greedy(c: openai.OpenAI, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    return c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text


def _title(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone for our purpose
    except FileNotFoundError:
        return False


def _loaded_back(srv: ServerProcess, c: openai.OpenAI, expected: dict[str, str]) -> None:
    """LONG, its blocks pushed out of the prefill core's pool, comes back
    from the store: the same greedy text, its tokens loaded from the store."""
    assert _greedy(c, LONG) == expected[LONG]
    for prompt in FLUSH:
        _greedy(c, prompt, max_tokens=2)
    loaded = srv.metric("kvferry:kv_store_loaded_tokens_total")
    assert _greedy(c, LONG) == expected[LONG]
    assert srv.metric("kvferry:kv_store_loaded_tokens_total") - loaded >= BLOCK


def _workers(srv: ServerProcess) -> dict[str, dict]:
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=10)
    assert r.status_code == 200, r.text
    return {w["name"]: w for w in r.json()["data"]}


def _child_stores(pid: int) -> list[int]:
    """The "kvferry: kvstore" children of ``pid`` (a core that started a store of its own)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(c) for c in out.split() if _alive(int(c)) and _title(int(c)) == b"kvferry: kvstore"]


def test_one_store_per_node_that_hosts_a_core(server, cluster):
    stores = _stores(cluster)
    assert set(stores) == {cluster.node_ids["pnode"], cluster.node_ids["dnode"]}
    workers = _workers(server)
    assert {n: w["node_id"] for n, w in workers.items()} == {
        "prefill-0": cluster.node_ids["pnode"], "decode-0": cluster.node_ids["dnode"],
        "decode-1": cluster.node_ids["dnode"]}
    # Every core uses its node's store: none started one of its own.
    assert not any(_child_stores(w["pid"]) for w in workers.values())
    for node_id, store in stores.items():
        assert store["name"].endswith(node_id)
        # The store is its actor's child process, titled as kvferry serve's own store.
        assert _title(store["pid"]) == b"kvferry: kvstore"
        assert _parent(store["pid"]) == store["actor_pid"]
        assert store["address"].startswith("ipc://")  # only the cores of its node reach it
    assert len({s["address"] for s in stores.values()}) == 2


def test_greedy_identical_and_a_lost_prefix_comes_back_from_the_store(server, expected):
    with _client(server) as c:
        for prompt in PROMPTS:
            assert _greedy(c, prompt) == expected[prompt]
        _loaded_back(server, c, expected)
    # The tiers' counters in /metrics are the first core's node store's (prefill-0's, which served LONG).
    assert server.wait_for_metric("kvferry:kv_tier_hits_total", lambda v: v > 0, tier="dram") > 0


@pytest.mark.parametrize("victim", ["store", "actor"])
def test_a_killed_store_is_restarted_by_ray_and_requests_still_succeed(server, cluster, expected, victim):
    """SIGKILL the prefill node's store process (its actor ends, for Ray to
    restart), or its actor's process (the store goes with it):
    requests succeed meanwhile, and a new store at the same address serves
    the cores again."""
    node = cluster.node_ids["pnode"]
    before = _stores(cluster)[node]
    os.kill(before["actor_pid"] if victim == "actor" else before["pid"], signal.SIGKILL)
    with _client(server) as c:
        for prompt in PROMPTS:  # while the store is down: misses, never errors
            assert _greedy(c, prompt) == expected[prompt]
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            after = _stores(cluster)[node]
            if after["pid"] != before["pid"] and _alive(after["pid"]):
                break
            assert time.monotonic() < deadline, f"the store of {node} is not back: {after}"
            time.sleep(1)
        assert not _alive(before["pid"]) and not _alive(before["actor_pid"])
        assert after["actor_id"] == before["actor_id"]  # the same actor, restarted by Ray
        assert after["address"] == before["address"] and _title(after["pid"]) == b"kvferry: kvstore"
        # The prefill core's client reconnected to the new store: KV is written and loaded back again.
        deadline = time.monotonic() + 30
        while True:
            try:
                _loaded_back(server, c, expected)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
    assert httpx.get(f"{server.base_url}/health", timeout=10).json()["status"] == "ok"


def test_a_restarted_core_finds_its_nodes_store(server, cluster, expected):
    """SIGKILL the prefill core: Ray restarts its actor, whose new process
    gets the same store (no new one), and loads prefixes from it."""
    stores = _stores(cluster)
    old_pid = _workers(server)["prefill-0"]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        prefill = _workers(server)["prefill-0"]
        if prefill["alive"] and not prefill["restarting"] and prefill["pid"] != old_pid:
            break
        assert time.monotonic() < deadline, f"prefill-0 not back: {prefill}\n{server.log()[-5000:]}"
        time.sleep(0.5)
    assert _stores(cluster) == stores and not _child_stores(prefill["pid"])
    with _client(server) as c:
        _loaded_back(server, c, expected)


def test_a_store_that_cannot_start_fails_the_server_start_clearly(cluster, tiny, tmp_path):
    """A tier the node's store cannot open: the core that asked for the
    store fails to start, and the server exits 2 naming the store."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    secret = tmp_path / "cache-secret"  # given: the server itself then opens no tier
    secret.write_text("s" * 32)
    cmd = [sys.executable, "-m", "kvferry.cli", "serve", tiny, "--port", "0", "--ray", cluster.address,
           # A CPU: the module's server holds "pnode" and "dnode".
           "--ray-engine-resources", json.dumps({"CPU": 1}), "--engine-start-timeout", "120",
           "--kv-dram-gb", "0.05", "--kv-disk", str(blocker / "tier"), "--kv-disk-gb", "0.1",
           "--cache-secret-file", str(secret)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "the KV store of Ray node" in out.stderr and "failed to start" in out.stderr, out.stderr[-3000:]
