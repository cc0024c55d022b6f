"""``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``: K/V stored as float8, half the bytes.

The ground truth is HF transformers with its cache rounding every K/V row to
the fp8 format as it is stored (``RoundingCache``; e4m3 saturating at 448,
as our writes do): the attention then reads what our cache holds. fp8 changes outputs against the exact model, so
greedy tokens are compared with that reference, allowing a divergence only
where its own top two logits are within a rounding step of each other.
Swapping, the KV store and the block keys are checked on the fp8 pool too.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.config import EngineArgs, KVTierConfig
from kvferry.engine.kv_connector import HostSwapWorker
from kvferry.core.outputs import KVOrders, SwapOrder
from kvferry.kvstore.launch import start_store
from kvferry.model.kv_cache_dtype import dtype_name, index_copy_into, resolve_kv_cache_dtype, to_cache_dtype
from tests.engine.hf_reference import load_hf
from tests.spec.test_tree_engine import Oracle
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# A float error of ~1e-7 in a K/V element can move it across an fp8 rounding
# boundary (a 2^-3 / 2^-4 relative step), so logits near a tie may flip:
# wider than the exact path's 1e-4.
FP8_TIE_TOLERANCE = 2e-2
FORMATS = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}
OTHER = {"fp8_e5m2": "fp8_e4m3", "fp8_e4m3": "fp8_e5m2"}


def rounding_cache(fp8: torch.dtype):
    from transformers import DynamicCache

    class RoundingCache(DynamicCache):
        """HF's cache, holding K/V as an fp8 cache holds them."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            def rounded(x):
                return to_cache_dtype(x, fp8).to(x.dtype)
            return super().update(rounded(key_states), rounded(value_states), layer_idx, *args, **kwargs)

    return RoundingCache()


@torch.inference_mode()
def hf_fp8_greedy(model, prompt: list[int], max_new: int, fp8: torch.dtype) -> list[int]:
    ids, cache, out = torch.tensor([prompt]), rounding_cache(fp8), []
    logits = model(ids, cache=cache, use_cache=True).logits[0, -1]
    for _ in range(max_new):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[0, -1]
    return out


@torch.inference_mode()
def assert_fp8_greedy_match(model, prompt: list[int], ours: list[int], theirs: list[int], fp8: torch.dtype) -> None:
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        logits = model(torch.tensor([prompt + theirs[:i]]), cache=rounding_cache(fp8), use_cache=True).logits
        gap = (logits[0, -1, b] - logits[0, -1, a]).abs().item()
        assert gap < FP8_TIE_TOLERANCE, f"diverged at token {i}: ours {a}, reference {b}, logit gap {gap:.3g}"
        return


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("fp8"), arch="llama", max_position_embeddings=512))
    hf = load_hf(path)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in (64, 61, 45, 70, 64, 33)]
    return path, hf, prompts


@pytest.fixture(scope="module", params=list(FORMATS))
def case(request, checkpoint):
    """(path, hf, prompts, HF's greedy tokens over the rounded cache, the --kv-cache-dtype name)."""
    path, hf, prompts = checkpoint
    fmt = request.param
    return path, hf, prompts, [hf_fp8_greedy(hf, p, MAX_NEW, FORMATS[fmt]) for p in prompts], fmt


def fp8_llm(path, fmt, **kwargs):
    return LLM(model=path, dtype="float32", kv_cache_dtype=fmt, block_size=8, **kwargs)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_draft_trees_accepted_branch_moves_in_an_fp8_cache(checkpoint, fmt):
    """Draft trees (the serving default on the CPU) over an fp8 cache: a
    tree whose right branch is second has its accepted nodes' KV moved to
    their positions, which torch's index ops cannot do for float8 (the
    engine core died on it); output stays plain decoding's over the same cache."""
    path, hf, prompts = checkpoint
    expected = [r.token_ids for r in fp8_llm(path, fmt).generate(prompts[:3], GREEDY)]
    llm = fp8_llm(path, fmt, speculative={"method": "suffix", "num_speculative_tokens": 6, "draft_tree": True,
                                          "adaptive": False, "cost_aware": False, "batch_token_threshold": 10**6})
    oracle = Oracle({tuple(p): p + e for p, e in zip(prompts, expected)}, 3, hf.config.vocab_size)
    llm.engine.core.scheduler.proposer = oracle
    assert [r.token_ids for r in llm.generate(prompts[:3], GREEDY)] == expected
    assert oracle.num_trees > 0 and llm.engine.stats().num_accepted_tokens > 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("kernels", ["cpp", "torch"])
def test_greedy_output_matches_hf_over_a_rounded_cache(case, kernels, monkeypatch):
    if kernels == "torch":
        monkeypatch.setenv("KVFERRY_DISABLE_CPP_KERNELS", "1")
    path, hf, prompts, expected, fmt = case
    llm = fp8_llm(path, fmt, num_kv_blocks=128, max_num_batched_tokens=96)  # chunked prompts over a cached context
    assert llm.engine.core.runner.kv_cache.dtype == FORMATS[fmt]
    results = llm.generate(prompts, GREEDY)
    for p, e, r in zip(prompts, expected, results):
        assert_fp8_greedy_match(hf, p, r.token_ids, e, FORMATS[fmt])
    llm.engine.check_integrity()


def test_an_exact_cache_differs_from_the_rounded_reference(case):
    # The reference is not vacuous: over these prompts fp8 rounding changes
    # some greedy token of the exact model (the auto cache follows HF exactly).
    path, hf, prompts, expected, fmt = case
    from tests.engine.hf_reference import hf_greedy

    assert any(hf_greedy(hf, p, MAX_NEW) != e for p, e in zip(prompts, expected))


