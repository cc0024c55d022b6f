"""The one-call C++ decoder layer over GGUF blocks (--quantization gguf):
taken, and the Python layer's results to the bit, on decode rows (the
integer dots) and prefill rows (the bf16 tiles) alike, a Q4_K_M file's
layers of mixed types (q/k Q4_K, v Q6_K) included."""
from __future__ import annotations

import pytest
import torch

from bench._llama_cpp import missing_reason, quantize
from kvferry.model import layer_op, quant
from kvferry.model.layers.gguf import QUANT_KIND, QUANT_PARTS, GGUFLinearMethod
from kvferry.model.loader import load_model
from tests.model.own_cache import own_model_cache
from tests.model.test_layer_op import OP, PLANS, _run, _same
from tests.tiny_models import make_tiny_checkpoint, write_tiny_gguf

STACK_OP = "kvferry_layer::decoder_layers"

pytestmark = pytest.mark.skipif(not quant.available(), reason="the C++ quantized matmul did not build here")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with own_model_cache(tmp_path_factory.mktemp("gguf-layer-op")) as tmp:
        yield tmp, make_tiny_checkpoint(tmp, "llama", num_hidden_layers=3)


@pytest.mark.parametrize("qtype,dtype", [("Q8_0", "float32"), ("Q4_0", "bfloat16"), ("Q4_1", "bfloat16"),
                                         ("Q5_1", "float32")])
def test_layer_op_over_blocks_equals_python_layer(tiny, monkeypatch, qtype, dtype):
    if not layer_op.available():
        pytest.skip("the layer op is not available")
    tmp, hf = tiny
    f = write_tiny_gguf(hf, tmp / f"tiny-{qtype}.gguf", qtype=qtype)
    model = load_model(str(f), dtype=dtype, quantization="gguf").model
    # PLANS has decode steps (1-3 rows: the dots) and 14- and 15-row steps:
    # the tiles where the 32-blocks take them from 12 rows (with AMX; without,
    # from 25), so here from 12 on every CPU, in both layers.
    monkeypatch.setitem(quant.kernels.PREFILL_MIN_ROWS, 32, 12)
    quant.kernels.configure()
    try:
        _check_layer_op(model, monkeypatch, qtype)
    finally:
        monkeypatch.undo()
        quant.kernels.configure()


def _check_layer_op(model, monkeypatch, qtype: str) -> None:
    fast, fast_cache, fast_ops = _run(model, monkeypatch, "0")
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, GGUFLinearMethod)
    assert qkv.matmul_args().kind == QUANT_KIND + quant.block_format(qtype).ggml_type
    slow, slow_cache, slow_ops = _run(model, monkeypatch, "1")
    assert OP in fast_ops and OP not in slow_ops
    assert STACK_OP in fast_ops  # every layer in one call (no hook between layers here)
    assert model._layer_stack.workspace_rows() > 0  # in the stack's reused buffers
    assert max(sum(p.values()) for p in PLANS) >= quant.kernels.PREFILL_MIN_ROWS[32]
    for got, want in zip(fast, slow, strict=True):
        assert got.keys() == want.keys()
        for rid in got:
            assert _same(got[rid], want[rid]), f"request {rid}: logits differ"
    assert _same(fast_cache, slow_cache)


def test_workspace_follows_a_new_kv_pool_and_fp8(tiny, monkeypatch):
    """The layer stack's workspace keeps views of the KV pool it was given:
    a step over another pool (a fresh harness), and one in fp8, are still
    the Python layer's to the bit."""
    if not layer_op.available():
        pytest.skip("the layer op is not available")
    tmp, hf = tiny
    model = load_model(str(write_tiny_gguf(hf, tmp / "tiny-ws.gguf", qtype="Q8_0")), dtype="bfloat16",
                       quantization="gguf").model
    slow, slow_cache, _ = _run(model, monkeypatch, "1")
    for _ in range(2):  # the second harness's pool is another tensor
        fast, fast_cache, _ = _run(model, monkeypatch, "0")
        assert model._layer_stack.workspace_rows() > 0
        assert all(_same(g[r], w[r]) for g, w in zip(fast, slow, strict=True) for r in w)
        assert _same(fast_cache, slow_cache)
    fp8 = torch.float8_e5m2
    fast, fast_cache, _ = _run(model, monkeypatch, "0", cache_dtype=fp8)
    slow, slow_cache, _ = _run(model, monkeypatch, "1", cache_dtype=fp8)
    assert all(_same(g[r], w[r]) for g, w in zip(fast, slow, strict=True) for r in w)
    assert _same(fast_cache, slow_cache)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """A tiny llama (hidden 256: K-quant rows) as llama-quantize's Q4_K_M of
    its F32 GGUF: q/k Q4_K, v (and ffn_down) Q6_K on the layers given more
    bits (of 2 layers, the last: i >= 7n/8), all Q4_K on the other. Two
    layers are the fewest that hold a mixed layer and a uniform one."""
    reason = missing_reason("llama-quantize")
    if reason is not None:
        pytest.skip(reason)
    with own_model_cache(tmp_path_factory.mktemp("gguf-layer-op-kq")) as tmp:
        hf = make_tiny_checkpoint(tmp, "llama", num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                                  num_attention_heads=4, num_key_value_heads=2)
        f32 = write_tiny_gguf(hf, tmp / "tiny-f32.gguf")
        yield quantize(f32, tmp / "tiny-q4_k_m.gguf", "Q4_K_M")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mixed_types_run_the_op_and_equal_the_python_layer(q4_k_m, monkeypatch, dtype):
    """A fused layer whose shards differ in type (Q4_K_M's q/k in Q4_K, v in
    Q6_K) is the op's kind QUANT_PARTS: every layer of the file takes the
    one-call layer, and its results are the Python layer's to the bit."""
    if not layer_op.available():
        pytest.skip("the layer op is not available")
    model = load_model(str(q4_k_m), dtype=dtype, quantization="gguf").model
    kinds = [layer.self_attn.qkv_proj.matmul_args().kind for layer in model.layers]
    q4k, q6k = (quant.block_format(t).ggml_type for t in ("Q4_K", "Q6_K"))
    assert QUANT_PARTS in kinds and QUANT_KIND + q4k in kinds, kinds  # mixed layers and uniform ones
    mixed = model.layers[kinds.index(QUANT_PARTS)].self_attn.qkv_proj.matmul_args()
    assert q6k in mixed.part_types and q4k in mixed.part_types
    fast, fast_cache, fast_ops = _run(model, monkeypatch, "0")
    assert model._layer_args is not None
    slow, slow_cache, slow_ops = _run(model, monkeypatch, "1")
    assert OP in fast_ops and OP not in slow_ops
    for got, want in zip(fast, slow, strict=True):
        assert got.keys() == want.keys()
        for rid in got:
            assert _same(got[rid], want[rid]), f"request {rid}: logits differ"
    assert _same(fast_cache, slow_cache)
