"""--deterministic's kernels (model/layers/unquantized.py, csrc/paged_decode.cpp's
batch-invariant mode): a row's result does not depend on the rest of the call."""
from __future__ import annotations

import pytest
import torch

from kvferry.model import layer_op, small_gemm
from kvferry.model.layers import BatchInvariantConfig, BatchInvariantLinearMethod, Linear
from kvferry.model.loader import load_model
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import make_tiny_checkpoint

needs_bf16_kernel = pytest.mark.skipif(not small_gemm.cpu_supports(torch.bfloat16) or not small_gemm.builds()
                                       or not torch.backends.mkldnn.is_available(),
                                       reason="needs AVX512-BF16, the small_gemm build and oneDNN")


@needs_bf16_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_batch_invariant_linear_rows_do_not_depend_on_the_row_count(bias):
    torch.manual_seed(0)
    k, n = 1024, 768
    lin = Linear(k, n, bias=bias, dtype=torch.bfloat16, device="cpu", method=BatchInvariantLinearMethod())
    lin.weight.data.normal_(0, 0.05)
    if bias:
        lin.bias.data.normal_(0, 0.5)
    lin.process_weights_after_loading()
    # small_gemm's where it is the faster kernel, oneDNN's in fixed blocks on AMX
    assert lin.matmul_args() is not None and lin.matmul_args().kind == (1 if small_gemm.available() else 3)
    x = torch.randn(300, k, dtype=torch.bfloat16)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(x.shape[0])])
    for rows in (2, 3, 17, 64, 65, 128, 300):
        assert torch.equal(lin(x[:rows]), alone[:rows]), rows


@needs_bf16_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the biased qkv in the C++ layer too
@pytest.mark.parametrize("layer_op_disabled", ["0", "1"])
def test_prompt_logits_same_bits_whole_chunked_and_batched(tmp_path, monkeypatch, arch, layer_op_disabled):
    monkeypatch.setenv("KVFERRY_DISABLE_LAYER_OP", layer_op_disabled)
    path = make_tiny_checkpoint(tmp_path, arch, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=512)
    model = load_model(str(path), dtype="bfloat16").model
    model.set_linear_config(BatchInvariantConfig())
    seq = [(i * 37) % 300 + 3 for i in range(97)]
    other = [(i * 11) % 300 + 3 for i in range(60)]
    whole = PagedHarness(model, num_blocks=128, block_size=16, seed=1).step({0: seq}, {0: len(seq)})[0]
    # The same prompt in chunks of 7 (the last ones decodes), beside another request.
    h = PagedHarness(model, num_blocks=128, block_size=16, seed=2)
    pieces, done = [], 0
    while done < len(seq):
        n = min(7 if done < 90 else 1, len(seq) - done)
        plan = {0: n, 1: 5} if h.computed.get(1, 0) < len(other) else {0: n}
        pieces.append(h.step({0: seq, 1: other}, plan)[0])
        done += n
    chunked = torch.cat(pieces)
    assert torch.equal(chunked, whole)
    if layer_op_disabled == "0" and layer_op.available():
        assert model._layer_args is not None  # the C++ layer ran with the batch-invariant matmuls


def test_batch_invariant_is_off_by_default(tmp_path):
    model = load_model(str(make_tiny_checkpoint(tmp_path, "llama")), dtype="float32").model
    assert not model.batch_invariant
    model.set_linear_config(BatchInvariantConfig())
    assert model.batch_invariant


@needs_bf16_kernel
def test_cpp_layer_gives_the_python_layers_bits(tmp_path, monkeypatch):
    """The one-call C++ layer runs the batch-invariant matmuls as the Python layer does (qwen2: with a bias)."""
    if not layer_op.available():
        pytest.skip("the layer op is not available")
    path = make_tiny_checkpoint(tmp_path, "qwen2", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=512)
    model = load_model(str(path), dtype="bfloat16").model
    model.set_linear_config(BatchInvariantConfig())
    seq = [(i * 37) % 300 + 3 for i in range(150)]
    got = []
    for disabled in ("0", "1"):
        monkeypatch.setenv("KVFERRY_DISABLE_LAYER_OP", disabled)
        h = PagedHarness(model, num_blocks=64, block_size=16, seed=1)
        got.append(torch.cat([h.step({0: seq}, {0: 100})[0], h.step({0: seq}, {0: 50})[0]]))
    assert model._layer_args is not None
    assert torch.equal(got[0], got[1])
