"""The CPU fast paths: oneDNN-prepacked linears and the fused SDPA kernel.

Each must be taken where it applies (else the speed is silently lost) and
must give the plain path's results.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from kvferry.model import linear as linear_mod
from kvferry.model.linear import linear, pack_weight
from kvferry.model.loader import load_model
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import load_hf_model, make_tiny_checkpoint

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def onednn_packs_bf16() -> bool:
    """Whether this CPU lets oneDNN run bf16 matmuls (AVX-512BW/VL/DQ or AVX-NE-CONVERT)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_linear_matches_f_linear(dtype, rows, monkeypatch):
    monkeypatch.delenv("KVFERRY_DISABLE_ONEDNN_PACKING", raising=False)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    packed = pack_weight(w)
    if dtype == torch.bfloat16 and not onednn_packs_bf16():
        # An AVX2-only CPU: oneDNN refuses to pack bf16 and small_gemm's bf16
        # kernel needs AVX512-BF16, so the plain weight is used (and dtype=auto
        # never picks bf16 there); the fallback must still be right.
        assert packed is None
    else:
        assert packed is not None
    for bias in (None, b):
        got, want = linear(x, w, bias, packed), F.linear(x, w, bias)
        assert got.shape == want.shape == (rows, 96) and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # A non-contiguous input (a column slice) is accepted.
    wide = torch.randn(rows, 128, generator=gen).to(dtype)
    torch.testing.assert_close(linear(wide[:, ::2], w, None, packed).float(), F.linear(wide[:, ::2], w).float(),
                               atol=1e-2, rtol=1e-2)


def test_packing_skipped_where_unsupported(monkeypatch):
    monkeypatch.delenv("KVFERRY_DISABLE_ONEDNN_PACKING", raising=False)
    monkeypatch.setenv("KVFERRY_DISABLE_SMALL_GEMM", "1")  # oneDNN's packing alone
    assert pack_weight(torch.randn(4, 4, dtype=torch.float16)) is None
    assert pack_weight(torch.randn(4, 4, dtype=torch.float64)) is None
    monkeypatch.setenv("KVFERRY_DISABLE_ONEDNN_PACKING", "1")
    assert pack_weight(torch.randn(4, 4)) is None
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    torch.testing.assert_close(linear(x, w, None, None), F.linear(x, w))


def test_packing_failure_falls_back(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no such op")

    monkeypatch.delenv("KVFERRY_DISABLE_ONEDNN_PACKING", raising=False)
    monkeypatch.setenv("KVFERRY_DISABLE_SMALL_GEMM", "1")  # oneDNN's packing alone
    monkeypatch.setattr(linear_mod, "_reorder", broken)
    assert pack_weight(torch.randn(4, 4)) is None


@needs_onednn
def test_model_packs_on_first_forward_and_after_reload(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFERRY_DISABLE_ONEDNN_PACKING", raising=False)
    path = make_tiny_checkpoint(tmp_path, "qwen2")  # has qkv bias
    loaded = load_model(str(path), dtype="float32")
    model = loaded.model
    assert not model.weights_packed
    attn = model.layers[0].self_attn
    shapes = (attn.qkv_proj.weight.shape, attn.o_proj.weight.shape)
    seq = list(range(3, 15))
    got = PagedHarness(model).step({0: seq}, {0: len(seq)})[0]
    assert model.weights_packed
    assert attn.qkv_proj.packed is not None and model.layers[0].mlp.down_proj.packed is not None
    assert model.logits_proj.packed is not None
    # Each packed weight is in memory once: its plain parameter is released.
    assert attn.qkv_proj.weight.numel() == 0 and attn.o_proj.weight.numel() == 0
    assert model.layers[0].mlp.gate_up_proj.weight.numel() == 0
    assert model.embed_tokens.numel() > 0  # the embedding table is read by every step
    with torch.no_grad():
        want = load_hf_model(path)(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # New weights invalidate the packed copies: the next forward repacks them.
    from kvferry.model.loader import iter_safetensors
    model.load_weights((n, t * 2 if n.endswith("o_proj.weight") else t) for n, t in iter_safetensors(path))
    assert not model.weights_packed
    assert (attn.qkv_proj.weight.shape, attn.o_proj.weight.shape) == shapes  # storage again, with the new weights
    changed = PagedHarness(model).step({0: seq}, {0: len(seq)})[0]
    assert model.weights_packed
    assert not torch.allclose(changed, got)


@needs_onednn
def test_disabled_packing_gives_same_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFERRY_DISABLE_SMALL_GEMM", "1")  # oneDNN's packing alone
    path = make_tiny_checkpoint(tmp_path, "llama")
    seq = list(range(3, 30))
    outs = []
    for disabled in ("1", "0"):
        monkeypatch.setenv("KVFERRY_DISABLE_ONEDNN_PACKING", disabled)
        model = load_model(str(path), dtype="float32").model
        outs.append(PagedHarness(model).step({0: seq}, {0: len(seq)})[0])
        assert (model.logits_proj.packed is None) == (disabled == "1")
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def test_prefill_attention_uses_fused_sdpa(tmp_path, monkeypatch):
    """3-D SDPA inputs fall to the unfused math kernel on CPU; ours must be 4-D.
    (Chunks over 16 tokens are sent to SDPA here, as chunks over 8192 are.)"""
    from kvferry.model import attention

    monkeypatch.setattr(attention, "_KERNEL_MAX_PREFILL_TOKENS", 16)
    path = make_tiny_checkpoint(tmp_path, "llama")
    model = load_model(str(path), dtype="float32").model
    harness = PagedHarness(model)
    seqs = {0: list(range(3, 40))}
    with profile() as prof:
        harness.step(seqs, {0: 20})  # no context: causal
        harness.step(seqs, {0: 17})  # 17 > the chunk limit: SDPA with a mask over cached context
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_matches_hf_formula(dtype):
    from kvferry.model.llama import RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5, dtype, "cpu")
    norm.weight.data.copy_(torch.randn(576, generator=gen))
    x = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    xf = x.float()
    want = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)  # HF's LlamaRMSNorm
    got = norm(x)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # at most one rounding step apart
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
