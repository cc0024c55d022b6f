"""Attention/FFN disaggregation with the system's levers on, as a colocated
core has them: one real ``kvferry serve --mode afd --attention 1 --ffn 1``
on a tiny random Llama with the serving default's speculation (no
``--speculative-config``), a DRAM KV tier, API keys with tenants and a
declared public prefix, through the openai client.

- The default speculation drafts on a repetitive batch-1 request (the
  verify step's k + 1 rows a request go through the FFN worker like any
  rows), drafts are accepted, and the greedy text is HF transformers' in
  float32; the same holds offline (``LLM(ffn=1)``) on a Qwen3-MoE.
- A prompt the device pool forgot is served from the DRAM tier (its
  ``kv_tier_hits`` counter moves) with the same text.
- A tenant's private prefix serves no other tenant, from neither the
  device pool nor the tier; the public prefix serves every tenant.
- Swap space on an attention core: a request swapped out and back keeps
  HF's greedy output (with the default speculation, on the Qwen3-MoE).
- Structured outputs and logprobs are the colocated core's.
- An EAGLE-3 head reads the streams entering its aux layers, which the
  attention core gathers micro-batch by micro-batch: HF's hidden states.
"""
from __future__ import annotations

import json
import re
from functools import partial

import openai
import pytest
import torch

from kvferry import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, load_hf
from tests.parallel.afd_helpers import servers_at_once
from tests.serve.server_process import start_server
from tests.spec.test_eagle3 import write_eagle3_checkpoint
from tests.spec.test_engine import repetitive_prompts
from tests.tiny_models import make_tiny_checkpoint
from tests.tiny_moe_models import make_tiny_moe_checkpoint

BLOCK = 16
MAX_NEW = 6
SPEC_NEW = 24
KEYS = {"sk-acme": {"tenant": "acme", "publish": True}, "sk-beta": {"tenant": "beta"},
        "sk-root": {"tenant": "ops", "admin": True}}
PUBLIC = "You are the support assistant of Example Corp. Answer briefly and politely.\n"


def _private(tag: str) -> str:
    return " ".join(f"Item {i} of batch {tag} is a widget." for i in range(3)) + " Summary:"


TEXTS = [PUBLIC + _private("tail"), _private("acme-own")]
FLOOD = [_private(f"flood{i}") for i in range(10)]
DRAFTS, ACCEPTED = "kvferry:spec_decode_num_draft_tokens_total", "kvferry:spec_decode_num_accepted_tokens_total"


def _spec_prompts(vocab: int) -> list[list[int]]:
    """Two repeated passages (suffix and n-gram lookup find them)."""
    return [p for p in repetitive_prompts(vocab) if len(p) in (34, 132)]


def _reference(path: str) -> dict:
    """Colocated greedy (speculation off) of every prompt; the token prompts' equal HF's."""
    hf = load_hf(path)
    spec = _spec_prompts(hf.config.vocab_size)
    llm = LLM(model=path, dtype="float32", kv_cache_memory_gb=0.02, warm_up=False)
    try:
        long = llm.generate(spec, SamplingParams(max_tokens=SPEC_NEW, temperature=0.0, ignore_eos=True))
        short = llm.generate(TEXTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    finally:
        llm.engine.core.close()
    for prompt, r in zip(spec, long):
        assert r.outputs[0].token_ids == hf_greedy(hf, prompt, SPEC_NEW)
    return {"spec": [(p, r.outputs[0].text) for p, r in zip(spec, long)],
            **{t: r.outputs[0].text for t, r in zip(TEXTS, short)}}


def _start(path: str, d):  # noqa: ANN001, ANN202 - a ServerProcess
    (d / "keys.json").write_text(json.dumps(KEYS))
    (d / "secret").write_bytes(b"0123456789abcdef0123456789abcdef")
    (d / "public.json").write_text(json.dumps([PUBLIC]))
    # 32 blocks: the flood below evicts every earlier prompt's blocks from the device pool.
    srv = start_server(d / "server.log", [
        "--model", path, "--dtype", "float32", "--mode", "afd", "--attention", "1", "--ffn", "1",
        "--cpu-threads-per-rank", "1", "--num-kv-blocks", "32", "--block-size", str(BLOCK),
        "--max-model-len", "512", "--kv-dram-gb", "0.05", "--api-keys", str(d / "keys.json"),
        "--cache-secret-file", str(d / "secret"), "--public-prefixes", str(d / "public.json"),
        "--log-level", "info"])
    srv.metrics_key = "sk-root"  # /metrics is an admin key's
    return srv


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("afd-levers"), arch="llama", num_hidden_layers=3,
                                    max_position_embeddings=1024))


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    with servers_at_once({"afd": partial(_start, checkpoint, tmp_path_factory.mktemp("afd-levers-srv"))},
                         meanwhile=partial(_reference, checkpoint)) as (started, expected):
        yield started["afd"], expected


def _complete(srv, key: str, prompt, max_tokens: int = MAX_NEW, **extra) -> openai.types.Completion:  # noqa: ANN001
    with openai.OpenAI(base_url=srv.api_url, api_key=key, max_retries=0, timeout=300) as client:
        model = client.models.list().data[0].id
        return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True, **extra.pop("extra_body", {})}, **extra)


def _text_cached(srv, key: str, prompt) -> tuple[str, int, int]:  # noqa: ANN001
    """(text, cached prompt tokens, prompt tokens)."""
    r = _complete(srv, key, prompt)
    assert r.usage.completion_tokens == MAX_NEW
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


