"""TP and PP cores under ``kvferry serve --ray``: each core's ranks are one
Ray placement group, packed on one node (default) or spread over the
nodes (``--ray-rank-placement spread``), on a real two-node Ray cluster
(the fleet tests' two ``ray start`` nodes on this host, each offering 5 of
resource "rank"), through real HTTP and the openai client.

- TP 2 packed and spread, and PP 2 spread, give HF float32's greedy text;
  ``/v1/admin/workers`` names each rank's Ray node (one node packed, both
  spread), and spread ranks talk over tcp with CURVE (no ipc, no shm);
- expert parallelism spread (``-tp 2 --enable-expert-parallel``, a tiny
  Qwen2-MoE): each node's rank holds half the experts, their partial
  outputs meet over tcp, and the text is EP 1's (one rank) and HF's;
- a spread rank killed with SIGKILL (an expert-parallel one: the same
  group restart as any TP group's) ends the stream in flight with an error
  (none hangs), restarts its whole group under Ray, and the server serves
  the same text again;
- a group the cluster cannot place (pack needs 2 x 3 "rank" on one node)
  fails within --scale-timeout-s, naming the resources.

The fleet tests' one cluster (Ray is heavy on a 2-core host: a cluster of
its own cost this module a second start), and the four layouts' servers
started at once on it."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from functools import partial

import httpx
import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'kvferry[ray]')")

import openai  # noqa: E402

from kvferry import LLM, SamplingParams  # noqa: E402
from tests.engine.hf_reference import hf_greedy, load_hf  # noqa: E402
from tests.parallel.afd_helpers import servers_at_once  # noqa: E402
from tests.serve.server_process import start_server  # noqa: E402
from tests.tiny_models import make_tiny_checkpoint  # noqa: E402
from tests.tiny_moe_models import make_tiny_moe_checkpoint  # noqa: E402

PROMPT = [5, 17, 33, 100, 200, 7, 7, 9]
MAX_NEW = 8
RANK = json.dumps({"rank": 1})


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster  # the fleet tests' one cluster (conftest.py): its nodes offer "n0"/"n1" and 5 "rank" each


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("ray-ranks-model"), arch="llama", num_attention_heads=8,
                                    num_key_value_heads=4, vocab_size=387, num_hidden_layers=2,
                                    max_position_embeddings=1024))


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """8 experts, top-2, the gated shared expert: 4 whole experts a rank under EP 2."""
    return str(make_tiny_moe_checkpoint(tmp_path_factory.mktemp("ray-ranks-moe"), "qwen2_moe_top2",
                                        max_position_embeddings=1024))


def _expected(checkpoint: str) -> str:
    """HF float32's greedy continuation, as the text the server returns."""
    ids = hf_greedy(load_hf(checkpoint), PROMPT, MAX_NEW)
    llm = LLM(model=checkpoint, dtype="float32", kv_cache_memory_gb=0.02, warm_up=False)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ids
    return out.text


def _serve(cluster, checkpoint, log, *args: str):
    if args and args[0] == "--model":  # a layout with a model of its own
        checkpoint, args = args[1], args[2:]
    try:
        return start_server(log, ["--model", checkpoint, "--ray", cluster.address, "--ray-engine-resources", RANK,
                                  "--cpu-threads-per-rank", "1", *args])
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n--- Ray cluster:\n{cluster.logs()}") from None


# Every layout's server at once on the one cluster: 5 "rank" a node hold
# them all (at most the packed 2 and one of each spread group on one node).
LAYOUTS = {"packed-tp2": ("-tp", "2"), "spread-tp2": ("-tp", "2", "--ray-rank-placement", "spread"),
           "spread-pp2": ("-pp", "2", "--ray-rank-placement", "spread"),
           "spread-ep2": ("-tp", "2", "--enable-expert-parallel", "--ray-rank-placement", "spread")}


@pytest.fixture(scope="module")
def servers(cluster, checkpoint, moe_checkpoint, tmp_path_factory):
    """The layouts' servers, started at once while HF and the offline LLM
    (one rank: EP 1 for the MoE) compute each model's expected text."""
    logs = {name: tmp_path_factory.mktemp(f"ray-{name}") / "server.log" for name in LAYOUTS}
    models = {name: ("--model", moe_checkpoint) if "ep" in name else () for name in LAYOUTS}
    with servers_at_once({name: partial(_serve, cluster, checkpoint, logs[name], *models[name], *args)
                          for name, args in LAYOUTS.items()},
                         meanwhile=lambda: (_expected(checkpoint), _expected(moe_checkpoint))) as both:
        yield both


@pytest.fixture(scope="module")
def expected(servers) -> str:
    return servers[1][0]


@pytest.fixture(scope="module")
def moe_expected(servers) -> str:
    return servers[1][1]


