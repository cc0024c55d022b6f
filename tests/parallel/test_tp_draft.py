"""Draft-model speculation over tensor-parallel ranks: the draft runs whole
on rank 0 (outside the ranks' collectives) and the workers get each step
with its drafts; greedy output equals plain TP 1 decoding, offline at TP 2,
and served through P/D pairs of different layouts (prefill TP 2 / decode
TP 1 and TP 1 / TP 2), where the draft's KV travels from prefill rank 0 to
decode rank 0 whole (the draft is not sharded) with the target's heads
resharded as usual."""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from kvferry import LLM, SamplingParams
from tests.disagg.test_disagg_spec import repetitive_prompt
from tests.parallel.afd_helpers import servers_at_once
from tests.serve.server_process import start_server
from tests.serve.test_disagg_spec_serve import check_decode_core, complete
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 24
# k fixed: on a loaded 2-core box the cost-aware controller may stop drafting.
SPEC = {"method": "draft", "num_speculative_tokens": 3, "adaptive": False, "cost_aware": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("tp-draft")
    target = str(make_tiny_checkpoint(root, arch="llama", num_attention_heads=8, num_key_value_heads=4,
                                      num_hidden_layers=2, max_position_embeddings=1024))
    # A draft of its own shape (3 KV heads: it need not split over the ranks).
    draft = str(make_tiny_checkpoint(root, arch="llama", name="draft", seed=3, num_attention_heads=3,
                                     num_key_value_heads=3, hidden_size=48, num_hidden_layers=1,
                                     max_position_embeddings=1024))
    return target, draft


# Every prompt the tests decode: the head's (a token repeated, which its
# echo drafts hold on) and the draft model's.
HEAD_PROMPTS = [[5, 5, 5, 5], [7] * 20]
PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# No warm-up: these tests time nothing, and each engine start would pay a full-size prefill.
ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, warm_up=False)


def _plain(target: str) -> dict[tuple[int, ...], tuple[list[int], str]]:
    """Plain TP 1 decoding of every prompt (one engine for the module):
    prompt -> (token ids, text)."""
    prompts = [*HEAD_PROMPTS, repetitive_prompt()]
    llm = LLM(model=target, **ENGINE)
    try:
        return {tuple(p): (r.outputs[0].token_ids, r.outputs[0].text)
                for p, r in zip(prompts, llm.generate(prompts, PARAMS))}
    finally:
        llm.engine.core.close()


@pytest.fixture(scope="module")
def plain(crossings) -> dict[tuple[int, ...], tuple[list[int], str]]:
    return crossings[1]


def test_draft_model_over_two_ranks_keeps_greedy_output(models, plain):
    target, draft = models
    for spec_model in (target,):  # the target as its own draft: every greedy draft holds
        llm = LLM(model=target, **ENGINE, tensor_parallel_size=2, cpu_threads_per_rank=1,
                  speculative={**SPEC, "model": spec_model})
        try:
            prompt = repetitive_prompt()
            assert llm.generate([prompt], PARAMS)[0].outputs[0].text == plain[tuple(prompt)][1]
            stats = llm.engine.stats()
            assert stats.num_draft_tokens > 0
            assert stats.num_accepted_tokens > 0
            llm.engine.check_integrity()
        finally:
            llm.engine.core.close()


# Draft KV from prefill rank 0 (the draft is whole there) to decode rank 0;
# the head's hidden state from prefill rank 0 (it samples) to decode rank 0,
# which hands it to its workers' heads with the next step.
CROSSINGS = [("draft", 2, 1), ("head", 1, 2)]


def _prompt(method: str) -> list[int]:
    return [7] * 20 if method == "head" else repetitive_prompt()


def _start(target: str, echo_head: str, log_dir: Path, method: str, prefill_tp: int, decode_tp: int):  # noqa: ANN202
    spec = {**SPEC, "method": method, "model": target if method == "draft" else echo_head}
    return start_server(log_dir / "server.log", [
        "--model", target, "--dtype", "float32", "--served-model-name", "tiny", "--mode", "disagg",
        "--prefill", "1", "--decode", "1", "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
        "--cpu-threads-per-rank", "1", "--speculative-config", json.dumps(spec),
        "--kv-transfer-failure", "fail", "--engine-heartbeat-timeout", "120"])


