"""Suffix decoding, method auto and draft trees over tensor-parallel ranks
(and pipeline stages): rank 0's scheduler drafts (auto's controller decides
there alone) and the drafts, a tree's parents and auto's head requests ride
in the step message, so every rank verifies the same tokens.

- Greedy output equals plain TP 1 decoding at TP 2 for suffix (a path and a
  tree), auto with a tree, and auto with a draft head among its choices
  (each rank drafts with the head for the requests rank 0 chose, trees
  included: the same tree on every rank).
- A tree whose right branch is never the first one (tests/spec/
  test_tree_engine.py's oracle): a worker rank, and a pipeline stage before
  the last, learn the accepted branch and move its KV where a chain's would
  be; without that the output drifts. A worker does it within the step (rank
  0 shares the accepted nodes in one small sum), since rank 0's KV store
  connector saves every rank's heads of a block from the next step on: a
  reader of the store then gets plain decoding's logprobs (a worker that
  compacted later, on rank 0's next step, raced that save).
- Tenant scoping over ranks, read from the drafts as rank 0's scheduler
  takes them: tenant b's drafts hold nothing its own text lacked, while a
  second request of tenant a drafts a's first answer. And one real
  ``kvferry serve -tp 2`` with two API-key tenants: a's repeat drafts its
  first answer, b's identical request drafts as if that answer did not
  exist, and all three texts are plain decoding's.

k is fixed (no adaptive or cost-aware controller), so that the drafts
depend only on the proposers, whatever the machine's timings.
"""
from __future__ import annotations

import json
import random

import openai
import pytest

from kvferry import LLM, SamplingParams
from kvferry.config import KVTierConfig
from kvferry.kvstore.launch import start_store
from kvferry.spec.tree import DraftTree
from tests.parallel.test_tp_draft import echo_head  # noqa: F401 (a fixture)
from tests.serve.server_process import start_server
from tests.spec.test_suffix_engine import RecordingProposer
from tests.spec.test_tree_engine import Oracle, Recording
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
FIXED = {"adaptive": False, "cost_aware": False, "batch_token_threshold": 10**6}
ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, cpu_threads_per_rank=1)
TREE = {"num_speculative_tokens": 6, "draft_tree": True, "suffix_decoding_max_spec_factor": 2.0, **FIXED}
VOCAB = 387


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    """(the target, the same target under test_tp_draft's fixture name)."""
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tp-suffix"), arch="llama", num_attention_heads=8,
                                    num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=1024))
    return path, path


@pytest.fixture(scope="module")
def case(models):
    """Prompts where a passage comes back with different continuations (the
    suffix trie branches after it), a repeated token (the echo head's drafts
    hold) and one of no repeats; plain TP 1 decoding's greedy output."""
    rng = random.Random(5)
    prompts = [[7] * 20]
    for n in (3, 5, 8):
        a = [rng.randrange(3, 256) for _ in range(n)]
        b = [[rng.randrange(3, 256) for _ in range(4)] for _ in range(3)]
        prompts.append(a + b[0] + a + b[1] + a + b[0] + a + b[2] + a)
    prompts.append([rng.randrange(3, 380) for _ in range(30)])
    llm = LLM(model=models[0], **ENGINE)
    try:
        return prompts, [r.token_ids for r in llm.generate(prompts, GREEDY)]
    finally:
        llm.engine.core.close()


def _run(llm: LLM, prompts) -> list[list[int]]:
    try:
        out = [r.token_ids for r in llm.generate(prompts, GREEDY)]
        llm.engine.check_integrity()
        return out
    finally:
        llm.engine.core.close()


@pytest.mark.parametrize("spec", [
    {"method": "suffix", "num_speculative_tokens": 4, **FIXED},
    {"method": "suffix", **TREE},
    {"method": "auto", **TREE},
], ids=["suffix-path", "suffix-tree", "auto-tree"])
def test_suffix_and_auto_over_two_ranks_keep_greedy_output(models, case, spec):
    prompts, expected = case
    llm = LLM(model=models[0], tensor_parallel_size=2, speculative=spec, **ENGINE)
    proposer = llm.engine.core.scheduler.proposer
    recording = Recording(proposer.suffix if spec["method"] == "auto" else proposer)
    if spec["method"] == "auto":
        proposer.suffix = proposer.proposers["suffix"] = recording
    else:
        llm.engine.core.scheduler.proposer = recording
    stats = llm.engine.stats
    assert _run(llm, prompts) == expected
    assert stats().num_accepted_tokens > 0
    if spec.get("draft_tree"):
        assert any(isinstance(d, DraftTree) and not d.is_chain() for d in recording.drafts)


