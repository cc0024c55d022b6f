"""An EAGLE-3 head over pipeline stages: the streams it fuses (entering a
low, a middle and a top layer) are computed on several stages, so each
stage sends the columns it has (``AuxColumns``: the stage before's and its
own) on with its activations, and the last stage, which drafts ahead as the
draft head does over stages, holds all three. Greedy output at PP 2 (one
micro-batch and two, a path and a tree) and at TP 2 x PP 2 equals plain
decoding's (checked against HF transformers'), and at PP 4, a stream
computed on each of three stages. Heads: one in a published
layout (random weights), and an "aux echo" head whose draft is read from the
stream entering layer 0 alone, a column stage 0 computes: its drafts hold
where the target repeats a token only if that column reached the last stage
with the right rows (PP 2 accepts as many drafts as PP 1). Beside a KV
transfer, prefill and decode pools of 2 stages each keep plain greedy
output, the decode pool drafting from the streams its own steps record."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvferry import LLM, SamplingParams
from tests.disagg.driver import Result, closing_cores, decode_side, finish_decode, make_core, prefill_side, settle
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.spec.test_eagle3 import write_eagle3_checkpoint
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# No warm-up: these tests time nothing, and each engine start would pay a full-size prefill.
ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, warm_up=False)
# k fixed: on a loaded 2-core box the cost-aware controller may stop drafting.
SPEC = {"method": "eagle3", "num_speculative_tokens": 3, "adaptive": False, "cost_aware": False,
        "batch_token_threshold": 10**6}
# A token repeated (the aux echo head's drafts hold on), and a passage repeated.
PROMPTS = [[5, 5, 5, 5], [7] * 20, [11, 40, 99, 3, 250] * 4]
# Layers 0 and 1 are stage 0's at PP 2 (4 layers), layer 2 stage 1's.
AUX_LAYERS = [0, 1, 2]


def write_aux_echo_eagle3(folder: Path, target: str) -> str:
    """An EAGLE-3 head reading the streams entering layers 0, 1 and 2, whose
    every draft is the token before the newest: ``fc`` = [I | 0 | 0] takes
    the anchor's stream entering layer 0 (its token's embedding), the
    attention and the MLP add nothing (``o_proj``, ``down_proj`` = 0), so the
    layer's output is that embedding, and ``lm_head`` is the embedding table
    (the draft: the token whose embedding it is)."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    write_eagle3_checkpoint(folder, hidden, vocab, heads=4, kv_heads=4, draft_vocab=vocab)
    weights = load_file(str(folder / "model.safetensors"))
    table = load_file(str(Path(target) / "model.safetensors"))["model.embed_tokens.weight"]
    eye = torch.eye(hidden, dtype=torch.bfloat16)
    weights.update({
        "fc.weight": torch.cat([eye, torch.zeros_like(eye), torch.zeros_like(eye)], dim=1),
        "midlayer.self_attn.o_proj.weight": torch.zeros_like(weights["midlayer.self_attn.o_proj.weight"]),
        "midlayer.mlp.down_proj.weight": torch.zeros_like(weights["midlayer.mlp.down_proj.weight"]),
        "lm_head.weight": table.to(torch.bfloat16),
        "d2t": torch.zeros(vocab, dtype=torch.int64),
        "t2d": torch.ones(vocab, dtype=torch.bool),
    })
    save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A tiny Llama of 4 layers (2 a stage), plain decoding's greedy tokens
    (checked against HF), and the aux echo head's accepted drafts at PP 1."""
    root = tmp_path_factory.mktemp("pp-eagle3")
    target = str(make_tiny_checkpoint(root, arch="llama", num_attention_heads=8, num_key_value_heads=4,
                                      num_hidden_layers=4, max_position_embeddings=1024))
    hf = load_hf(target)
    c = hf.config
    heads = {"published": str(write_eagle3_checkpoint(root / "published", c.hidden_size, c.vocab_size)),
             "aux-echo": write_aux_echo_eagle3(root / "aux-echo", target)}
    plain = LLM(model=target, **ENGINE)
    try:
        greedy = [r.outputs[0].token_ids for r in plain.generate(PROMPTS, GREEDY)]
    finally:
        plain.engine.core.close()
    for p, ours in zip(PROMPTS, greedy):
        assert_greedy_match(hf, p, ours, hf_greedy(hf, p, MAX_NEW))
    one = _llm(target, heads["aux-echo"], pp=1)
    try:
        assert [r.outputs[0].token_ids for r in one.generate(PROMPTS, GREEDY)] == greedy
        accepted = one.engine.stats().num_accepted_tokens
    finally:
        one.engine.core.close()
    assert accepted > 0
    return target, heads, greedy, accepted