def test_the_formats_round_differently(checkpoint):
    # e4m3 and e5m2 are different caches: their references differ somewhere.
    path, hf, prompts = checkpoint
    e5 = [hf_fp8_greedy(hf, p, MAX_NEW, torch.float8_e5m2) for p in prompts[:3]]
    e4 = [hf_fp8_greedy(hf, p, MAX_NEW, torch.float8_e4m3fn) for p in prompts[:3]]
    assert e5 != e4


def test_the_same_memory_holds_four_times_the_float32_blocks(case):
    path, *_, fmt = case
    exact = LLM(model=path, dtype="float32", block_size=8, kv_cache_memory_gb=0.001, max_num_seqs=512)
    fp8 = fp8_llm(path, fmt, kv_cache_memory_gb=0.001, max_num_seqs=512)
    assert exact.engine.core.num_kv_blocks > 2
    assert fp8.engine.core.num_kv_blocks == pytest.approx(4 * exact.engine.core.num_kv_blocks, abs=4)
    assert fp8.engine.core.ready_message().kv_dtype == dtype_name(FORMATS[fmt])
    assert exact.engine.core.ready_message().kv_dtype == "float32"


def test_forced_swapping_keeps_greedy_output(case):
    # 48 blocks of 8 hold the six prompts' first steps only: decodes preempt,
    # and the victims' fp8 blocks go to host memory and come back.
    path, hf, prompts, expected, fmt = case
    llm = fp8_llm(path, fmt, num_kv_blocks=48, enable_prefix_caching=False, num_swap_blocks=96)
    results = llm.generate(prompts, GREEDY)
    for p, e, r in zip(prompts, expected, results):
        assert_fp8_greedy_match(hf, p, r.token_ids, e, FORMATS[fmt])
    assert llm.engine.stats().num_swapped_out > 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("fp8", list(FORMATS.values()), ids=list(FORMATS))
def test_swap_space_moves_fp8_blocks_bit_exactly(fp8):
    kv = torch.randn(3, 2, 10, 4, 2, 8).to(fp8)
    original = kv.clone()
    swap = HostSwapWorker(kv, num_slots=6)
    swap.execute(KVOrders(swap_out=[SwapOrder("a", [3, 5, 1], [0, 1, 2])]))
    kv.view(torch.uint8).zero_()
    swap.execute(KVOrders(swap_in=[SwapOrder("a", [7, 2, 4], [0, 1, 2])]))
    assert torch.equal(kv[:, :, [7, 2, 4]].view(torch.uint8), original[:, :, [3, 5, 1]].view(torch.uint8))
    assert not kv[:, :, [0, 1, 3, 5, 6, 8, 9]].view(torch.uint8).any()


@pytest.mark.parametrize("fp8", list(FORMATS.values()), ids=list(FORMATS))
def test_index_copy_into_an_fp8_tensor_rounds_as_to_does(fp8):
    dst = torch.zeros(5, 3, dtype=fp8)
    src = torch.randn(2, 3) * 300  # past e4m3's 448 now and then: saturated, never NaN
    index_copy_into(dst, 0, torch.tensor([4, 1]), src)
    want = src.clamp(-448, 448) if fp8 == torch.float8_e4m3fn else src
    assert torch.equal(dst[[4, 1]].view(torch.uint8), want.to(fp8).view(torch.uint8))
    assert not dst.float().isnan().any()
    assert not dst[[0, 2, 3]].view(torch.uint8).any()


def test_store_blocks_are_resumed_by_fp8_engines_only(case):
    # A second fp8 engine resumes the first one's blocks from the store; an
    # exact engine on the same store finds none of them (the cache dtype is
    # part of every block's key) and still matches HF.
    from tests.engine.hf_reference import assert_greedy_match, hf_greedy

    path, hf, prompts, expected, fmt = case
    process, address = start_store(KVTierConfig(kv_dram_gb=0.02))
    try:
        first = fp8_llm(path, fmt, num_kv_blocks=64, kv_store=address)
        first.generate(prompts[:2], GREEDY)
        assert first.engine.stats().kv_saved_blocks > 0
        first.engine.core.close()
        second = fp8_llm(path, fmt, num_kv_blocks=64, kv_store=address)
        results = second.generate(prompts[:2], GREEDY)
        assert second.engine.stats().kv_loaded_tokens > 0
        for p, e, r in zip(prompts[:2], expected[:2], results):
            assert_fp8_greedy_match(hf, p, r.token_ids, e, FORMATS[fmt])
        second.engine.core.close()
        other = fp8_llm(path, OTHER[fmt], num_kv_blocks=64, kv_store=address)  # the other fp8 format
        other.generate(prompts[:2], GREEDY)
        assert other.engine.stats().kv_loaded_tokens == 0 and other.engine.stats().kv_store_hits == 0
        other.engine.core.close()
        exact = LLM(model=path, dtype="float32", block_size=8, num_kv_blocks=64, kv_store=address)
        results = exact.generate(prompts[:2], GREEDY)
        assert exact.engine.stats().kv_loaded_tokens == 0 and exact.engine.stats().kv_store_hits == 0
        for p, r in zip(prompts[:2], results):
            assert_greedy_match(hf, p, r.token_ids, hf_greedy(hf, p, MAX_NEW))
        exact.engine.core.close()
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_bad_and_unsupported_values_name_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int4")
    args = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser()).parse_args(["--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cpu"), False) == torch.float8_e4m3fn  # as vLLM
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32, torch.device("cpu"), False) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, torch.device("cpu"), False) == torch.float8_e5m2
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu"), False) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is served by the CPU kernels only"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, torch.device("cuda"), True)
    with pytest.raises(ValueError, match="CPU kernels only"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.float32, torch.device("cpu"), True)
    with pytest.raises(ValueError, match="CPU kernels only"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda"), True)
