"""Quantized weights over pipeline stages: a ``.gguf``'s blocks and int8
weights, each stage holding only its own layers in that format (the first
the embedding, the last the lm_head), never a float copy of the model.

A tiny llama of 4 layers in Q8_0 (its embedding and lm_head too), and the
same float model under ``--quantization int8`` and as a W8A8
compressed-tensors checkpoint: greedy output at PP 2 equals PP 1's in the
same format, through the offline LLM API. A stage's weights are checked
where its process loads them (``load_model(stage=...)``, what
``pp_worker`` calls) and on stage 0, which is the engine core itself.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.model.layers.gguf import GGUFEmbeddingMethod, GGUFLinearMethod
from kvferry.model.layers.int8 import Int8LinearMethod
from kvferry.model.loader import load_model
from kvferry.parallel.pipeline import PPStage
from tests.model.own_cache import own_model_cache
from tests.model.test_int8 import write_w8a8
from tests.tiny_models import make_tiny_checkpoint, write_tiny_gguf

LAYERS = 4
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory_gb=0.02,
              cpu_threads_per_rank=1, warm_up=False)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    with own_model_cache(tmp_path_factory.mktemp("pp-quant")) as tmp:
        hf = make_tiny_checkpoint(tmp / "dense", "llama", vocab_size=385, num_hidden_layers=LAYERS)
        yield {"hf": hf, "gguf": write_tiny_gguf(hf, tmp / "llama-q8.gguf", qtype="Q8_0", quantize_vocab=True),
               "w8a8": write_w8a8(hf, tmp / "w8a8")}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    # 1 token, a short one, and one past the 64-token budget (a chunked prefill).
    return [[rng.randrange(3, 385) for _ in range(n)] for n in (1, 13, 80)]


def _greedy(model, pp: int, quantization: str | None = None, check=None) -> list[list[int]]:  # noqa: ANN001
    llm = LLM(model=str(model), quantization=quantization, pipeline_parallel_size=pp, **ENGINE)
    try:
        if check is not None:
            check(llm.engine.core.runner.model)
        return [r.outputs[0].token_ids for r in llm.generate(_prompts(), GREEDY)]
    finally:
        llm.engine.core.close()


def _linears(model) -> list:  # noqa: ANN001 - LlamaModel
    """Its layers' matmuls (the lm_head's method is the format's, or plain where a format keeps it so)."""
    return [lin for lin in model.linears() if lin.prefix != "lm_head"]


def _stage0_gguf(model) -> None:  # noqa: ANN001 - stage 0's LlamaModel, in the engine core
    assert len(model.layers) == LAYERS // 2
    assert all(isinstance(lin.method, GGUFLinearMethod) for lin in _linears(model))
    assert isinstance(model.embed.method, GGUFEmbeddingMethod) and model.embed_tokens is None  # no float table


def test_gguf_blocks_over_two_stages_equal_one(files):
    assert _greedy(files["gguf"], 2, check=_stage0_gguf) == _greedy(files["gguf"], 1)


def test_a_later_stage_maps_only_its_layers_blocks(files):
    stage = PPStage.of(LAYERS, 1, 2)
    whole = load_model(str(files["gguf"]), dtype="float32")
    model = load_model(str(files["gguf"]), dtype="float32", stage=stage).model
    assert len(model.layers) == 2 and model.embed.num_embeddings == 0  # no embedding rows on the last stage
    linears = model.linears()
    assert linears and all(isinstance(lin.method, GGUFLinearMethod) for lin in linears)  # the lm_head's too
    assert model.lm_head is None  # blocks, no float matrix
    floats = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p.dtype == torch.float32)
    assert floats == 0  # only norms (1-D) in float
    held = sum(lin.method.nbytes(lin) for lin in linears)
    layer_bytes = sum(lin.method.nbytes(lin) for lin in whole.model.linears() if lin.prefix != "lm_head") // LAYERS
    lm_head = whole.model.logits_proj.method.nbytes(whole.model.logits_proj)
    assert held == 2 * layer_bytes + lm_head


@pytest.fixture(scope="module")
def int8_at_one_stage(files):
    # A W8A8 checkpoint's int8 tensors are --quantization int8's bits (tests/model/test_int8.py).
    return _greedy(files["hf"], 1, "int8")


@pytest.mark.parametrize("source", ["int8", "w8a8"])
def test_int8_over_two_stages_equals_one(files, int8_at_one_stage, source):
    def int8_layers(model) -> None:  # noqa: ANN001
        assert len(model.layers) == 2
        assert all(isinstance(lin.method, Int8LinearMethod) for lin in _linears(model))
    model, q = (files["hf"], "int8") if source == "int8" else (files["w8a8"], None)
    assert _greedy(model, 2, q, check=int8_layers) == int8_at_one_stage
    stage = load_model(str(model), dtype="float32", quantization=q, stage=PPStage.of(LAYERS, 1, 2)).model
    assert all(isinstance(lin.method, Int8LinearMethod) for lin in _linears(stage))
