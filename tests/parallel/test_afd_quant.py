"""Quantized FFN workers: attention/FFN disaggregation with int8 weights and
with a GGUF file's blocks (tiny random Qwen3-MoE, 8 experts, top-2). The
greedy output equals the same quantization colocated:

- ``--quantization int8`` at 1 FFN worker (a dense layer among the sparse
  ones), and at 2 on an all-sparse config (each worker quantizes its four
  whole experts, so every weight's per-channel scale is the colocated one);
- a Q8_0 ``.gguf`` at 1 FFN worker, its blocks (the experts' included)
  kept on the worker as the colocated core keeps them, and at 2 on the
  all-sparse config: each worker reads only its four whole experts' blocks
  (model/gguf_shard.py), the colocated bytes. With every batch size on
  the 8-bit dots (``KVFERRY_QUANT_DOTS_ALWAYS=1``) its logprobs are the
  colocated ones to the bit; on the default paths greedy agrees up to
  colocated's first near tie, because a micro-batch's row count picks the
  kernel (the tests' docstrings, docs/parallelism.md).

``LLM(ffn=M)`` runs one core with its own M workers: the same worker
processes and loading as ``kvferry serve --mode afd``."""
from __future__ import annotations

import pytest

from kvferry import LLM, SamplingParams, envs
from kvferry.model.quant import kernels
from tests.parallel.afd_helpers import PROMPTS
from tests.tiny_moe_models import make_tiny_moe_checkpoint, write_tiny_moe_gguf

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PARAMS_LOGPROBS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("afd-quant")
    mixed = make_tiny_moe_checkpoint(root / "mixed", "qwen3_moe_top2", max_position_embeddings=1024)
    sparse = make_tiny_moe_checkpoint(root / "sparse", "qwen3_moe_top2", max_position_embeddings=1024,
                                      mlp_only_layers=[])
    return {"mixed": str(mixed), "sparse": str(sparse),
            "gguf": str(write_tiny_moe_gguf(mixed, root / "tiny-moe-q8.gguf", "Q8_0")),
            "gguf_sparse": str(write_tiny_moe_gguf(sparse, root / "tiny-sparse-moe-q8.gguf", "Q8_0"))}


def greedy(model: str, ffn: int, logprobs: bool = False, **kwargs) -> list:
    """Each prompt's greedy token ids; with ``logprobs``, its completions (top-2 logprobs per token)."""
    llm = LLM(model=model, dtype="float32", kv_cache_memory_gb=0.02, ffn=ffn, **kwargs)
    try:
        if ffn:
            assert len(llm.engine.core.ranks()) == ffn + 1
        if logprobs:
            return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS_LOGPROBS)]
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.engine.core.close()


@pytest.mark.parametrize(("case", "ffn"), [("mixed", 1), ("sparse", 2)])
def test_int8_ffn_workers_equal_int8_colocated(models, case, ffn):
    assert greedy(models[case], ffn, quantization="int8") == greedy(models[case], 0, quantization="int8")


@pytest.fixture
def dots_always(monkeypatch):
    """Every row count on the quantized kernels' 8-bit dots, in this process
    (the colocated core) and in the FFN workers it spawns (they inherit the
    environment); the library reads the setting when it loads, so a loaded
    one is configured again, and back after."""
    monkeypatch.setenv(envs.QUANT_DOTS_ALWAYS, "1")
    if kernels.available():
        kernels.configure()
    yield
    monkeypatch.delenv(envs.QUANT_DOTS_ALWAYS)
    if kernels.available():
        kernels.configure()


@pytest.mark.parametrize(("case", "ffn"), [("gguf", 1), ("gguf_sparse", 2)])
def test_gguf_ffn_workers_equal_colocated_to_the_bit_on_one_kernel_path(models, case, ffn, dots_always):
    """With every batch size on the dots, whose rows are each quantized and
    multiplied alone (a row's bits never depend on the others), the workers'
    logprobs are colocated's exactly: the wire (the rows' own dtype), the
    norms and residual adds (on the core, in colocated's order), the router
    and the workers' threads change no bit. What differs on the default paths
    is the path itself (next test)."""
    assert greedy(models[case], ffn, logprobs=True) == greedy(models[case], 0, logprobs=True)


# The default paths at 1 worker only: the 2 workers' split is pinned to the
# bit by the previous test, and the paths differ from it only in which
# kernel a row count takes, as at 1 worker (the module's time budget).
@pytest.mark.parametrize(("case", "ffn"), [("gguf", 1)])
def test_gguf_blocks_on_the_ffn_workers_equal_the_gguf_colocated(models, case, ffn):
    """Greedy agrees with colocated, and where they part it is at a near tie
    of colocated's. The workers' logprobs are not the colocated bits, and
    cannot be: a GGUF matmul takes the 8-bit dots below
    quant.kernels.PREFILL_MIN_ROWS rows of x (12 for 32-value blocks with
    AMX, 25 without; 20 for the K-quants) and a dequantized bf16 tile (x rounded to bf16) from there,
    and an expert's rows are the tokens routed to it in the call. Colocated,
    the prefill step is one call of 76 rows; AFD cuts it into micro-batches
    of 70 rows (prompts 0-2) and 6 (prompt 3), and each FFN call gets one
    (or both, when the worker finds them waiting together: timing). Measured
    on the mixed model: prompt 3's rows through layer 0's experts (27, 18,
    24, 16 of the step's tokens on experts 2, 4, 6, 7, tiles; 4, 2, 4, 2 of
    its own, dots) first differ, by up to 0.005, then the dense layer 1
    (76 rows tiles, 6 dots) by 0.02; the 70-row micro-batch's bits are
    colocated's (either path gives a row the same bits at any row count on
    its side of the threshold). Prompt 3's logprobs end up to 0.02 nats
    apart, 0.06 a few tokens on; prompts 0-2 are equal at 1 worker (at 2 on
    the all-sparse model an expert's count crosses the threshold in the 70
    rows too: all four prompts but the 2-token one). The previous test pins
    that nothing else differs. This random model's near-flat logits put near
    ties (top-2 within 0.0001-0.05 nats) in most continuations, where either
    may pick the other token."""
    workers = greedy(models[case], ffn, logprobs=True)
    colocated = greedy(models[case], 0, logprobs=True)
    for w, c in zip(workers, colocated):
        for step, lp in enumerate(c.logprobs):
            assert abs(w.logprobs[step].top_logprobs[0] - lp.top_logprobs[0]) < 0.1, (step, w, c)
            if w.token_ids[step] != c.token_ids[step]:
                assert lp.top_logprobs[0] - lp.top_logprobs[1] < 0.1, (step, w, c)  # a near tie
                break  # the two continue from different tokens
