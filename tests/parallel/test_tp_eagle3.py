"""An EAGLE-3 head over tensor-parallel ranks: rank 0 drafts alone (the aux
rows it fuses are whole on every rank after each layer's all-reduce, and the
head's weights are its own), and the workers get its drafts, a tree's
parents too, with the step. Greedy output at TP 2 equals TP 1's, plain
decoding's and HF transformers'; seeded sampling equals plain seeded
sampling, and unseeded sampling's logprobs are the target's. Heads: one in a published layout (random weights, a draft
vocabulary of half the ids, no embedding of its own: rank 0 reads the
target's whole table), and an "echo" head whose drafts hold wherever the
target repeats a token (so verified drafts are accepted, their aux rows kept)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvferry import LLM, SamplingParams
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.parallel.test_tp_draft import max_logprob_gap
from tests.spec.test_eagle3 import write_eagle3_checkpoint
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# No warm-up: these tests time nothing, and each engine start would pay a full-size prefill.
ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, warm_up=False)
# k fixed: on a loaded 2-core box the cost-aware controller may stop drafting.
SPEC = {"method": "eagle3", "num_speculative_tokens": 3, "adaptive": False, "cost_aware": False,
        "batch_token_threshold": 10**6}
# A token repeated (the echo head's drafts hold on), and a passage repeated.
PROMPTS = [[5, 5, 5, 5], [7] * 20, [11, 40, 99, 3, 250] * 4]


def write_echo_eagle3(folder: Path, target: str, own_embedding: bool) -> str:
    """An EAGLE-3 head whose draft is the token the request has repeated:
    ``fc`` = 0, so the layer's output is its attention's, uniform (q = k = 0)
    over the values ``v = input_layernorm(emb(token))``; ``lm_head`` is the
    embedding table, so the draft is the token whose embedding that mean is
    nearest. ``own_embedding``: a copy of the target's table in the head's
    file, else the head reads the target's."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    write_eagle3_checkpoint(folder, hidden, vocab, heads=4, kv_heads=4, draft_vocab=vocab)
    weights = load_file(str(folder / "model.safetensors"))
    table = load_file(str(Path(target) / "model.safetensors"))["model.embed_tokens.weight"]
    eye = torch.eye(hidden, dtype=torch.bfloat16)
    weights.update({
        "fc.weight": torch.zeros_like(weights["fc.weight"]),
        "midlayer.self_attn.q_proj.weight": torch.zeros_like(weights["midlayer.self_attn.q_proj.weight"]),
        "midlayer.self_attn.k_proj.weight": torch.zeros_like(weights["midlayer.self_attn.k_proj.weight"]),
        "midlayer.self_attn.v_proj.weight": torch.cat([eye, torch.zeros_like(eye)], dim=1),
        "midlayer.self_attn.o_proj.weight": eye,
        "midlayer.mlp.down_proj.weight": torch.zeros_like(weights["midlayer.mlp.down_proj.weight"]),
        "lm_head.weight": table.to(torch.bfloat16),
        "d2t": torch.zeros(vocab, dtype=torch.int64),
        "t2d": torch.ones(vocab, dtype=torch.bool),
    })
    if own_embedding:
        weights["embed_tokens.weight"] = table.to(torch.bfloat16)
    save_file(weights, str(folder / "model.safetensors"))
    return str(folder)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-eagle3")
    target = str(make_tiny_checkpoint(root, arch="llama", num_attention_heads=8, num_key_value_heads=4,
                                      num_hidden_layers=4, max_position_embeddings=1024))
    hf = load_hf(target)
    c = hf.config
    heads = {"published": str(write_eagle3_checkpoint(root / "published", c.hidden_size, c.vocab_size)),
             "echo": write_echo_eagle3(root / "echo", target, own_embedding=False),
             "echo-own-table": write_echo_eagle3(root / "echo-own", target, own_embedding=True)}
    expected = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    return target, heads, hf, expected


def _llm(target: str, head: str, **kwargs) -> LLM:  # noqa: ANN003
    spec = {**SPEC, "model": head, **kwargs.pop("spec", {})}
    return LLM(model=target, **ENGINE, speculative=spec, **kwargs)


def _greedy(llm: LLM) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY)]


SEEDED = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=s, ignore_eos=True) for s in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def one_rank(case):
    """TP 1 with the echo head: its greedy and seeded tokens, and plain seeded sampling's."""
    target, heads, hf, expected = case
    llm = _llm(target, heads["echo"])
    try:
        greedy = _greedy(llm)
        seeded = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, SEEDED)]
        assert llm.engine.stats().num_accepted_tokens > 0
    finally:
        llm.engine.core.close()
    plain = LLM(model=target, **ENGINE)
    try:
        plain_seeded = [r.outputs[0].token_ids for r in plain.generate(PROMPTS, SEEDED)]
        plain_greedy = _greedy(plain)
    finally:
        plain.engine.core.close()
    for p, ours, theirs in zip(PROMPTS, plain_greedy, expected):
        assert_greedy_match(hf, p, ours, theirs)
    assert greedy == plain_greedy and seeded == plain_seeded
    return plain_greedy, plain_seeded


@pytest.mark.parametrize("head, tree", [("echo", False), ("echo-own-table", True), ("published", False)])
def test_eagle3_head_over_two_ranks_keeps_greedy_output(case, one_rank, head, tree):
    """TP 2 drafts (chains, and a tree whose parents reach the worker with
    the step) and keeps TP 1's and plain decoding's greedy tokens; the echo
    heads' drafts are accepted. The echo head's seeded sampling is plain
    seeded sampling's."""
    target, heads, hf, expected = case
    plain_greedy, plain_seeded = one_rank
    llm = _llm(target, heads[head], tensor_parallel_size=2, cpu_threads_per_rank=1, spec={"draft_tree": tree})
    try:
        assert type(llm.engine.core.runner.drafter).__name__ == "Eagle3Proposer"
        assert _greedy(llm) == plain_greedy
        stats = llm.engine.stats()
        assert stats.num_draft_tokens > 0
        if head != "published":  # random weights: its drafts rarely hold
            assert stats.num_accepted_tokens > 0
        if head == "echo":
            assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, SEEDED)] == plain_seeded
            unseeded = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.7, ignore_eos=True,
                                                            logprobs=0))
            assert max_logprob_gap(target, PROMPTS, unseeded) < 1e-4  # every verified row the target's own
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()