@pytest.fixture(scope="module")
def spread_ep(servers):
    return servers[0]["spread-ep2"]


@pytest.fixture(scope="module")
def spread_tp(servers):
    return servers[0]["spread-tp2"]


def _worker(srv) -> dict:
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=30)
    assert r.status_code == 200, r.text
    [worker] = r.json()["data"]
    return worker


def _complete(srv) -> str:
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=120) as client:
        r = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=MAX_NEW,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_NEW
    return r.choices[0].text


def _nodes(worker: dict) -> list[str]:
    ranks = worker["ranks"]
    assert [r["rank"] for r in ranks] == list(range(len(ranks))) and all(r["alive"] for r in ranks), ranks
    return [r["node"] for r in ranks]


def test_tp2_packed_on_one_node_equals_hf(servers, cluster, expected):
    srv = servers[0]["packed-tp2"]
    assert _complete(srv) == expected
    nodes = _nodes(_worker(srv))
    assert len(nodes) == 2 and nodes[0] == nodes[1] and nodes[0] in cluster.node_ids.values(), nodes


def test_tp2_spread_over_two_nodes_equals_hf(spread_tp, cluster, expected):
    assert _complete(spread_tp) == expected
    nodes = _nodes(_worker(spread_tp))
    assert sorted(nodes) == sorted([cluster.node_ids["n0"], cluster.node_ids["n1"]]), nodes


def test_pp2_stages_on_two_nodes_equal_hf(servers, expected):
    srv = servers[0]["spread-pp2"]
    assert _complete(srv) == expected
    worker = _worker(srv)
    assert worker["pipeline_parallel_size"] == 2
    nodes = _nodes(worker)
    assert len(set(nodes)) == 2, nodes


def test_ep2_spread_over_two_nodes_equals_one_rank(spread_ep, cluster, moe_expected):
    assert _complete(spread_ep) == moe_expected
    worker = _worker(spread_ep)
    assert worker["tensor_parallel_size"] == 2
    nodes = _nodes(worker)
    # Two Ray nodes share no memory: the experts' all-reduce went over tcp (CURVE).
    assert sorted(nodes) == sorted([cluster.node_ids["n0"], cluster.node_ids["n1"]]), nodes


def test_a_killed_spread_rank_restarts_its_group(spread_ep, cluster, moe_expected):
    """An expert-parallel rank's death with a stream in flight: the stream
    ends with an error (one core: nowhere to migrate), none hangs; the group
    (the core and both ranks) restarts in its bundles, and the same text
    comes back."""
    spread_tp, expected = spread_ep, moe_expected
    before = _worker(spread_tp)
    victim = before["ranks"][1]["pid"]
    outcome: list[str] = []
    decoding = threading.Event()

    def stream() -> None:
        with openai.OpenAI(base_url=spread_tp.api_url, api_key="unused", max_retries=0, timeout=120) as client:
            try:
                events = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                                   max_tokens=400, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True})
                for event in events:
                    decoding.set()
                    if event.choices and event.choices[0].finish_reason == "length":
                        outcome.append("finished")
                        return
                outcome.append("ended without a finish")
            except openai.APIError as exc:
                outcome.append(f"error: {type(exc).__name__}")
            finally:
                decoding.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert decoding.wait(120), "the stream never started"
    os.kill(victim, signal.SIGKILL)  # the rank's process (two Ray nodes, one host)
    reader.join(120)
    assert not reader.is_alive(), "the stream hung after its rank died"
    assert outcome and outcome[0].startswith("error"), outcome
    deadline = time.monotonic() + 240
    while True:
        try:
            worker = _worker(spread_tp)
            if worker["alive"] and worker["num_restarts"] > before["num_restarts"] and len(worker["ranks"]) == 2 \
                    and victim not in [r["pid"] for r in worker["ranks"]]:
                break
        except (httpx.HTTPError, AssertionError):
            pass
        assert time.monotonic() < deadline, f"the group did not come back:\n{spread_tp.log()[-4000:]}"
        time.sleep(0.2)
    assert "tensor-parallel rank 1" in spread_tp.log()
    assert sorted(_nodes(worker)) == sorted([cluster.node_ids["n0"], cluster.node_ids["n1"]])
    assert _complete(spread_tp) == expected


def test_an_unplaceable_group_fails_in_time_naming_the_resources(cluster, checkpoint, tmp_path):
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        start_server(tmp_path / "server.log", ["--model", checkpoint, "--ray", cluster.address, "-tp", "2",
                                               "--ray-engine-resources", json.dumps({"rank": 3}),
                                               "--scale-timeout-s", "3"])
    assert time.monotonic() - start < 120
    text = str(info.value)
    assert "cannot place engine core engine-0: its 2 ranks need {rank: 3} each, all on one node" in text, text