def test_the_default_speculation_drafts_over_two_ranks_at_batch_one(models, case):
    """The serving default (auto under the cost-aware controller, timings
    and all) over two ranks: alone, requests whose text repeats draft and
    drafts hold, the controller having measured plain decoding and a
    drafted level on rank 0's clock, and the output is plain TP 1's. (On
    these short outputs TP 1 drafts about as much: 26 drafts, 7 held, against
    TP 2's 23 and 6 in one run.)"""
    prompts, expected = case
    llm = LLM(model=models[0], tensor_parallel_size=2, speculative="default", **ENGINE)
    try:
        got = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]  # one at a time: batch 1
        stats = llm.engine.stats()
        cost = llm.engine.core.scheduler.draft_budget._costs[1]
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()
    assert got == expected
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    assert cost.measured(0) and any(cost.measured(level) for level in range(1, len(cost.seen))), cost


def test_auto_with_a_head_over_two_ranks_keeps_greedy_output(models, case, echo_head):  # noqa: F811
    """Auto picks per request among suffix, n-gram and the head; only rank 0
    knows its pick, and the workers' heads must draft for those requests only."""
    prompts, expected = case
    llm = LLM(model=models[0], tensor_parallel_size=2, speculative={"method": "auto", "model": echo_head, **TREE},
              **ENGINE)
    chosen = llm.engine.core.scheduler.proposer.num_chosen
    stats = llm.engine.stats
    drafter, head_trees = llm.engine.core.runner.drafter, []  # with draft_tree the head drafts trees too
    propose = drafter.propose

    def noting_trees(*args):
        out = propose(*args)
        head_trees.extend(p for p in out.values() if p.parents)
        return out

    drafter.propose = noting_trees
    assert _run(llm, prompts) == expected
    assert chosen["head"] > 0 and chosen["suffix"] > 0 and head_trees, (chosen, len(head_trees))
    assert stats().num_accepted_tokens > 0


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2,
                                                                  "pp_micro_batches": 2}], ids=["tp2", "pp2"])
def test_a_wrong_first_branch_is_compacted_on_every_rank(models, case, layout):
    prompts, expected = case
    llm = LLM(model=models[0], speculative={"method": "suffix", **TREE}, **layout, **ENGINE)
    oracle = llm.engine.core.scheduler.proposer = Oracle({tuple(p): p + o for p, o in zip(prompts, expected)},
                                                          3, VOCAB)
    stats = llm.engine.stats
    assert _run(llm, prompts) == expected
    assert oracle.num_trees > 0
    # Most steps accept the whole right branch (the second): 3 tokens.
    assert stats().num_accepted_tokens >= 2 * stats().num_drafts, (stats().num_accepted_tokens, stats().num_drafts)


def test_tree_blocks_saved_to_a_kv_store_over_ranks_are_whole(models, case):
    """TP 2 writes the blocks (every rank's heads) of trees whose right
    branch is second; a TP 1 core reading them from the store continues the
    text with plain decoding's tokens and logprobs."""
    prompts, engine = case[0][1:4], dict(dtype="float32", block_size=8, num_kv_blocks=128)
    written = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)  # many blocks: many saves
    probe = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM(model=models[0], **engine)
    try:
        expected = [r.token_ids for r in llm.generate(prompts, written)]
        longer = [p + e for p, e in zip(prompts, expected)]
        want = llm.generate(longer, probe)
    finally:
        llm.engine.core.close()
    process, address = start_store(KVTierConfig(kv_dram_gb=0.02))
    try:
        llm = LLM(model=models[0], tensor_parallel_size=2, cpu_threads_per_rank=1, kv_store=address,
                  speculative={"method": "suffix", **TREE}, **engine)
        llm.engine.core.scheduler.proposer = Oracle({tuple(p): p + o for p, o in zip(prompts, expected)}, 3, VOCAB)
        stats = llm.engine.stats
        try:
            assert [r.token_ids for r in llm.generate(prompts, written)] == expected
            assert stats().num_accepted_tokens >= 2 * stats().num_drafts and stats().kv_saved_blocks > 0
        finally:
            llm.engine.core.close()
        llm = LLM(model=models[0], kv_store=address, **engine)
        try:
            got = llm.generate(longer, probe)
        finally:
            llm.engine.core.close()
    finally:
        process.terminate()
        process.wait(timeout=10)
    for g, w, p in zip(got, want, longer):
        assert g.num_cached_tokens >= (len(p) - 1) // 8 * 8 - 8  # the blocks came from the store
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [lp.logprob for lp in g.outputs[0].logprobs] == pytest.approx([lp.logprob for lp in w.outputs[0].logprobs],
                                                                              abs=1e-4)


