"""Draft-model speculation over tensor-parallel ranks: the draft runs whole
on rank 0 (outside the ranks' collectives) and the workers get each step
with its drafts; greedy output equals plain TP 1 decoding, offline at TP 2,
and served through P/D pairs of different layouts (prefill TP 2 / decode
TP 1 and TP 1 / TP 2), where the draft's KV travels from prefill rank 0 to
decode rank 0 whole (the draft is not sharded) with the target's heads
resharded as usual."""
from __future__ import annotations

import json

import pytest

from kvferry import LLM, SamplingParams
from tests.disagg.test_disagg_spec import repetitive_prompt
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


@pytest.fixture(scope="module")
def plain(models) -> str:
    llm = LLM(model=models[0], dtype="float32", kv_cache_memory_gb=0.02)
    try:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        return llm.generate([repetitive_prompt()], params)[0].outputs[0].text
    finally:
        llm.engine.core.close()


def test_draft_model_over_two_ranks_keeps_greedy_output(models, plain):
    target, draft = models
    for spec_model in (target, draft):  # the target as its own draft (every greedy draft holds), and another
        llm = LLM(model=target, dtype="float32", kv_cache_memory_gb=0.02, tensor_parallel_size=2,
                  cpu_threads_per_rank=1, speculative={**SPEC, "model": spec_model})
        try:
            params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
            assert llm.generate([repetitive_prompt()], params)[0].outputs[0].text == plain
            stats = llm.engine.stats()
            assert stats.num_draft_tokens > 0
            if spec_model == target:
                assert stats.num_accepted_tokens > 0
            llm.engine.check_integrity()
        finally:
            llm.engine.core.close()


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_draft_kv_travels_across_layouts(models, plain, tmp_path, prefill_tp, decode_tp):
    target, _ = models
    srv = start_server(tmp_path / "server.log", [
        "--model", target, "--dtype", "float32", "--served-model-name", "tiny", "--mode", "disagg",
        "--prefill", "1", "--decode", "1", "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
        "--cpu-threads-per-rank", "1", "--speculative-config", json.dumps({**SPEC, "model": target}),
        "--kv-transfer-failure", "fail", "--engine-heartbeat-timeout", "120"])
    try:
        prompt = repetitive_prompt()
        assert complete(srv, "tiny", prompt, MAX_NEW) == plain
        # The decode core drafted from the draft KV it received: no prompt position recomputed.
        workers = check_decode_core(srv, len(prompt))
        assert workers["prefill-0"]["draft_prompt_tokens_computed"] == len(prompt)
        assert "Traceback" not in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()[-5000:]
