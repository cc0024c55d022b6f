"""ngram speculation through the real engine: greedy output is HF-exact
(batch mixes, chunked prefill, preemption), seeded sampling reproducible,
and the configuration is validated at the edge."""
from __future__ import annotations

import random

import pytest

from kvferry import LLM, SamplingParams
from kvferry.config import EngineArgs, SpeculativeConfig
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Mixed lengths, most with repeated passages so prompt lookup finds matches."""
    rng = random.Random(99)
    prompts = []
    for n, repeats in ((1, 1), (6, 3), (17, 2), (40, 3), (150, 1), (33, 4)):
        passage = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(passage * repeats)
    return prompts


@pytest.fixture(scope="module", params=["llama"])
def case(request, tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param,
                                    max_position_embeddings=1024))
    hf = load_hf(path)
    prompts = repetitive_prompts(hf.config.vocab_size)
    # HF's greedy continuation, pasted back into the prompt: an input-grounded
    # case whose drafts the target accepts.
    grounded = prompts[3] + hf_greedy(hf, prompts[3], MAX_NEW) + prompts[3]
    prompts.append(grounded)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return path, hf, prompts, expected


def generate(path, prompts, params=GREEDY, **kwargs):
    llm = LLM(model=path, dtype="float32", speculative=dict(NGRAM), **kwargs)
    return llm, llm.generate(prompts, params)


def check(hf, prompts, expected, results):
    for p, e, r in zip(prompts, expected, results):
        assert_greedy_match(hf, p, r.token_ids, e)


def test_greedy_batch_is_hf_exact_and_drafts_are_accepted(case):
    path, hf, prompts, expected = case
    llm, results = generate(path, prompts)
    check(hf, prompts, expected, results)
    stats = llm.engine.stats()
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert stats.num_accepted_tokens_per_pos == sorted(stats.num_accepted_tokens_per_pos, reverse=True)
    llm.engine.check_integrity()


def test_each_request_alone_is_hf_exact(case):
    path, hf, prompts, expected = case
    llm = LLM(model=path, dtype="float32", speculative=dict(NGRAM))
    for p, e in zip(prompts, expected):
        assert_greedy_match(hf, p, llm.generate([p], GREEDY)[0].token_ids, e)


def test_chunked_prefill_small_budget(case):
    path, hf, prompts, expected = case
    llm, results = generate(path, prompts, max_num_batched_tokens=24)
    check(hf, prompts, expected, results)
    assert llm.engine.stats().num_draft_tokens > 0


def test_preemption_small_pool(case):
    path, hf, prompts, expected = case
    llm, results = generate(path, prompts, block_size=8, num_kv_blocks=64, enable_prefix_caching=False)
    assert llm.engine.stats().num_preemptions > 0
    check(hf, prompts, expected, results)
    llm.engine.check_integrity()


def test_seeded_sampling_is_reproducible_and_batch_independent(case):
    path, _, prompts, _ = case
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=s, ignore_eos=True) for s in range(len(prompts))]
    _, first = generate(path, prompts, params)
    _, again = generate(path, prompts, params)
    _, alone = generate(path, prompts[-1:], params[-1:])
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert alone[0].token_ids == first[-1].token_ids


def test_seeded_sampling_with_prompt_lookup_equals_plain_seeded_sampling(case):
    """A deterministic draft is verified by the race plain sampling runs
    (q one-hot), and a seeded token's noise is keyed by its position: the
    tokens are those of plain decoding, penalties and top-k/top-p included."""
    path, _, prompts, _ = case
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.05, top_k=40, top_p=0.95, min_p=0.01,
                             repetition_penalty=1.02, frequency_penalty=0.05, seed=s, ignore_eos=True)
              for s in range(len(prompts))]
    llm, speculative = generate(path, prompts, params)
    plain = LLM(model=path, dtype="float32").generate(prompts, params)
    assert llm.engine.stats().num_accepted_tokens > 0
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]


def test_not_adaptive_gives_the_same_greedy_output(case):
    path, hf, prompts, expected = case
    llm = LLM(model=path, dtype="float32", speculative={**NGRAM, "adaptive": False})
    check(hf, prompts, expected, llm.generate(prompts, GREEDY))


@pytest.mark.parametrize("bad, field", [
    ({"method": "medusa"}, "speculative.method"),  # eagle and eagle3 are read as "head"
    ({"num_speculative_tokens": 0}, "speculative.num_speculative_tokens"),
    ({"num_speculative_tokens": "4"}, "speculative.num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "speculative.prompt_lookup_min"),
    ({"prompt_lookup_max": 0}, "speculative.prompt_lookup_max"),
    ({"adaptive": "yes"}, "speculative.adaptive"),
    ({"bogus": 1}, "bogus"),
    ("{not json", "speculative"),
    ("[1, 2]", "speculative"),
])
def test_bad_config_is_a_value_error_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EngineArgs(speculative=bad)


def test_cli_flag_parses_json():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--speculative-config", '{"num_speculative_tokens": 3}']))
    spec = args.create_engine_config().speculative
    assert spec == SpeculativeConfig(num_speculative_tokens=3)
    # No flag: the commands' default, auto under the controller; "off" turns it off.
    assert EngineArgs.from_cli_args(parser.parse_args([])).create_engine_config().speculative.method == "auto"
    off = parser.parse_args(["--speculative-config", "off"])
    assert EngineArgs.from_cli_args(off).create_engine_config().speculative is None
