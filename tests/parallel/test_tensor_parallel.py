"""Tensor parallelism (-tp N): greedy output equals HF transformers in float32
at TP 1, 2 and 4 on tiny random-weight Llama, Qwen2 and Qwen3 checkpoints,
through the offline LLM API; models that do not split and features that do
not run over ranks yet are refused in one line; a worker rank killed makes
the core fail whole with an error naming it, never a hang.

The checkpoints have 8 query heads and 4 KV heads (GQA at every degree) and
a vocabulary of 387, which no degree divides: the last rank's vocabulary
slice is padded. On a 2-core machine TP 4 runs 1 thread per rank over 4
processes: slow, and correct.
"""
from __future__ import annotations

import os
import random
import signal
import time

import pytest

from kvferry import LLM, SamplingParams
from kvferry.model import layer_op
from kvferry.parallel import RankFailed
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 6
SPLITTABLE = dict(num_attention_heads=8, num_key_value_heads=4, vocab_size=387)
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, kv_cache_memory_gb=0.02,
              cpu_threads_per_rank=1)


def prompts_for(vocab: int) -> list[list[int]]:
    rng = random.Random(47)
    # 1 token, a short one, and one longer than the 128-token budget (chunked prefill).
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 150)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def case(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, **SPLITTABLE)
    hf = load_hf(str(path))
    prompts = prompts_for(hf.config.vocab_size)
    return str(path), hf, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


def close(llm: LLM) -> None:
    llm.engine.core.close()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_greedy_equals_hf(case, tp, monkeypatch):
    path, hf, prompts, expected = case
    # Rank 0's layers (each rank runs the same code): a shard's are the C++
    # layers, all in one call a step with the all-reduces inside (layer_op.run_tp_layers).
    tp_stack_calls = []
    run_tp_layers = layer_op.run_tp_layers
    monkeypatch.setattr(layer_op, "run_tp_layers", lambda *a: tp_stack_calls.append(1) or run_tp_layers(*a))
    llm = LLM(model=path, tensor_parallel_size=tp, **ENGINE)
    try:
        for prompt, ours, theirs in zip(prompts, greedy(llm, prompts), expected):
            assert_greedy_match(hf, prompt, ours, theirs)
        if tp > 1 and layer_op.available():
            assert len(tp_stack_calls) >= MAX_NEW
        # Again: the prompts' blocks now come from the prefix cache, every rank's KV heads of them.
        again = llm.generate(prompts[2:], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
        assert again[0].num_cached_tokens > 0
        assert_greedy_match(hf, prompts[2], again[0].outputs[0].token_ids, expected[2])
        if tp > 1:
            # Each rank holds its share of the KV heads, in as many blocks as rank 0's pool.
            core = llm.engine.core
            assert core.runner.kv_cache.shape[4] == 4 // tp
            assert core.runner.model.embed_tokens.shape[0] == -(-387 // tp)
        llm.engine.check_integrity()
    finally:
        close(llm)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("llama-tp"), arch="llama", **SPLITTABLE)
    return str(path)


def test_ngram_speculation_over_two_ranks_keeps_greedy_output(llama):
    # This checkpoint's greedy continuation of the first prompt falls into a
    # loop, so n-gram drafts are proposed (and some accepted) there.
    prompts = [[5, 17, 33, 100, 200], [9, 10, 11] * 5]
    plain = LLM(model=llama, **ENGINE)
    try:
        expected = greedy(plain, prompts, 24)
    finally:
        close(plain)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    # Over gloo's all-reduce (the default, shm, runs in every other test).
    llm = LLM(model=llama, tensor_parallel_size=2, speculative=spec, tp_all_reduce="gloo", **ENGINE)
    try:
        assert greedy(llm, prompts, 24) == expected
        assert llm.engine.stats().num_draft_tokens > 0
    finally:
        close(llm)


def test_a_killed_worker_rank_fails_the_core_whole(llama):
    llm = LLM(model=llama, tensor_parallel_size=2, **ENGINE)
    tp = llm.engine.core.tp
    worker = tp._procs[0]
    try:
        assert greedy(llm, [[5, 6, 7]])
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match=r"tensor-parallel rank 1 \(pid \d+\) exited with signal SIGKILL"):
            # Idle or mid-step: the next step fails within a few polls of the watcher.
            for _ in range(50):
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        assert time.monotonic() - t0 < 30
        with pytest.raises(RankFailed):  # and stays failed
            llm.generate([[5]], SamplingParams(max_tokens=2))
    finally:
        close(llm)
    assert worker.poll() is not None


def test_heads_that_do_not_split_are_refused_before_any_rank_starts(llama):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3: the model's num_attention_heads \(8\)"):
        LLM(model=llama, tensor_parallel_size=3, **ENGINE)


@pytest.mark.parametrize("extra, what", [
    # P/D, host swap and --kv-connector run over ranks: test_pd_tp.py, test_tp_levers.py
    ({"deterministic": True}, "deterministic"),
])
def test_features_that_do_not_run_over_ranks_are_refused_in_one_line(llama, extra, what):
    with pytest.raises(ValueError, match=f"tensor_parallel_size 2 does not work with {what}") as e:
        LLM(model=llama, tensor_parallel_size=2, **{**ENGINE, **extra})
    assert "\n" not in str(e.value)


def test_bad_sizes_name_the_field():
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(model=None, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="cpu_threads_per_rank must be an integer >= 1"):
        LLM(model=None, tensor_parallel_size=2, cpu_threads_per_rank=0)