def _llm(target: str, head: str, pp: int = 2, **kwargs) -> LLM:  # noqa: ANN003
    spec = {**SPEC, "model": head, **kwargs.pop("spec", {})}
    stages = dict(pipeline_parallel_size=pp, cpu_threads_per_rank=1) if pp > 1 else {}
    return LLM(model=target, **ENGINE, speculative=spec, **stages, **kwargs)


@pytest.mark.parametrize("head, tree, micro_batches, tp, pp",
                         [("aux-echo", False, 1, 1, 2), ("aux-echo", True, 2, 1, 2), ("published", False, 2, 1, 2),
                          ("aux-echo", False, 1, 2, 2), ("aux-echo", False, 2, 1, 4)],
                         ids=["aux-echo-path", "aux-echo-tree-2-micro-batches", "published", "aux-echo-tp2-pp2",
                              "aux-echo-pp4"])
def test_eagle3_head_over_stages_keeps_plain_output(case, head, tree, micro_batches, tp, pp):
    """The last stage drafts with the three streams, the earlier stages'
    columns come with the activations; at TP 2 x PP 2 the last stage's TP
    rank 0 drafts alone (its peers take the columns and keep none). At PP 4
    (a layer a stage) each of stages 0-2 computes one column and passes on
    those before it, and the last computes none."""
    target, heads, greedy, accepted_one_stage = case
    llm = _llm(target, heads[head], pp=pp, spec={"draft_tree": tree}, pp_micro_batches=micro_batches,
               tensor_parallel_size=tp)
    try:
        assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY)] == greedy
        stats = llm.engine.stats()
        assert stats.num_draft_tokens > 0
        if head == "aux-echo":  # its drafts are right only with stage 0's column, row for row
            assert stats.num_accepted_tokens > 0
            if not tree:
                assert stats.num_accepted_tokens == accepted_one_stage
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()


def test_eagle3_head_beside_a_kv_transfer_over_stages(case):
    """P(pp 2) / D(pp 2), method eagle3 on both pools (two in-process engine
    cores with their real transfer sockets and stage processes; the test
    plays the router): the prefill core streams each stage's layers as it
    computes them while its last stage records the prompt's streams; the
    decode core, which gets the prompt's KV but none of its streams, drafts
    from the rows its own steps record (placeholders until then). Greedy
    output equals plain decoding's, drafts accepted, no prompt position
    computed on the decode core."""
    target, heads, greedy, _ = case
    spec = {**SPEC, "model": heads["aux-echo"]}
    stages = dict(pipeline_parallel_size=2, cpu_threads_per_rank=1)
    prefill = make_core(target, speculative=spec, max_num_batched_tokens=32, warm_up=False, **stages)
    decode = make_core(target, speculative=spec, warm_up=False, **stages)
    with closing_cores(prefill, decode):
        for i, (prompt, want) in enumerate(zip(PROMPTS, greedy)):
            result = Result(destination=decode_side(decode, f"e{i}", prompt, GREEDY))
            first = prefill_side(prefill, f"e{i}", prompt, GREEDY, result.destination)
            assert first.finish_reason == "prefilled", first
            result.tokens = list(first.new_token_ids)
            result = finish_decode(decode, f"e{i}", result, timeout_s=120)
            assert result.tokens == want and not result.transfer_errors
        stats = decode.stats()
        assert stats.num_prompt_tokens_computed == 0
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        settle(prefill, decode, timeout_s=60)
