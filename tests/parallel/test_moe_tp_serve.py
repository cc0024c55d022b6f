"""A real ``kvferry serve -tp 2 --enable-expert-parallel`` on a tiny random
Qwen2-MoE (8 experts, top-2, the gated shared expert), through the openai
client: concurrent greedy completions equal HF transformers in float32;
``/v1/admin/workers`` lists the core's two ranks; an expert-parallel rank
killed with SIGKILL under load ends the streams in flight with an error
(none hangs), and the server restarts the core and serves the same text again."""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.engine.hf_reference import hf_greedy
from tests.parallel.test_tensor_parallel_serve import _alive, _children, _title, assert_live_ranks
from tests.serve.server_process import SERVE_ARGS, start_server
from tests.tiny_models import load_hf_model
from tests.tiny_moe_models import make_tiny_moe_checkpoint

MAX_NEW = 10


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-ep-serve")
    path = make_tiny_moe_checkpoint(root, "qwen2_moe_top2")
    hf = load_hf_model(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    rng = random.Random(48)
    # Printable ASCII tokens only, so that the served text of HF's tokens is unambiguous.
    vocab = [i for i in range(3, hf.config.vocab_size) if tok.decode([i]).isascii() and tok.decode([i]).strip()]
    prompts = [[rng.choice(vocab) for _ in range(n)] for n in (3, 9, 17, 6)]
    expected = [tok.decode(hf_greedy(hf, p, MAX_NEW)) for p in prompts]
    return path, prompts, expected


@pytest.fixture(scope="module")
def server(moe, tmp_path_factory):
    path = moe[0]
    args = list(SERVE_ARGS)
    args[args.index("--max-model-len") + 1] = "256"  # the tiny model's max_position_embeddings
    args[args.index("--kv-cache-memory-gb") + 1] = "0.05"
    srv = start_server(tmp_path_factory.mktemp("moe-ep-log") / "server.log",
                       ["--model", str(path), "--tensor-parallel-size", "2", "--enable-expert-parallel",
                        "--cpu-threads-per-rank", "1"], serve_args=args)
    yield srv
    assert srv.stop() == 0, srv.log()[-5000:]


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300)


def completions(srv, prompts: list[list[int]]) -> list[str]:
    """Greedy texts of ``prompts``, sent at once (their tokens share steps)."""
    with _client(srv) as client:
        model = client.models.list().data[0].id

        def one(prompt: list[int]) -> str:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == MAX_NEW
            return r.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))


def test_concurrent_greedy_completions_equal_hf(server, moe):
    _, prompts, expected = moe
    assert completions(server, prompts) == expected
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_admin_workers_lists_the_expert_parallel_ranks(server):
    assert_live_ranks(server, "engine-0")


def test_a_killed_expert_rank_ends_the_streams_and_the_server_serves_again(server, moe):
    _, prompts, expected = moe
    core = next(p for p in _children(server.proc.pid) if "kvferry: engine-0" in _title(p))
    worker = next(p for p in _children(core) if "rank 1" in _title(p))
    outcomes: list[str] = []
    started = threading.Barrier(len(prompts) + 1)

    def stream(prompt: list[int]) -> None:
        # Long streams: still decoding when the rank dies.
        with _client(server) as client:
            model = client.models.list().data[0].id
            try:
                events = client.completions.create(model=model, prompt=prompt, max_tokens=230, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
                first = True
                for event in events:
                    if first:
                        started.wait(60)
                        first = False
                    if event.choices and event.choices[0].finish_reason == "length":
                        outcomes.append("finished")
                        return
                outcomes.append("ended without a finish")
            except openai.APIError as exc:
                outcomes.append(f"error: {type(exc).__name__}")

    threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    started.wait(120)  # every stream has its first token
    os.kill(worker, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hung after its rank died"
    assert len(outcomes) == len(prompts) and "finished" not in outcomes, outcomes
    assert "tensor-parallel rank 1" in server.log() and "SIGKILL" in server.log()
    deadline = time.monotonic() + 300  # the core restarts whole, with new ranks
    while True:
        try:
            assert completions(server, prompts) == expected
            break
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    assert not _alive(worker)
    assert worker not in assert_live_ranks(server, "engine-0")
