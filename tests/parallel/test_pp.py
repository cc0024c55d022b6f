"""Pipeline parallelism (-pp N): greedy output equals HF transformers in
float32 at PP 2 on tiny random-weight Llama, Qwen2 (tied embeddings: the
last stage holds the table as its lm_head) and Qwen3 checkpoints, and at
PP 3 (a middle stage), through the offline LLM API; each stage holds only
its layers and their KV; the micro-batches of a step overlap across the
stages; a stage killed makes the core fail whole with an error naming it;
what does not run over stages yet is refused in one line.

The checkpoints have 3 layers, which 2 stages split unevenly (2 + 1, as
vLLM's get_pp_indices: the remainder before the last stage).
"""
from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest

from kvferry import LLM, SamplingParams
from kvferry.engine.pp_runner import micro_batches
from kvferry.parallel import RankFailed
from kvferry.parallel.pipeline import pp_layer_range
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_models import make_tiny_checkpoint
from tests.tiny_moe_models import make_tiny_moe_checkpoint

MAX_NEW = 6
LAYERS = dict(num_hidden_layers=3, vocab_size=387)
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, kv_cache_memory_gb=0.02,
              cpu_threads_per_rank=1)


def prompts_for(vocab: int) -> list[list[int]]:
    rng = random.Random(47)
    # 1 token, short ones, and one longer than the 128-token budget (chunked prefill).
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 23, 150)]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


def close(llm: LLM) -> None:
    llm.engine.core.close()


# -- pure ------------------------------------------------------------------------------

@pytest.mark.parametrize("layers, size, expected", [
    (3, 2, [(0, 2), (2, 3)]),  # the remainder before the last stage, as vLLM's get_pp_indices
    (4, 2, [(0, 2), (2, 4)]),
    (32, 3, [(0, 11), (11, 22), (22, 32)]),
    (10, 4, [(0, 2), (2, 5), (5, 8), (8, 10)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
])
def test_layer_ranges_are_contiguous_and_cover_the_model(layers, size, expected):
    assert [pp_layer_range(layers, r, size) for r in range(size)] == expected


def test_a_stage_without_a_layer_is_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size 3: the model has only 2 layers"):
        pp_layer_range(2, 0, 3)


@pytest.mark.parametrize("lens, count, expected", [
    ([1] * 8, 2, [(0, 4), (4, 8)]),
    ([1] * 7, 3, [(0, 3), (3, 5), (5, 7)]),
    ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),  # a long chunk stays whole
    ([1, 1, 1, 100], 2, [(0, 3), (3, 4)]),
    ([5], 4, [(0, 1)]),  # never more micro-batches than requests
    ([1, 1], 4, [(0, 1), (1, 2)]),
])
def test_micro_batches_split_by_tokens(lens, count, expected):
    qsl = np.concatenate([[0], np.cumsum(lens)])
    got = micro_batches(qsl, count)
    assert got == expected
    assert got[0][0] == 0 and got[-1][1] == len(lens) and all(a < b for a, b in got)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's embedding is tied: the last stage's lm_head
def test_each_stage_loads_only_its_layers(arch, tmp_path):
    from kvferry.model.loader import load_model
    from kvferry.parallel.pipeline import PPStage

    path = str(make_tiny_checkpoint(tmp_path, arch=arch, **LAYERS))
    first, last = (load_model(path, dtype="float32", stage=PPStage.of(3, r, 2)).model for r in range(2))
    tied = arch == "qwen2"
    assert (len(first.layers), len(last.layers)) == (2, 1)
    assert first.layers[0].self_attn.qkv_proj.prefix == "model.layers.0.self_attn.qkv_proj"
    assert last.layers[0].self_attn.qkv_proj.prefix == "model.layers.2.self_attn.qkv_proj"
    assert (first.embed.weight.shape[0], last.embed.weight.shape[0]) == (387, 387 if tied else 0)
    assert (first.logits_proj.out_features, last.logits_proj.out_features) == (0, 387)
    whole = sum(p.numel() for p in load_model(path, dtype="float32").model.parameters())
    split = [sum(p.numel() for p in m.parameters()) for m in (first, last)]
    assert max(split) < whole and sum(split) >= whole


# -- ground truth ------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def case(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, **LAYERS)
    hf = load_hf(str(path))
    prompts = prompts_for(hf.config.vocab_size)
    return request.param, str(path), hf, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def test_greedy_equals_hf_at_pp_2(case):
    arch, path, hf, prompts, expected = case
    llm = LLM(model=path, pipeline_parallel_size=2, **ENGINE)
    try:
        for prompt, ours, theirs in zip(prompts, greedy(llm, prompts), expected):
            assert_greedy_match(hf, prompt, ours, theirs)
        # Again: the prompt's blocks now come from the prefix cache, each stage's layers of them.
        again = llm.generate(prompts[3:], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
        assert again[0].num_cached_tokens > 0
        assert_greedy_match(hf, prompts[3], again[0].outputs[0].token_ids, expected[3])
        core = llm.engine.core
        # Stage 0 holds layers 0-1 and their KV, the embedding, no lm_head; stage 1 the rest.
        assert len(core.runner.model.layers) == 2 and core.runner.kv_cache.shape[0] == 2
        assert core.runner.model.embed_tokens.shape[0] == 387
        assert core.runner.model.logits_proj.out_features == 0
        assert [r.rank for r in core.ranks()] == [0, 1]
        # Steps of several requests went through as micro-batches (the prompts' steps: a
        # decode step of 4 tokens is one, since each micro-batch reads the weights again).
        assert any(len(first) == 2 for _, first, _ in core.tp.timelines)
        assert [core.runner.micro_batch_count(n) for n in (4, 127, 128, 2048)] == [1, 1, 2, 2]
        llm.engine.check_integrity()
    finally:
        close(llm)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("llama-pp"), arch="llama", **LAYERS))


