"""Attention/FFN disaggregation below the server: ``LLM(ffn=2)`` (a core
alone, with its own two FFN workers in a private folder, the warm-up
included) equals HF transformers and leaves no worker behind; a shared
folder that others could reach is refused; the server's FFN pool restarts
its workers whole when one is killed, and stays down once its budget is
spent."""
from __future__ import annotations

import os
import signal
import time

import pytest

from kvferry import LLM, SamplingParams
from kvferry.config import EngineArgs
from kvferry.engine.afd_leader import AFDLeader
from kvferry.engine.afd_pool import FFNPool, read_generation
from tests.engine.hf_reference import hf_greedy, load_hf
from tests.parallel.afd_helpers import PROMPTS, _alive, _title
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("afd"), arch="qwen3", num_hidden_layers=2,
                                    vocab_size=387, max_position_embeddings=1024))


def test_a_core_with_its_own_two_ffn_workers_equals_hf(checkpoint):
    hf = load_hf(checkpoint)
    llm = LLM(model=checkpoint, dtype="float32", kv_cache_memory_gb=0.02, ffn=2, warm_up=True)
    try:
        ranks = llm.engine.core.ranks()
        assert [r.rank for r in ranks] == [0, 1, 2] and all(r.alive for r in ranks)
        assert all(f"ffn {j}" in _title(r.pid) for j, r in enumerate(ranks[1:]))
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in out] == [hf_greedy(hf, p, 6) for p in PROMPTS]
    finally:
        llm.engine.core.close()
    deadline = time.monotonic() + 30
    while any(_alive(r.pid) for r in ranks[1:]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(r.pid) for r in ranks[1:]), "an FFN worker outlived its core"


def test_a_shared_folder_others_can_reach_is_refused(tmp_path):
    os.chmod(tmp_path, 0o755)
    config = EngineArgs(ffn=1, afd_folder=str(tmp_path)).create_engine_config()
    with pytest.raises(ValueError, match="must be a directory of this user with mode 0700"):
        AFDLeader(config)


def _ready_pids(folder: str, count: int, timeout_s: float = 300) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gen = read_generation(folder)  # the pool's published workers
        if gen is not None and gen.health == "ok" and gen.size == count and all(map(_alive, gen.pids)):
            return list(gen.pids)
        time.sleep(0.2)
    raise AssertionError("the FFN workers did not come up")


def test_the_pool_restarts_its_workers_whole_then_stays_down_past_its_budget(checkpoint, tmp_path):
    folder = tmp_path / "afd"
    folder.mkdir(mode=0o700)
    config = EngineArgs(model=checkpoint, dtype="float32", ffn=2, afd_folder=str(folder)).create_engine_config()
    pool = FFNPool(config, max_restarts=1, window_s=600)
    try:
        first = _ready_pids(str(folder), 2)
        assert first == pool.pids
        os.kill(first[1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while pool.pids == first and time.monotonic() < deadline:
            time.sleep(0.2)
        second = _ready_pids(str(folder), 2)
        assert second == pool.pids
        assert not set(first) & set(second) and not _alive(first[0])  # whole: the live one was stopped too
        assert pool.health == "ok"
        os.kill(second[0], signal.SIGKILL)  # past the budget of one restart
        deadline = time.monotonic() + 60
        while pool.health != "down" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pool.health == "down" and not any(_alive(p) for p in second)
    finally:
        pool.stop()