def _request(llm: LLM, rid: str, prompt: list[int], namespace: str) -> list[int]:
    llm.engine.add_request(rid, prompt, GREEDY, cache_namespace=namespace)
    return llm._run([rid], {rid: 1})[0].outputs[0].token_ids


def test_a_tenant_never_drafts_another_tenants_text_over_ranks(models):
    llm = LLM(model=models[0], tensor_parallel_size=2, speculative={"method": "auto", **TREE}, **ENGINE)
    try:
        scheduler = llm.engine.core.scheduler
        recorder = scheduler.proposer = RecordingProposer(scheduler.proposer)
        rng = random.Random(3)
        prompt = [rng.randrange(3, 200) for _ in range(48)]  # no repeats: nothing of its own to draft from
        secret = _request(llm, "a1", prompt, "a")
        recorder.inner.suffix.work(None)  # what later steps would do in slices
        assert _request(llm, "b1", prompt, "b") == secret
        b_drafts = [(ctx, d) for rid, _, ctx, d in recorder.drafts if rid == "b1"]
        assert b_drafts and all(set(d) <= set(ctx) for ctx, d in b_drafts), b_drafts
        assert _request(llm, "a2", prompt, "a") == secret
        a_drafts = [(ctx, d) for rid, _, ctx, d in recorder.drafts if rid == "a2"]
        assert any(set(d) - set(ctx) for ctx, d in a_drafts)  # drafted from a1's answer
    finally:
        llm.engine.core.close()


# -- one real server --------------------------------------------------------------------------------
KEYS = {"sk-a": {"tenant": "a"}, "sk-b": {"tenant": "b"}, "sk-root": {"tenant": "ops", "admin": True}}
ACCEPTED = "kvferry:spec_decode_num_accepted_tokens_total"
SERVED_NEW = 40


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    d = tmp_path_factory.mktemp("tp-suffix-server")
    (d / "keys.json").write_text(json.dumps(KEYS))
    spec = {"method": "auto", "num_speculative_tokens": 4, "draft_tree": True, **FIXED}
    srv = start_server(d / "server.log", ["--model", models[0], "--served-model-name", "tiny",
                                          "--tensor-parallel-size", "2", "--cpu-threads-per-rank", "1",
                                          "--api-keys", str(d / "keys.json"), "--speculative-config", json.dumps(spec)])
    srv.metrics_key = "sk-root"
    yield srv
    assert srv.stop() == 0, srv.log()[-5000:]


def _complete(srv, key: str, prompt: list[int]) -> tuple[str, float]:
    """The completion's text and the drafts accepted while it ran."""
    before = srv.metric(ACCEPTED)
    done = srv.metric("kvferry:e2e_request_latency_seconds_count")
    with openai.OpenAI(base_url=srv.api_url, api_key=key, max_retries=0, timeout=300) as client:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=SERVED_NEW, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == SERVED_NEW
    srv.wait_for_metric("kvferry:e2e_request_latency_seconds_count", lambda v: v >= done + 1)
    return r.choices[0].text, srv.metric(ACCEPTED) - before


def test_served_tenants_draft_from_their_own_answers_only(server, models):
    prompt = [random.Random(4).randrange(3, 380) for _ in range(40)]
    first, accepted_first = _complete(server, "sk-a", prompt)
    again, accepted_again = _complete(server, "sk-a", prompt)
    other, accepted_other = _complete(server, "sk-b", prompt)
    assert accepted_again >= SERVED_NEW // 2 and accepted_again > accepted_first + 8, (accepted_first, accepted_again)
    assert accepted_other == accepted_first, (accepted_first, accepted_other, accepted_again)
    llm = LLM(model=models[0], **ENGINE)
    try:
        plain = llm.generate([prompt], SamplingParams(max_tokens=SERVED_NEW, temperature=0.0, ignore_eos=True))
    finally:
        llm.engine.core.close()
    assert first == again == other == plain[0].outputs[0].text
