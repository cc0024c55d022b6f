"""Attention/FFN disaggregation under ``kvferry serve --ray``: the attention
core and the FFN worker are Ray actors placed by resources, on the fleet
tests' real two-node Ray cluster (conftest.py: two ``ray start`` nodes on
this host; the core asks for the head's "pnode", each FFN worker for half a
"dnode", which only the other node offers), through real HTTP and the
openai client.

- AFD 1+1 with the FFN worker on the other node (``--ray-ffn-resources``)
  gives HF float32's greedy text, alone and concurrent; ``/v1/admin/workers``
  names each one's node;
- the core reaches that worker over tcp, whose port takes only CURVE peers
  holding the server's key: a plain peer's and a stranger key's pickled
  frames are never read (the pickle that would write a file writes none);
- ``kvferry scale --ffn 2`` starts two workers on the "dnode" node beside the
  one serving, and the text stays HF's;
- an FFN worker killed with SIGKILL while streams run ends those streams
  (none hangs), the pool places a new generation, and the server serves the
  same text again.

The fleet tests' one cluster, and one server for the module (Ray is heavy
on a 2-core host)."""
from __future__ import annotations

import json
import os
import pickle
import signal
import threading
import time
from functools import partial

import httpx
import openai
import pytest
import zmq

pytest.importorskip("ray", reason="ray is not installed (pip install 'kvferry[ray]')")

from tests.parallel.afd_helpers import (PROMPTS, complete, complete_all, reference, scale,  # noqa: E402
                                        servers_at_once, workers)
from tests.serve.server_process import start_server  # noqa: E402
from tests.tiny_models import make_tiny_checkpoint  # noqa: E402
from tests.tcp_sockets import tcp_sockets  # noqa: E402


CORE = json.dumps({"pnode": 1})
FFN = json.dumps({"dnode": 0.5})  # a resize holds the old worker's half and the new two's beside it


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster  # the fleet tests' one cluster (conftest.py)


def _serve(cluster, path: str, log):  # noqa: ANN001, ANN202 - a ServerProcess
    try:
        return start_server(log, ["--model", path, "--mode", "afd", "--attention", "1", "--ffn", "1",
                                  "--ray", cluster.address, "--ray-engine-resources", CORE,
                                  "--ray-ffn-resources", FFN, "--cpu-threads-per-rank", "1"])
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n--- Ray cluster:\n{cluster.logs()}") from None


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("ray-afd-model"), arch="llama", num_hidden_layers=2,
                                    vocab_size=387, max_position_embeddings=1024))
    log = tmp_path_factory.mktemp("ray-afd-server") / "server.log"
    with servers_at_once({"afd": partial(_serve, cluster, path, log)}, meanwhile=partial(reference, path)) as (
            started, expected):
        yield started["afd"], expected


def _ranks(srv) -> list[dict]:  # noqa: ANN001
    [worker] = workers(srv)
    ranks = worker["ranks"]
    assert [r["rank"] for r in ranks] == list(range(len(ranks))) and all(r["alive"] for r in ranks), worker
    assert worker["ffn_workers"] == len(ranks) - 1, worker
    return ranks


def test_ffn_worker_on_the_other_node_equals_hf(served, cluster):
    srv, expected = served
    assert complete(srv, PROMPTS[0]) == expected[0]
    assert complete_all(srv, PROMPTS) == expected
    core, ffn = _ranks(srv)
    assert core["node"] == cluster.node_ids["pnode"] and ffn["node"] == cluster.node_ids["dnode"], (core, ffn)
    assert ffn["cpu_threads"] == 1, ffn  # --cpu-threads-per-rank, as the worker's actor says




class _WritesAFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204 - unpickling this opens (creates) the file
        return (open, (self.path, "w"))


def test_the_ffn_worker_takes_only_curve_peers_with_the_servers_key(served, cluster, tmp_path):
    srv, expected = served
    core, ffn = _ranks(srv)
    [(port, _)] = tcp_sockets(ffn["pid"], "0A")
    assert port in [remote for _, remote in tcp_sockets(core["pid"], "01")]  # the core on the other node: over tcp
    marker = tmp_path / "unpickled"
    frames = [pickle.dumps(_WritesAFile(str(marker))), b"\0" * 8]
    ctx = zmq.Context()
    try:
        stranger = zmq.curve_keypair()
        for curve in (None, stranger):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:  # a key pair of its own, and a guess at the server's
                sock.curve_publickey, sock.curve_secretkey = curve
                sock.curve_serverkey = zmq.curve_keypair()[0]
            sock.connect(f"tcp://{cluster.node_hosts['dnode']}:{port}")
            sock.send_multipart(frames)
            assert not sock.poll(1500), "the FFN worker answered a peer without the server's key"
            sock.close()
    finally:
        ctx.term()
    assert not marker.exists(), "the FFN worker unpickled a frame from a peer without the server's key"
    assert complete(srv, PROMPTS[0]) == expected[0]


def test_kvferry_scale_ffn_under_ray(served, cluster):
    srv, expected = served
    up = scale(srv, "--ffn", "2")
    assert up.returncode == 0, up.stdout + up.stderr + srv.log()[-4000:]
    deadline = time.monotonic() + 60
    while len(_ranks(srv)) != 3:  # a core moves to the new generation at its next step
        complete(srv, PROMPTS[1])
        assert time.monotonic() < deadline, workers(srv)
    assert [r["node"] for r in _ranks(srv)[1:]] == [cluster.node_ids["dnode"]] * 2
    assert complete_all(srv, PROMPTS) == expected


def test_a_killed_ffn_worker_is_replaced_and_the_server_serves_again(served, cluster):
    srv, expected = served
    before = _ranks(srv)
    victim = before[1]["pid"]
    outcomes: list[str] = []
    started = threading.Barrier(3)

    def long_stream(i: int) -> None:
        try:
            with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300) as client:
                chunks = client.completions.create(model=client.models.list().data[0].id, prompt=[7 + i, 8],
                                                   max_tokens=300, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True})
                for n, _ in enumerate(chunks):
                    if n == 0:
                        started.wait(120)
            outcomes.append("done")
        except openai.APIError as exc:
            outcomes.append(f"failed: {exc}")

    threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait(120)
    os.kill(victim, signal.SIGKILL)  # the worker's process (two Ray nodes, one host)
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a stream hung after its FFN worker died"
    assert len(outcomes) == 2, outcomes
    deadline = time.monotonic() + 240
    while True:  # a new generation on the "dnode" node; the core restarted by Ray
        try:
            assert complete_all(srv, PROMPTS) == expected
            ranks = _ranks(srv)
            if victim not in [r["pid"] for r in ranks]:
                break
        except (openai.APIError, httpx.HTTPError, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert all(r["node"] == cluster.node_ids["dnode"] for r in ranks[1:]), ranks
    assert "FFN workers restart whole" in srv.log()
