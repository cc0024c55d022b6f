"""The one-call C++ decoder layer over GGUF blocks (--quantization gguf):
taken, and the Python layer's results to the bit, on decode rows (the
integer dots) and prefill rows (the bf16 tiles) alike; not taken where a
layer's shards are of mixed types."""
from __future__ import annotations

import pytest
import torch

from kvferry.model import layer_op, quant
from kvferry.model.layers.gguf import QUANT_KIND, GGUFLinearMethod
from kvferry.model.loader import load_model
from tests.model.own_cache import own_model_cache
from tests.model.test_layer_op import OP, PLANS, _run, _same
from tests.tiny_models import make_tiny_checkpoint, write_tiny_gguf

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
    fast, fast_cache, fast_ops = _run(model, monkeypatch, "0")
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, GGUFLinearMethod)
    assert qkv.matmul_args().kind == QUANT_KIND + quant.block_format(qtype).ggml_type
    slow, slow_cache, slow_ops = _run(model, monkeypatch, "1")
    assert OP in fast_ops and OP not in slow_ops
    # PLANS has decode steps (1-3 rows: the dots) and a 14-row step (the tiles).
    assert max(sum(p.values()) for p in PLANS) >= quant.kernels.PREFILL_MIN_ROWS[32]
    for got, want in zip(fast, slow, strict=True):
        assert got.keys() == want.keys()
        for rid in got:
            assert _same(got[rid], want[rid]), f"request {rid}: logits differ"
    assert _same(fast_cache, slow_cache)


def test_mixed_types_run_the_python_layer(tiny):
    """A fused layer whose shards differ in type (Q4_K_M's q/k and v) has no
    single weight for the op: the model runs its Python layers."""
    tmp, hf = tiny
    model = load_model(str(write_tiny_gguf(hf, tmp / "mixed.gguf", qtype="Q8_0")), dtype="float32",
                       quantization="gguf").model
    model.pack_weights()
    assert model._layer_args is not None
    qkv = model.layers[1].self_attn.qkv_proj
    (w,) = qkv.qweights
    q8, q4 = quant.block_format("Q8_0"), quant.block_format("Q4_0")
    # The same rows as two shards of different types (values do not matter here).
    rows = w.out_features // 2
    half = quant.QuantizedWeight.from_blocks("x", "Q4_0", torch.zeros(rows, w.in_features // 32 * q4.bytes,
                                                                       dtype=torch.uint8), (rows, w.in_features))
    qkv.qweights = [quant.QuantizedWeight(w.name, q8, w.data[:rows], w.in_features), half]
    assert qkv.matmul_args() is None
    assert layer_op.model_layer_args(model) is None
