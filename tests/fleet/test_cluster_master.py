"""``kvferry serve --ray ADDRESS --kv-cluster auto``: the server starts the
cluster KV pool's ``mooncake_master`` itself, on the Ray head node, on a
real two-node Ray cluster (two ``ray start`` nodes on this host: the head
offers "pnode", the other "dnode"), reached over real HTTP through the
openai client.

The master is an actor pinned to the head node whose child process is a
real ``mooncake_master``, listening on the head node's address only; every
node's store writes its blocks through to it; SIGKILLed, Ray starts it
again at the same URL, requests stay correct meanwhile and the stores
write to it again; it ends with the server."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'kvferry[ray]')")

import openai  # noqa: E402

from kvferry import LLM, SamplingParams  # noqa: E402
from tests.fleet.ray_cluster import RayCluster  # noqa: E402
from tests.kvstore.mooncake_master import mooncake_binary  # noqa: E402
from tests.serve.server_process import ServerProcess, start_server  # noqa: E402
from tests.tiny_models import make_tiny_checkpoint  # noqa: E402

MODEL = "tiny"
BLOCK = 16
MAX_TOKENS = 8
# Several blocks long: its full blocks are written through to the pool.
PROMPTS = [f"{i}: the cat sat on the mat; the dog sat on the log; they are friends and they play. " * 3
           for i in range(10)]
RESTART_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    mooncake_binary()  # skips, naming what is missing, where Mooncake cannot load
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("master-tiny"), arch="llama", num_hidden_layers=2,
                                    max_position_embeddings=1024))


@pytest.fixture(scope="module")
def expected(tiny) -> dict[str, str]:
    llm = LLM(model=tiny, dtype="float32")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = {p: llm.generate([p], params)[0].outputs[0].text for p in PROMPTS}
    del llm
    return out


@pytest.fixture(scope="module")
def server(ray_cluster, tiny, tmp_path_factory):
    log = tmp_path_factory.mktemp("master-serve") / "server.log"
    try:
        srv = start_server(log, [tiny, "--served-model-name", MODEL, "--ray", ray_cluster.address, "--mode", "disagg",
                                 "--prefill", "1", "--decode", "1",
                                 "--ray-prefill-resources", json.dumps({"pnode": 1}),
                                 "--ray-decode-resources", json.dumps({"dnode": 1}),
                                 # Small segments and buffers: a 2-core test host.
                                 "--kv-cluster", "auto?segment_gb=0.0625&buffer_mb=16",
                                 "--kv-dram-gb", "0.05", "--block-size", str(BLOCK)])
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n--- Ray cluster:\n{ray_cluster.logs()}") from None
    master = _master(ray_cluster)
    srv.master_pid = master["pid"]
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"
    # The master (and its actor) end with the server.
    latest = _master(ray_cluster, missing_ok=True) or master
    deadline = time.monotonic() + 30
    while any(_alive(m[k]) for m in (latest, master) for k in ("pid", "metadata_pid", "actor_pid")):
        assert time.monotonic() < deadline, f"the mooncake_master outlived its server: {latest}"
        time.sleep(0.2)


# A driver of its own (this test process stays free of Ray): the server's master, as its actor reports it.
_MASTER_SCRIPT = """
import dataclasses, json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
out = None
for entry in ray.util.list_named_actors(all_namespaces=True):
    if entry["name"].startswith("kvferry-mooncake-master-"):
        try:
            info = ray.get(ray.get_actor(entry["name"], namespace=entry["namespace"]).info.remote(), timeout=120)
        except Exception:
            continue
        out = dataclasses.asdict(info)
print(json.dumps(out))
"""


def _master(cluster: RayCluster, missing_ok: bool = False) -> dict | None:
    out = subprocess.run([sys.executable, "-c", _MASTER_SCRIPT, cluster.address], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info is not None or missing_ok, "no mooncake_master actor"
    return info


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _listening_addresses(ports: set[int]) -> dict[int, str]:
    """port -> the IPv4 address a socket listens on, from /proc/net/tcp."""
    out = {}
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            address, port = fields[1].split(":")
            if fields[3] == "0A" and int(port, 16) in ports:  # LISTEN
                out[int(port, 16)] = ".".join(str(b) for b in reversed(bytes.fromhex(address)))
    return out


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=180)


def _greedy(c: openai.OpenAI, prompt: str) -> str:
    return c.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text


def _written(srv: ServerProcess) -> float:
    return srv.metric("kvferry:kv_tier_written_bytes_total", tier="cluster")


def test_master_runs_on_the_head_node_bound_to_its_address(server, ray_cluster):
    master = _master(ray_cluster)
    assert master["node_id"] == ray_cluster.node_ids["pnode"]  # the head offers "pnode"
    with open(f"/proc/{master['pid']}/cmdline", "rb") as f:
        assert os.path.basename(f.read().split(b"\0")[0]) == b"mooncake_master"
    with open(f"/proc/{master['pid']}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) == master["actor_pid"]  # the actor's child
    with open(f"/proc/{master['metadata_pid']}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) == master["actor_pid"]
    ports = master["ports"]
    bound = _listening_addresses({ports["rpc"], ports["metadata"], ports["metrics"]})
    # Both on the head node's Ray address, never a wildcard.
    assert bound == {ports["rpc"]: master["host"], ports["metadata"]: master["host"],
                     ports["metrics"]: master["host"]}
    assert master["host"] != "0.0.0.0"


def test_blocks_are_written_through_to_the_pool(server, ray_cluster, expected):
    with _client(server) as c:
        for prompt in PROMPTS[:2]:
            assert _greedy(c, prompt) == expected[prompt]
    assert server.wait_for_metric("kvferry:kv_tier_written_bytes_total", lambda v: v > 0, timeout_s=60,
                                  tier="cluster") > 0
    assert _master(ray_cluster)["pid"] == server.master_pid  # the same master since the start


def test_a_killed_master_is_restarted_by_ray_at_the_same_url(server, ray_cluster, expected):
    before = _master(ray_cluster)
    os.kill(before["pid"], signal.SIGKILL)
    with _client(server) as c:
        # Meanwhile: the pool misses, the prompts are computed, the text is the same.
        assert _greedy(c, PROMPTS[2]) == expected[PROMPTS[2]]
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            after = _master(ray_cluster, missing_ok=True)
            if after is not None and after["pid"] != before["pid"] and _alive(after["pid"]):
                break
            assert time.monotonic() < deadline, "Ray did not start the mooncake_master again"
            time.sleep(1)
        assert (after["host"], after["ports"], after["node_id"]) == (before["host"], before["ports"],
                                                                      before["node_id"])
        # The stores rejoin the new master by themselves: their blocks are written through again.
        written = _written(server)
        for prompt in PROMPTS[3:]:
            assert _greedy(c, prompt) == expected[prompt]
            if _written(server) > written:
                break
            # The write-through is behind the answer: up to 2 s for it (at once when it lands sooner).
            server.wait_for_metric("kvferry:kv_tier_written_bytes_total", lambda v: v > written, timeout_s=2,
                                   tier="cluster")
        assert server.wait_for_metric("kvferry:kv_tier_written_bytes_total", lambda v: v > written, timeout_s=30,
                                      tier="cluster") > written, "no block written to the restarted master"
