"""Prefill/decode disaggregation with a pool that runs tensor and pipeline
parallelism together, through the real server and the openai client, on a
tiny random Llama of 3 layers and 4 KV heads (stages of 2 hold layers
[0, 2) and [2, 3); TP ranks of 2 hold heads [0, 2) and [2, 4)):

- P(tp 2 x pp 2) / D(tp 1), from the engine's ``-tp 2 -pp 2`` with the
  decode pool's own ``--decode-tp 1 --decode-pp 1``: each of the prefill
  core's four ranks writes its heads of its layers straight into the decode
  core's pool in shared memory.
- P(tp 1) / D(tp 2 x pp 2): the prefill core sends each layer's heads per
  decode TP rank over tcp; the decode core's rank 0 lands each piece in the
  rank (stage, TP rank) that holds that layer and those heads.
- P(pp 2) / D(tp 2 x pp 2): each prefill stage cuts its own layers by the
  decode TP ranks' heads.

Greedy output equals colocated TP 1 x PP 1 and HF transformers in float32.
``--kv-transfer-failure fail``: a transfer that did not land whole fails the
request instead of being recomputed, so equal text means every piece moved
right. One layout's server at a time (four rank processes of one thread:
slow on two cores, and heavy)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kvferry import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, load_hf
# A short prompt, one the prefill core computes in several chunks (--max-num-batched-tokens 48), one
# ending on a block edge: test_pd_pp.py's, so both layouts' tests read the same.
from tests.parallel.test_pd_pp import MAX_NEW, PROMPTS
from tests.serve.server_process import start_server
from tests.tiny_models import make_tiny_checkpoint

SERVE = ["--mode", "disagg", "--prefill", "1", "--decode", "1", "--cpu-threads-per-rank", "1",
         "--max-num-batched-tokens", "48", "--kv-transfer-failure", "fail", "--engine-heartbeat-timeout", "120",
         "--engine-start-timeout", "300"]
# name -> (the flags that size the pools, (prefill TP, PP), (decode TP, PP))
LAYOUTS = {
    "p-tp2pp2-d-tp1": (["-tp", "2", "-pp", "2", "--decode-tp", "1", "--decode-pp", "1"], (2, 2), (1, 1)),
    "p-tp1-d-tp2pp2": (["--prefill-tp", "1", "--decode-tp", "2", "--decode-pp", "2"], (1, 1), (2, 2)),
    "p-pp2-d-tp2pp2": (["--prefill-pp", "2", "--decode-tp", "2", "--decode-pp", "2"], (1, 2), (2, 2)),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("pd-tp-pp"), num_hidden_layers=3, num_attention_heads=8,
                                    num_key_value_heads=4, vocab_size=387, max_position_embeddings=1024))


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[str]:
    """Colocated TP 1 x PP 1's greedy text of each prompt, whose tokens are HF float32's."""
    hf = load_hf(checkpoint)
    offline = LLM(model=checkpoint, dtype="float32", kv_cache_memory_gb=0.02)
    try:
        results = offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    finally:
        offline.engine.core.close()
    assert [r.outputs[0].token_ids for r in results] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    return [r.outputs[0].text for r in results]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pd_server(request, checkpoint, expected, tmp_path_factory):  # expected first: HF is not alive beside it
    flags, prefill, decode = LAYOUTS[request.param]
    srv = start_server(tmp_path_factory.mktemp(request.param) / "server.log", ["--model", checkpoint, *SERVE, *flags])
    yield srv, prefill, decode
    assert srv.stop() == 0, srv.log()[-5000:]


def _greedy(srv, prompt: list[int]) -> str:
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300) as client:
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_NEW
    return r.choices[0].text


def test_greedy_output_equals_colocated_and_hf(pd_server, expected):
    srv, prefill, decode = pd_server
    for prompt, want in zip(PROMPTS, expected):
        assert _greedy(srv, prompt) == want, (prefill, decode, len(prompt))
    # Together: one step of several prompts, cut into micro-batches on the stages, whose last sends each layer
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(lambda p: _greedy(srv, p), PROMPTS)) == expected
    log = srv.log()
    assert "KV transfer failed" not in log and "Traceback" not in log, log[-3000:]


def test_each_pool_runs_its_own_layout(pd_server):
    srv, prefill, decode = pd_server
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=30)
    assert r.status_code == 200, r.text
    layouts = {w["name"]: (w["tensor_parallel_size"], w["pipeline_parallel_size"], len(w["ranks"]) or 1)
               for w in r.json()["data"]}
    assert layouts == {"prefill-0": (*prefill, prefill[0] * prefill[1]),
                       "decode-0": (*decode, decode[0] * decode[1])}, layouts
