"""Load at arrival: a request queued behind ``max_num_seqs`` loads its tier
hits while it waits (a real ``kvferry kvstore`` process), its output stays
greedy-identical, and the blocks it loaded are its own until it runs, is
aborted, or a running request needs them."""
from __future__ import annotations

import random

import pytest

from kvferry import SamplingParams
from kvferry.config import KVTierConfig
from kvferry.engine.engine import LLMEngine
from kvferry.kvstore.launch import start_store
from kvferry.core.request import RequestStatus
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_models import make_tiny_checkpoint

BLOCK = 8
LONG_TOKENS = 70  # the running request's decode: long enough to outlast the queued request's load
SHORT_TOKENS = 8


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("ahead"), arch="llama", max_position_embeddings=512))
    hf = load_hf(path)
    rng = random.Random(5)
    long_prompt = [rng.randrange(3, hf.config.vocab_size) for _ in range(45)]
    history = [rng.randrange(3, hf.config.vocab_size) for _ in range(64)]
    queued = history + [9, 8, 7]
    return path, hf, long_prompt, history, queued


@pytest.fixture
def store(case):
    """A store holding ``history``'s KV (written by an engine of its own)."""
    path, _, _, history, _ = case
    process, address = start_store(KVTierConfig(kv_dram_gb=0.02))
    writer = engine(path, address, num_kv_blocks=64)
    writer.add_request("history", history, greedy(1))
    run_to_end(writer)
    writer.core.close()
    yield address
    process.terminate()
    process.wait(timeout=10)


def engine(path: str, address: str, **kwargs) -> LLMEngine:
    return LLMEngine.from_args(model=path, dtype="float32", block_size=BLOCK, kv_store=address, **kwargs)


def run_to_end(llm: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens


def step_until(llm: LLMEngine, done, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if done():
            return
        llm.step()
    raise AssertionError("condition not reached")


def queue_behind_long(llm: LLMEngine, long_prompt: list[int], queued: list[int], long_tokens: int = LONG_TOKENS):
    """The long request runs (max_num_seqs=1); the other one queues behind it."""
    llm.add_request("long", long_prompt, greedy(long_tokens))
    llm.step()
    llm.add_request("queued", queued, greedy(SHORT_TOKENS))
    sched = llm.core.scheduler
    return sched, sched.requests["long"], sched.requests["queued"]


def test_queued_request_loads_while_it_waits_and_output_is_unchanged(case, store):
    path, hf, long_prompt, history, queued = case
    llm = engine(path, store, num_kv_blocks=64, max_num_seqs=1)
    sched, long_req, queued_req = queue_behind_long(llm, long_prompt, queued)
    loaded = (len(queued) - 1) // BLOCK * BLOCK
    step_until(llm, lambda: sched.num_loaded_tokens == loaded)
    # Loaded while the long request still runs: the queued one has not run.
    assert long_req.status == RequestStatus.RUNNING and long_req.num_output_tokens < LONG_TOKENS
    assert queued_req.status == RequestStatus.WAITING and queued_req.num_output_tokens == 0
    assert queued_req.num_computed_tokens == loaded and queued_req.first_scheduled_time is None
    assert sched.num_loads_ahead == 1 and not sched.loading
    llm.check_integrity()
    tokens = run_to_end(llm)
    assert_greedy_match(hf, long_prompt, tokens["long"], hf_greedy(hf, long_prompt, LONG_TOKENS))
    assert_greedy_match(hf, queued, tokens["queued"], hf_greedy(hf, queued, SHORT_TOKENS))
    stats = llm.stats()
    assert stats.kv_loaded_tokens == loaded and stats.kv_partial_loads == 0
    llm.check_integrity()
    llm.core.close()


def test_aborted_queued_request_releases_its_loaded_blocks(case, store):
    path, hf, long_prompt, history, queued = case
    llm = engine(path, store, num_kv_blocks=64, max_num_seqs=1)
    sched, long_req, queued_req = queue_behind_long(llm, long_prompt, queued)
    step_until(llm, lambda: queued_req.num_computed_tokens > 0 and not sched.loading)
    held_by_long = len(sched.kv.req_blocks["long"])
    assert sched.kv.pool.num_used_blocks == held_by_long + len(sched.kv.req_blocks["queued"])
    llm.abort_request("queued")
    assert sched.kv.pool.num_used_blocks == held_by_long
    llm.check_integrity()
    tokens = run_to_end(llm)
    assert "queued" not in tokens or len(tokens["queued"]) == 0
    assert_greedy_match(hf, long_prompt, tokens["long"], hf_greedy(hf, long_prompt, LONG_TOKENS))
    assert sched.kv.pool.num_used_blocks == 0
    llm.check_integrity()
    llm.core.close()


def test_running_request_takes_back_blocks_loaded_ahead(case, store):
    # 17 blocks: the long request starts with 6 and grows to 15; the queued
    # one loads 8 ahead while 11 are spare. The long one then needs them: the
    # queued request gives them up (no preemption of a running request), and
    # still answers exactly once admitted.
    path, hf, long_prompt, history, queued = case
    llm = engine(path, store, num_kv_blocks=17, max_num_seqs=1)
    sched, long_req, queued_req = queue_behind_long(llm, long_prompt, queued)
    step_until(llm, lambda: queued_req.num_computed_tokens > 0 and not sched.loading)
    assert sched.num_loads_ahead == 1
    tokens = run_to_end(llm)
    assert sched.num_preemptions == 0
    assert_greedy_match(hf, long_prompt, tokens["long"], hf_greedy(hf, long_prompt, LONG_TOKENS))
    assert_greedy_match(hf, queued, tokens["queued"], hf_greedy(hf, queued, SHORT_TOKENS))
    llm.check_integrity()
    llm.core.close()


def test_no_load_ahead_into_blocks_running_requests_need(case, store):
    # 12 blocks: the long request (20 tokens) holds 6 and its prompt + next
    # token need no more, so 6 are spare: too few for the queued request's 8.
    # It waits and loads once admitted.
    path, hf, long_prompt, history, queued = case
    llm = engine(path, store, num_kv_blocks=12, max_num_seqs=1)
    sched, long_req, queued_req = queue_behind_long(llm, long_prompt, queued, long_tokens=20)
    for _ in range(5):
        llm.step()
    assert sched.num_loads_ahead == 0 and queued_req.num_computed_tokens == 0
    tokens = run_to_end(llm)
    assert_greedy_match(hf, queued, tokens["queued"], hf_greedy(hf, queued, SHORT_TOKENS))
    assert llm.stats().kv_loaded_tokens == (len(queued) - 1) // BLOCK * BLOCK
    llm.core.close()