@pytest.fixture(scope="module")
def crossings(models, echo_head, tmp_path_factory):
    """Both P/D servers, started at once while plain TP 1 decodes every prompt."""
    dirs = {c: tmp_path_factory.mktemp(f"tp-draft-{c[0]}") for c in CROSSINGS}
    with servers_at_once({c: partial(_start, models[0], echo_head, dirs[c], *c) for c in CROSSINGS},
                         meanwhile=partial(_plain, models[0])) as both:
        yield both


@pytest.mark.parametrize("method, prefill_tp, decode_tp", CROSSINGS)
def test_draft_state_travels_across_layouts(crossings, plain, method, prefill_tp, decode_tp):
    srv = crossings[0][method, prefill_tp, decode_tp]
    prompt = _prompt(method)
    assert complete(srv, "tiny", prompt, MAX_NEW) == plain[tuple(prompt)][1]
    # The decode core drafted (and its drafts held) from what it received:
    # no prompt position recomputed.
    workers = check_decode_core(srv, len(prompt))
    if method == "draft":
        assert workers["prefill-0"]["draft_prompt_tokens_computed"] == len(prompt)
    assert "Traceback" not in srv.log()


@pytest.fixture(scope="module")
def echo_head(models, tmp_path_factory) -> str:
    """A head that passes the target's hidden state through (fc = [0 | I],
    no MLP): its draft is the token the target's own lm_head gives that
    state, the newest token again, so it is accepted wherever the target
    repeats a token, and a worker whose draft differed from rank 0's would
    verify other tokens than rank 0 samples from."""
    import torch

    from kvferry.spec.head import EagleHead

    hidden = json.loads((Path(models[0]) / "config.json").read_text())["hidden_size"]
    head = EagleHead(hidden, 64)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.down.weight.zero_()
    path = tmp_path_factory.mktemp("tp-head") / "echo.safetensors"
    head.save(path, target="echo")
    return str(path)


def test_draft_head_over_two_ranks_keeps_greedy_output(models, plain, echo_head):
    """Every rank drafts with the head in step (its token lookups and logits
    are the ranks' collectives), so the verified drafts are the same on all."""
    prompts = [*HEAD_PROMPTS, repetitive_prompt()]
    expected = [plain[tuple(p)][0] for p in prompts]
    llm = LLM(model=models[0], **ENGINE, tensor_parallel_size=2, cpu_threads_per_rank=1,
              speculative={**SPEC, "method": "head", "model": echo_head})
    try:
        assert [r.outputs[0].token_ids for r in llm.generate(prompts, PARAMS)] == expected
        stats = llm.engine.stats()
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()


def max_logprob_gap(target: str, prompts: list[list[int]], results) -> float:  # noqa: ANN001 - RequestOutputs
    """The largest gap between each sampled token's reported logprob and
    plain decoding's at that position (the prompt and outputs before it
    scored by one plain engine): ~1e-6 where every verified position was
    computed right."""
    plain = LLM(model=target, **ENGINE)
    try:
        gap = 0.0
        for p, r in zip(prompts, results):
            ids = r.outputs[0].token_ids
            ref = plain.generate([p + ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
            gap = max(gap, *(abs(a.logprob - b.logprob) for a, b in zip(r.outputs[0].logprobs, ref[len(p):])))
        return gap
    finally:
        plain.engine.core.close()


def test_draft_head_over_two_ranks_samples_unseeded_from_the_targets_distribution(models, echo_head):
    """An unseeded sampling request's drafts are drawn against fresh noise,
    which differs from rank to rank: rank 0's drafts reach the workers
    before the forward pass (one small sum), so every rank embeds the same
    tokens and each sampled token's logprob is the target's own there."""
    prompts = [*HEAD_PROMPTS, [9] * 12]
    llm = LLM(model=models[0], **ENGINE, tensor_parallel_size=2, cpu_threads_per_rank=1,
              speculative={**SPEC, "method": "head", "model": echo_head})
    try:
        results = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.7, ignore_eos=True, logprobs=0))
        assert llm.engine.stats().num_accepted_tokens > 0
    finally:
        llm.engine.core.close()
    assert max_logprob_gap(models[0], prompts, results) < 1e-4
