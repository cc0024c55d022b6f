"""Levers over a core of tensor and pipeline parallelism together
(``-tp 2 -pp 2``: four rank processes of one thread each, stage r // 2 and
TP rank r % 2), through the offline LLM API on tiny models:

- The node KV store (a real ``kvferry kvstore`` process, a DRAM tier): rank
  0 saves and loads whole blocks, each stage's layers with its two TP ranks'
  heads, read from and written to the four ranks' pools in shared memory.
  A slot is the layout of a one-process core's pool, so blocks a TP 1 core
  wrote load into the four ranks, and blocks the four ranks wrote load into
  a TP 1 core; greedy output equals HF transformers (float32) every way.
- A ``.gguf``'s blocks: each rank holds its stage's layers, sliced as a
  ``-tp 2`` rank's; greedy output agrees with the one-process core's as
  ``test_gguf_tp.py`` asks of TP 2 (a flip only at a near tie).
- A connector from outside the package (``--kv-connector``, a tier of
  files): its worker half runs on all four ranks, each saving and loading
  its heads of its stage's layers; a block with one rank's part missing is
  not loaded.

Method auto with a draft head over stages: tests/parallel/test_pp_head.py.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.kvstore.client import KVStoreClient
from kvferry.model.layers.gguf import GGUFLinearMethod
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.model.own_cache import own_model_cache
from tests.parallel.test_gguf_tp import ENGINE as GGUF_ENGINE
from tests.parallel import file_tier_connector as file_tier
from tests.parallel.test_gguf_tp import LOGPROB_ATOL, PARAMS, _assert_agrees, _prompts
from tests.tiny_models import make_tiny_checkpoint, write_tiny_gguf

MAX_NEW = 6
BLOCK = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
FILE_TIER = "tests.parallel.file_tier_connector:FileTierConnector"
TP_PP = dict(tensor_parallel_size=2, pipeline_parallel_size=2, pp_micro_batches=2)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    # 4 query heads and 2 KV heads over 2 TP ranks; 3 layers over 2 stages (2 + 1); vocab 387 pads over 2 ranks.
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tp-pp-levers"), arch="llama", num_hidden_layers=3,
                                    vocab_size=387, max_position_embeddings=512))
    hf = load_hf(path)
    rng = random.Random(49)
    # Two sets of prompts: one written by a TP 1 core, one by the TP 2 x PP 2 core.
    sets = [[[rng.randrange(3, 387) for _ in range(n)] for n in lengths] for lengths in ((61, 40), (53, 27))]
    return path, hf, sets


def _generate(path: str, hf, store: str, prompts: list[list[int]], cached: bool, **layout) -> LLM:  # noqa: ANN001
    """Greedy through a fresh core (its device pool empty): equal to HF's, and
    every cached token from the store (all of each prompt's whole blocks) or none."""
    llm = LLM(model=path, dtype="float32", block_size=BLOCK, num_kv_blocks=64, kv_store=store,
              cpu_threads_per_rank=1, warm_up=False, **layout)
    try:
        results = llm.generate(prompts, GREEDY)
        for p, r in zip(prompts, results):
            assert_greedy_match(hf, p, r.outputs[0].token_ids, hf_greedy(hf, p, MAX_NEW))
            assert r.num_cached_tokens == ((len(p) - 1) // BLOCK * BLOCK if cached else 0)
        stats = llm.engine.stats()
        assert stats.kv_loaded_tokens == (sum((len(p) - 1) // BLOCK * BLOCK for p in prompts) if cached else 0)
        llm.engine.check_integrity()
        assert not llm.engine.core.scheduler.kv.pinned  # saves done, nothing left pinned
    finally:
        llm.engine.core.close()
    return llm


def _written(prompts: list[list[int]]) -> int:
    return sum((len(p) + MAX_NEW - 1) // BLOCK for p in prompts)


def test_kv_store_tiers_hold_whole_blocks_over_tp_and_pp(case, store):
    path, hf, (by_tp1, by_tp_pp) = case
    _generate(path, hf, store, by_tp1, cached=False)  # a one-process core writes the first set
    with KVStoreClient(store) as client:
        assert client.stats().used_slots == _written(by_tp1)
    # The four ranks load it (each rank its layers' heads out of every slot) ...
    llm = LLM(model=path, dtype="float32", block_size=BLOCK, num_kv_blocks=64, kv_store=store,
              cpu_threads_per_rank=1, warm_up=False, **TP_PP)
    try:
        for prompts, cached in ((by_tp1, True), (by_tp_pp, False)):  # ... and write the second set
            results = llm.generate(prompts, GREEDY)
            for p, r in zip(prompts, results):
                assert_greedy_match(hf, p, r.outputs[0].token_ids, hf_greedy(hf, p, MAX_NEW))
                assert r.num_cached_tokens == ((len(p) - 1) // BLOCK * BLOCK if cached else 0)
        assert llm.engine.stats().kv_loaded_tokens == sum((len(p) - 1) // BLOCK * BLOCK for p in by_tp1)
        llm.engine.check_integrity()
        assert not llm.engine.core.scheduler.kv.pinned
    finally:
        llm.engine.core.close()
    with KVStoreClient(store) as client:  # one slot per block, whichever layout wrote it
        assert client.stats().used_slots == _written(by_tp1) + _written(by_tp_pp)
    # A one-process core loads what the four ranks wrote: every rank's shard was in its slot, in place.
    _generate(path, hf, store, by_tp_pp, cached=True)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    with own_model_cache(tmp_path_factory.mktemp("tp-pp-gguf")) as tmp:
        hf = make_tiny_checkpoint(tmp / "dense", "llama", vocab_size=385, num_hidden_layers=3)
        yield write_tiny_gguf(hf, tmp / "llama-q8.gguf", qtype="Q8_0", quantize_vocab=True)


def _gguf_run(path, layout: dict, check=None) -> list:  # noqa: ANN001
    llm = LLM(model=str(path), **layout, **GGUF_ENGINE)
    try:
        if check is not None:
            check(llm.engine.core.runner.model)
        prompts = _prompts(385)
        return [r.outputs[0] for r in llm.generate(prompts, PARAMS)]
    finally:
        llm.engine.core.close()


def _rank0_holds_its_slice_of_its_layers(model) -> None:  # noqa: ANN001 - rank 0's LlamaModel
    assert len(model.layers) == 2  # stage 0 of 2: layers 0-1 of 3
    attn = model.layers[0].self_attn
    assert all(isinstance(lin.method, GGUFLinearMethod) for lin in (attn.qkv_proj, attn.o_proj))
    o = attn.o_proj.qweights[0]
    assert o.in_features == model.config.hidden_size // 2  # row-parallel: half of each row's blocks


def test_gguf_blocks_over_tp_and_pp(gguf):
    one = _gguf_run(gguf, {})
    both = _gguf_run(gguf, TP_PP, check=_rank0_holds_its_slice_of_its_layers)
    _assert_agrees(one, both, "gguf tp2 pp2", LOGPROB_ATOL)


def _parts(files: set) -> dict[str, list]:
    parts: dict[str, list] = {}
    for f in files:
        parts.setdefault(f.name.rsplit(".", 2)[1], []).append(f)
    return parts


def test_a_connector_from_outside_runs_on_every_rank_of_every_stage(case, tmp_path, monkeypatch):
    # Its worker half on each of the four ranks saves and loads that rank's heads of its stage's
    # layers; its scheduler half (rank 0) counts a block as held only when all four parts are there.
    path, hf, (a, b) = case[0], case[1], case[2][0]
    monkeypatch.setenv(file_tier.ENV, str(tmp_path))  # the ranks inherit it
    expected = [hf_greedy(hf, p, MAX_NEW) for p in (a, b)]
    engine = dict(dtype="float32", block_size=BLOCK, num_kv_blocks=64, kv_connector=FILE_TIER,
                  cpu_threads_per_rank=1, warm_up=False, **TP_PP)
    writer = LLM(model=path, **engine)
    try:
        assert_greedy_match(hf, a, writer.generate([a], GREEDY)[0].outputs[0].token_ids, expected[0])
        files_a = set(tmp_path.glob("*.pt"))
        assert_greedy_match(hf, b, writer.generate([b], GREEDY)[0].outputs[0].token_ids, expected[1])
    finally:
        writer.engine.core.close()
    parts_a = _parts(files_a)
    assert {k: len(v) for k, v in parts_a.items()} == {k: _written([a]) for k in ("s0r0", "s0r1", "s1r0", "s1r1")}
    # [stage layers, 2, block_size, its KV heads, head_dim]: 2 + 1 layers, 1 of the 2 KV heads each.
    assert {k: tuple(torch.load(v[0]).shape[::3]) for k, v in parts_a.items()} == {
        "s0r0": (2, 1), "s0r1": (2, 1), "s1r0": (1, 1), "s1r1": (1, 1)}
    for f in _parts(set(tmp_path.glob("*.pt")) - files_a)["s1r1"]:  # b's blocks lose one rank's shard
        f.unlink()
    reader = LLM(model=path, **engine)
    try:
        results = reader.generate([a, b], GREEDY)
        assert results[0].num_cached_tokens == (len(a) - 1) // BLOCK * BLOCK  # every rank's part from its files
        assert results[1].num_cached_tokens == 0  # no block of b is whole
        for p, r, e in zip((a, b), results, expected):
            assert_greedy_match(hf, p, r.outputs[0].token_ids, e)
        reader.engine.check_integrity()
    finally:
        reader.engine.core.close()
