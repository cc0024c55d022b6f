"""The one-call C++ decoder layer (layer_op.py): taken where it applies, not
where it does not, and the Python layer's results to the bit."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from kvferry.model import layer_op, small_gemm
from kvferry.model.loader import load_model
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import load_hf_model, make_tiny_checkpoint

OP = "kvferry_layer::decoder_layer"

# Chunked prefill over cached context, a new prompt beside decodes, decodes.
SEQS = {0: list(range(3, 40)), 1: list(range(50, 70)), 2: list(range(100, 130))}
PLANS = [{0: 9, 1: 6}, {0: 5, 1: 1}, {0: 1, 1: 1, 2: 12}, {0: 1, 1: 1, 2: 1}, {0: 1, 2: 1}]


def _needs_op(dtype: torch.dtype) -> None:
    if not small_gemm.available(dtype) or not layer_op.available():
        pytest.skip(f"small_gemm for {dtype} or the layer op is not available on this CPU / build")


def _run(model, monkeypatch, disabled: str) -> tuple[list[dict[int, torch.Tensor]], torch.Tensor, set[str]]:
    """Every plan through a fresh harness (same seed: same block tables)
    with the layer op on or off; the logits, the KV cache and the ops seen."""
    monkeypatch.setenv("KVFERRY_DISABLE_LAYER_OP", disabled)
    harness = PagedHarness(model, seed=3)
    with profile() as prof:
        logits = [harness.step(SEQS, plan) for plan in PLANS]
    return logits, harness.kv_cache, {e.key for e in prof.key_averages()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit, NaN (never-written cache slots) where the other has NaN."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_op_equals_python_layer(tmp_path, monkeypatch, dtype):
    _needs_op(getattr(torch, dtype))
    path = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    model = load_model(str(path), dtype=dtype).model
    fast, fast_cache, fast_ops = _run(model, monkeypatch, "0")
    slow, slow_cache, slow_ops = _run(model, monkeypatch, "1")
    assert OP in fast_ops and OP not in slow_ops
    for got, want in zip(fast, slow, strict=True):
        assert got.keys() == want.keys()
        for rid in got:
            assert _same(got[rid], want[rid]), f"request {rid}: logits differ"
    assert _same(fast_cache, slow_cache)  # the same K/V written to the same slots
    if dtype == "float32":  # and both are HF's
        with torch.no_grad():
            want = load_hf_model(path)(torch.tensor([SEQS[0][:16]])).logits[0]
        got = torch.cat([fast[0][0], fast[1][0], fast[2][0], fast[3][0]])  # request 0's first 16 tokens
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_layer_op_not_taken_where_an_op_is_not_ours(tmp_path, monkeypatch, arch):
    """Qwen2's biased qkv (oneDNN) and Qwen3's per-head q/k norms run in the Python layer."""
    _needs_op(torch.float32)
    model = load_model(str(make_tiny_checkpoint(tmp_path, arch, num_hidden_layers=2)), dtype="float32").model
    _, _, ops = _run(model, monkeypatch, "0")
    assert OP not in ops
    assert model._layer_args is None


def test_layer_op_not_taken_for_a_chunk_left_to_sdpa(tmp_path, monkeypatch):
    """A chunk longer than the kernel takes goes to SDPA: that step runs the Python layer."""
    from kvferry.model import attention

    _needs_op(torch.float32)
    model = load_model(str(make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=2)), dtype="float32").model
    monkeypatch.setenv("KVFERRY_DISABLE_LAYER_OP", "0")
    harness = PagedHarness(model)
    with profile() as prof:
        harness.step(SEQS, {0: 5})  # within the kernel's chunk limit
    assert OP in {e.key for e in prof.key_averages()}
    monkeypatch.setattr(attention, "_KERNEL_MAX_PREFILL_TOKENS", 4)
    with profile() as prof:
        harness.step(SEQS, {0: 8})
    assert OP not in {e.key for e in prof.key_averages()}