def test_the_default_speculation_drafts_and_keeps_hf_greedy(served):
    srv, expected = served
    assert "speculative decoding: auto" in srv.log()  # the default stays on under --ffn
    before = srv.metric(DRAFTS), srv.metric(ACCEPTED)
    for prompt, text in expected["spec"]:  # batch 1: the cost-aware controller drafts
        assert _complete(srv, "sk-acme", prompt, SPEC_NEW).choices[0].text == text
    assert srv.metric(DRAFTS) > before[0] and srv.metric(ACCEPTED) > before[1]


def test_the_default_speculation_and_swap_space_on_a_mixture_of_experts(tmp_path):
    path = str(make_tiny_moe_checkpoint(tmp_path, "qwen3_moe_top2", max_position_embeddings=1024))
    hf = load_hf(path)
    prompts = _spec_prompts(hf.config.vocab_size)
    # Swap space too: 24 blocks of 8 hold both prompts (22) but not with their new tokens (27), so one
    # swaps out and back.
    llm = LLM(model=path, dtype="float32", block_size=8, num_kv_blocks=24, num_swap_blocks=64,
              enable_prefix_caching=False, preemption_mode="swap", ffn=1, speculative="default")
    try:
        out = llm.generate(prompts, SamplingParams(max_tokens=SPEC_NEW, temperature=0.0, ignore_eos=True))
        assert [r.outputs[0].token_ids for r in out] == [hf_greedy(hf, p, SPEC_NEW) for p in prompts]
        stats = llm.engine.stats()
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        assert stats.num_swapped_out > 0
    finally:
        llm.engine.core.close()


def test_the_public_prefix_serves_every_tenant(served):
    srv, expected = served
    prompt = TEXTS[0]
    text, cached, n = _text_cached(srv, "sk-beta", prompt)  # beta's first request: the public blocks hit
    assert text == expected[prompt]
    assert 2 * BLOCK <= cached < n, (cached, n)
    assert _text_cached(srv, "sk-acme", prompt)[0] == expected[prompt]


def _loaded(srv) -> tuple[float, float]:  # noqa: ANN001
    """(prompt tokens loaded from the KV store, the DRAM tier's block hits)."""
    return srv.metric("kvferry:kv_store_loaded_tokens_total"), srv.metric("kvferry:kv_tier_hits_total", tier="dram")


def test_a_forgotten_prompt_comes_from_the_dram_tier_and_stays_private(served):
    srv, expected = served
    prompt = TEXTS[1]
    text, cached, n = _text_cached(srv, "sk-acme", prompt)
    assert (text, cached) == (expected[prompt], 0)
    full = (n - 1) // BLOCK * BLOCK
    assert _text_cached(srv, "sk-acme", prompt)[:2] == (expected[prompt], full)  # acme's own device cache
    for flood in FLOOD:  # the device pool forgets the prompt's blocks; the tier keeps them
        _text_cached(srv, "sk-acme", flood)
    tokens, hits = _loaded(srv)
    assert _text_cached(srv, "sk-acme", prompt)[:2] == (expected[prompt], full)
    # The tier's counters come with the store's stats, polled: wait for them.
    srv.wait_for_metric("kvferry:kv_tier_hits_total", lambda v: v >= hits + full // BLOCK, tier="dram")
    after = _loaded(srv)
    assert after[0] == tokens + full and after[1] >= hits + full // BLOCK, (tokens, hits, after, {
        k: v for k, v in srv.metrics().items() if "kv_tier" in k[0]})
    # Another tenant finds acme's blocks in neither the device pool nor the tier.
    assert _text_cached(srv, "sk-beta", prompt)[:2] == (expected[prompt], 0)
    assert _loaded(srv) == after


def test_structured_outputs_and_logprobs(served):
    srv, expected = served
    # (without ignore_eos: the grammar's end is the request's)
    r = _complete(srv, "sk-beta", "Call me at", 12,
                  extra_body={"guided_regex": r"\d{3}-\d{4}", "ignore_eos": False})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text), r.choices[0].text
    prompt = TEXTS[0]
    r = _complete(srv, "sk-beta", prompt, logprobs=2)
    assert r.choices[0].text == expected[prompt]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == MAX_NEW and len(lp.top_logprobs) == MAX_NEW
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen == pytest.approx(max(top.values()), abs=1e-5) and token in top
    log = srv.log()
    assert "Traceback" not in log, log[-3000:]


def test_an_eagle3_head_reads_the_aux_rows_of_every_micro_batch(checkpoint, tmp_path):
    hf = load_hf(checkpoint)
    head = write_eagle3_checkpoint(tmp_path / "eagle3", hf.config.hidden_size, hf.config.vocab_size)
    prompts = [list(range(5, 40)), [300, 2, 301, 3, 302, 4, 7]]  # one prefill step of two micro-batches
    llm = LLM(model=checkpoint, dtype="float32", kv_cache_memory_gb=0.02, ffn=1,
              speculative={"method": "eagle3", "model": str(head)})
    try:
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
        model = llm.engine.core.runner.model
        aux, layers = model.aux_hidden, model.aux_layers
    finally:
        llm.engine.core.close()
    with torch.no_grad():  # hidden_states[i]: the stream entering layer i
        states = [hf(torch.tensor([p]), output_hidden_states=True).hidden_states for p in prompts]
    want = torch.cat([torch.cat([s[i][0] for i in layers], dim=1) for s in states])
    torch.testing.assert_close(aux, want, atol=1e-4, rtol=1e-4)

