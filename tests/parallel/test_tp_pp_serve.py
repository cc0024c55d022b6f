"""A real ``kvferry serve -tp 2 -pp 2`` (tensor and pipeline parallelism in
one core, as vLLM users type it) through the openai client, on a tiny
random Llama of 3 layers and an odd vocabulary (one server, shared by the
module's tests): greedy output equals HF transformers (float32), alone and
with concurrent requests cut into micro-batches; ``/v1/admin/workers``
lists the core's four ranks (stage r // 2, TP rank r % 2) with the pids of
its real processes; a rank of the second stage killed with SIGKILL ends the
whole group, after which the server restarts it and serves again. A Qwen3
config runs the same layout offline (``LLM``, with n-gram drafts) against HF."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kvferry import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, load_hf
from tests.parallel.afd_helpers import MAX_NEW, PROMPTS, reference
from tests.parallel.test_tensor_parallel_serve import _alive, _children, _title
from tests.serve.server_process import start_server
from tests.tiny_models import make_tiny_checkpoint

LAYOUT = ["-tp", "2", "-pp", "2", "--cpu-threads-per-rank", "1", "--pp-micro-batches", "2"]


def tiny(tmp_path_factory, arch: str) -> str:
    # 4 query heads and 2 KV heads split over 2 ranks; 3 layers over 2 stages (2 + 1); vocab 387 pads over 2 ranks
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp(f"tp-pp-{arch}"), arch=arch, num_hidden_layers=3,
                                    vocab_size=387, max_position_embeddings=1024))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server -tp 2 -pp 2, each prompt's greedy text: HF's token ids, as text by a one-process core)."""
    path = tiny(tmp_path_factory, "llama")
    srv = start_server(tmp_path_factory.mktemp("tp-pp-log") / "server.log", ["--model", path, *LAYOUT])
    try:  # while the server's ranks load
        texts = reference(path)
    except BaseException:
        srv.stop()
        raise
    yield srv, texts
    assert srv.stop() == 0, srv.log()[-5000:]  # SIGTERM drains: rank 0 stops the other three


def complete(srv, prompt: list[int]) -> str:
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_NEW
    return r.choices[0].text


def assert_live_ranks(srv) -> list[int]:
    """Four live ranks whose pids are the core's real processes: rank 0 is
    the core itself, ranks 1..3 its children titled "kvferry: engine-0 rank r"."""
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=30)
    assert r.status_code == 200, r.text
    [worker] = r.json()["data"]
    assert worker["pipeline_parallel_size"] == 2 and worker["tensor_parallel_size"] == 2, worker
    listed = worker["ranks"]
    assert [x["rank"] for x in listed] == [0, 1, 2, 3], listed
    assert all(x["alive"] and x["cpu_threads"] == 1 for x in listed), listed
    core = worker["pid"]
    assert listed[0]["pid"] == core and _alive(core) and "rank" not in _title(core)
    for x in listed[1:]:
        assert _title(x["pid"]).startswith(f"kvferry: engine-0 rank {x['rank']}") and x["pid"] in _children(core)
    return [x["pid"] for x in listed]


def test_served_greedy_output_equals_hf_alone_and_concurrent(served):
    srv, expected = served
    assert complete(srv, PROMPTS[0]) == expected[0]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one step's batch, cut into 2 micro-batches
        assert list(pool.map(lambda p: complete(srv, p), PROMPTS)) == expected


def test_qwen3_offline_with_ngram_drafts_equals_hf(tmp_path_factory):
    """Offline, on a Qwen3 config (per-head q/k norms), with n-gram drafts
    verified on the last stage (a repeating prompt makes them)."""
    path = tiny(tmp_path_factory, "qwen3")
    prompts = [*PROMPTS, [5, 6, 7, 8, 9, 10] * 6]
    llm = LLM(model=path, dtype="float32", kv_cache_memory_gb=0.02, warm_up=False, tensor_parallel_size=2,
              pipeline_parallel_size=2, cpu_threads_per_rank=1, pp_micro_batches=2,
              speculative={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})  # drafts, whatever they cost
    try:
        assert [r.rank for r in llm.engine.core.ranks()] == [0, 1, 2, 3]
        out = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
        assert llm.engine.core.scheduler.stats().num_draft_tokens > 0
    finally:
        llm.engine.core.close()
    hf = load_hf(path)
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def test_a_killed_rank_restarts_the_whole_group(served):
    srv, expected = served
    pids = assert_live_ranks(srv)
    os.kill(pids[3], signal.SIGKILL)  # stage 1's TP rank 1: neither the core nor its activations' peer
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "a rank outlived its group"
    assert "TP x PP rank 3" in srv.log() and "SIGKILL" in srv.log()
    deadline = time.monotonic() + 300
    while True:  # restarted whole (four new ranks), it serves the same text again
        try:
            assert complete(srv, PROMPTS[0]) == expected[0]
            break
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    assert not set(pids) & set(assert_live_ranks(srv))