def test_three_stages_one_layer_each(llama):
    """A middle stage: takes the stream from stage 0, hands it to stage 2."""
    prompts = prompts_for(387)
    plain = LLM(model=llama, **ENGINE)
    try:
        expected = greedy(plain, prompts)
    finally:
        close(plain)
    llm = LLM(model=llama, pipeline_parallel_size=3, pp_micro_batches=3, **ENGINE)
    try:
        assert greedy(llm, prompts) == expected
        assert len(llm.engine.core.ranks()) == 3
    finally:
        close(llm)


def test_the_stages_overlap(tmp_path):
    """While stage 0 runs micro-batch k + 1, stage 1 runs k: their times (one
    monotonic clock for the host) intersect. Layers wide enough that a
    micro-batch of prompt takes milliseconds, so a loaded host still shows it."""
    path = make_tiny_checkpoint(tmp_path, arch="llama", num_hidden_layers=4, hidden_size=256,
                                intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                                vocab_size=387)
    llm = LLM(model=str(path), pipeline_parallel_size=2, **{**ENGINE, "max_num_batched_tokens": 1024})
    try:
        rng = random.Random(3)
        greedy(llm, [[rng.randrange(3, 387) for _ in range(200)] for _ in range(4)], 4)
        overlapped = 0
        for _, first, last in llm.engine.core.tp.timelines:
            for (k, _, end0), (j, start1, _) in zip(first[1:], last):
                assert k == j + 1
                overlapped += start1 < end0  # stage 1 began micro-batch k - 1 before stage 0 ended k
        assert overlapped > 0, list(llm.engine.core.tp.timelines)
    finally:
        close(llm)


def test_ngram_speculation_over_two_stages_keeps_greedy_output(llama):
    """Drafts come from the scheduler; stage 0 embeds them, the last stage verifies."""
    prompts = [[5, 17, 33, 100, 200], [9, 10, 11] * 5, [7, 8] * 20]
    plain = LLM(model=llama, **ENGINE)
    try:
        expected = greedy(plain, prompts, 24)
    finally:
        close(plain)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    llm = LLM(model=llama, pipeline_parallel_size=2, speculative=spec, **ENGINE)
    try:
        assert greedy(llm, prompts, 24) == expected
        assert llm.engine.stats().num_draft_tokens > 0
    finally:
        close(llm)


@pytest.mark.parametrize("moe", ["mixtral_top2", "qwen2_moe_top2"])  # block_sparse_moe names; a shared expert
def test_a_mixture_of_experts_over_two_stages_keeps_greedy_output(moe, tmp_path):
    """Each stage holds its layers' experts (tests/model: PP 1 equals HF on these)."""
    path = str(make_tiny_moe_checkpoint(tmp_path, moe))
    prompts = [[5, 6, 7, 8], list(range(9, 40))]
    plain = LLM(model=path, **ENGINE)
    try:
        expected = greedy(plain, prompts)
    finally:
        close(plain)
    llm = LLM(model=path, pipeline_parallel_size=2, **ENGINE)
    try:
        assert greedy(llm, prompts) == expected
    finally:
        close(llm)


def test_a_killed_stage_fails_the_core_whole(llama):
    llm = LLM(model=llama, pipeline_parallel_size=2, **ENGINE)
    stage = llm.engine.core.tp._procs[0]
    try:
        assert greedy(llm, [[5, 6, 7]])
        os.kill(stage.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match=r"pipeline stage 1 \(pid \d+\) exited with signal SIGKILL"):
            for _ in range(50):  # idle or mid-step: the next step fails within a few polls of the watcher
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        assert time.monotonic() - t0 < 30
        with pytest.raises(RankFailed):  # and stays failed
            llm.generate([[5]], SamplingParams(max_tokens=2))
    finally:
        close(llm)
    assert stage.poll() is not None


def test_a_model_shallower_than_the_stages_is_refused_before_any_stage_starts(llama):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 4: the model has only 3 layers"):
        LLM(model=llama, pipeline_parallel_size=4, **ENGINE)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("extra, what", [
    # A KV store (with -tp too), swap space and --kv-connector run: test_pp_tiers.py, test_pp_levers.py,
    # test_tp_pp_levers.py; a KV transfer with -tp too: test_pd_tp_pp.py; a draft model (what it does not
    # run with yet: test_pp_head.py)
    ({"deterministic": True}, "deterministic"),
])
def test_features_that_do_not_run_over_stages_are_refused_in_one_line(llama, extra, what):
    with pytest.raises(ValueError, match=f"pipeline_parallel_size 2 does not work with {what}") as e:
        LLM(model=llama, pipeline_parallel_size=2, **{**ENGINE, **extra})
    assert "\n" not in str(e.value)


def test_bad_sizes_name_the_field():
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        LLM(model=None, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pp_micro_batches must be an integer >= 1"):
        LLM(model=None, pipeline_parallel_size=2, pp_micro_batches=0)
