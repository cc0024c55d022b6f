"""The fused C++ ops give torch's ops' results bit for bit (HF's roundings):
float32, bf16 and fp16, strided inputs as the model hands them over, vector
tails, empty batches; switched off they are those torch ops."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvferry.model import fused_ops
from kvferry.model.fused_ops import fused_ops_available, rms_norm, rope_neox, silu_and_mul

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

needs_ops = pytest.mark.skipif(not fused_ops_available(), reason="the C++ fused ops did not build here")


def torch_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def angles(tokens: int, half: int, dtype: torch.dtype):
    a = torch.randn(tokens, half) * 3
    return a.cos().to(dtype)[:, None, :], a.sin().to(dtype)[:, None, :]  # [T, 1, half], as RotaryEmbedding gives


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (32, 1536), (700, 256), (5, 37), (3, 20), (3, 50), (4, 1553)])
def test_silu_and_mul_is_torch_bit_for_bit(dtype, tokens, inter):
    torch.manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * inter) * 4).to(dtype)
    out = silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert out.is_contiguous() and out.shape == (tokens, inter)
    assert torch.equal(out, F.silu(gate) * up)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 12, 64), (40, 12, 64), (600, 4, 64), (5, 6, 16), (3, 4, 8),
                                                     (7, 3, 128)])
def test_rope_is_torch_bit_for_bit_on_strided_heads(dtype, tokens, heads, head_dim):
    torch.manual_seed(heads)
    qkv = torch.randn(tokens, heads + 3, head_dim).to(dtype)
    x = qkv[:, :heads]  # q (and k) heads inside the fused qkv output: strided rows
    cos, sin = angles(tokens, head_dim // 2, dtype)
    out = rope_neox(x, cos, sin)
    assert out.is_contiguous()
    assert torch.equal(out, torch_rope(x, cos, sin))


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,dim", [(1, 576), (32, 576), (2048, 576), (300, 960), (5, 37), (3, 8)])
def test_rms_norm_is_torch_bit_for_bit_on_strided_rows(dtype, tokens, dim):
    torch.manual_seed(dim)
    wide = (torch.randn(tokens, dim + 16) * 3).to(dtype)
    x = wide[:, 3:dim + 3]  # strided rows (a view into a wider activation)
    weight = (torch.randn(dim) * 0.5 + 1).to(dtype)
    out = rms_norm(x, weight, 1e-5)
    assert out.is_contiguous() and out.shape == (tokens, dim)
    assert torch.equal(out, weight * F.rms_norm(x, (dim,), None, 1e-5))
    # and HF's own spelling of it
    hf = weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(out, hf)


@needs_ops
def test_empty_batches():
    assert rms_norm(torch.empty(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    assert silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
    cos, sin = angles(0, 4, torch.float32)
    assert rope_neox(torch.empty(0, 2, 8), cos, sin).shape == (0, 2, 8)


def test_switched_off_they_are_the_torch_ops(monkeypatch):
    monkeypatch.setenv("KVFERRY_DISABLE_FUSED_OPS", "1")
    assert not fused_ops_available()
    gate_up = torch.randn(3, 10)
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate_up[:, :5]) * gate_up[:, 5:])
    x = torch.randn(3, 2, 8)
    cos, sin = angles(3, 4, torch.float32)
    assert torch.equal(rope_neox(x, cos, sin), torch_rope(x, cos, sin))
    h, w = torch.randn(3, 8), torch.randn(8)
    assert torch.equal(rms_norm(h, w, 1e-6), w * F.rms_norm(h, (8,), None, 1e-6))
    r = torch.randn(3, 8)
    nh, normed = fused_ops.add_rms_norm(h, r, w, 1e-6)
    assert torch.equal(nh, r + h) and torch.equal(normed, w * F.rms_norm(r + h, (8,), None, 1e-6))


@needs_ops
def test_bad_shapes_are_refused_not_crashing():
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        torch.ops.kvferry_fused.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="rope_neox"):
        torch.ops.kvferry_fused.rope_neox(torch.randn(2, 3, 8), torch.randn(2, 3), torch.randn(2, 4))


def test_build_flags_match_torchs_vector_level():
    flags = fused_ops._cflags()
    level = fused_ops._capability()
    assert f"-DCPU_CAPABILITY={level}" in flags and "-ffp-contract=off" in flags
    assert level in ("AVX512", "AVX2", "DEFAULT")


_AVX2_PROBE = """
import torch, torch.nn.functional as F
from kvferry.model import fused_ops
assert fused_ops._capability() in ("AVX2", "DEFAULT"), fused_ops._capability()
if not fused_ops.fused_ops_available():
    print("no build")
    raise SystemExit(0)
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    qkv = torch.randn(9, 7, 64).to(dtype)
    a = torch.randn(9, 32) * 3
    cos, sin = a.cos().to(dtype)[:, None, :], a.sin().to(dtype)[:, None, :]
    x1, x2 = qkv[:, :4].chunk(2, dim=-1)
    assert torch.equal(fused_ops.rope_neox(qkv[:, :4], cos, sin),
                       torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    gate_up = (torch.randn(9, 2 * 40) * 4).to(dtype)
    ref = F.silu(gate_up[:, :40]) * gate_up[:, 40:]
    # torch may dispatch a wider exp here than the AVX2 build's: equal to within an ulp
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), ref)
for dim in (8, 37, 64, 576, 1000, 4096):  # the row sums in at::sum's order (the AVX2 build's own vectors)
    x, w = torch.randn(33, dim) * 3, torch.randn(dim)
    assert torch.equal(fused_ops.rms_norm(x, w, 1e-6), w * F.rms_norm(x, (dim,), None, 1e-6)), dim
logits = torch.randn(5, 1003)
logits[1, 7] = logits[1, 900] = 50.0
logits[2, 500] = float("nan")
assert torch.equal(fused_ops.argmax_rows(logits), logits.argmax(dim=-1))
print("avx2 fused ops ok")
"""


def test_the_avx2_build_is_right_too():
    """The build an AVX2-only CPU gets (KVFERRY_KERNEL_ISA=avx2 on this one)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVFERRY_KERNEL_ISA": "avx2", "KVFERRY_DISABLE_CPP_KERNELS": "0"}
    env.pop("KVFERRY_DISABLE_FUSED_OPS", None)
    done = subprocess.run([sys.executable, "-c", _AVX2_PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    if "no build" in done.stdout:
        pytest.skip("the C++ fused ops did not build here")
    assert "avx2 fused ops ok" in done.stdout


def _edge_values(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Values where rounding to bf16 / fp16 is decided: halfway cases (both
    parities of the kept bit), the largest finite ones, values whose rounding
    overflows to inf, subnormals, zeros of both signs, infinities, NaN."""
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 3e38, -3e38,
                            1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, 65504.0, 1e-7, 88.0, -88.0, -104.0])
    x = torch.randn(n) * 4
    x[: special.numel()] = special
    return x if dtype == torch.float32 else x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_values_round_as_torch(dtype):
    """Each op's roundings on the values where they matter, NaN and inf included."""
    torch.manual_seed(1)
    gate_up = torch.stack([_edge_values(2 * 64, dtype), _edge_values(2 * 64, dtype).flip(0)])
    _same(silu_and_mul(gate_up), F.silu(gate_up[:, :64]) * gate_up[:, 64:])
    x = _edge_values(4 * 3 * 64, dtype).view(4, 3, 64)
    cos, sin = angles(4, 32, dtype)
    _same(rope_neox(x, cos, sin), torch_rope(x, cos, sin))
    h = _edge_values(3 * 64, dtype).view(3, 64)
    h[1] = h[1].nan_to_num(0.0, 0.0, 0.0)  # a row with finite values only: the others normalize to NaN
    weight = (torch.randn(64) * 0.5 + 1).to(dtype)
    _same(rms_norm(h, weight, 1e-5), weight * F.rms_norm(h, (64,), None, 1e-5))


@needs_ops
@pytest.mark.parametrize("dims", [range(1, 160), [191, 255, 256, 257, 576, 960, 1023, 1024, 1536, 2048, 2049, 3072,
                                                  4096, 5120, 8192, 16384, 16385, 20000]])
def test_rms_norm_mean_is_torchs_summation_order_for_every_dim(dims):
    """The norms sum the squares in at::sum's order themselves (csrc/fused_ops.cpp):
    every vector tail, cascade level and fallback width, in float32, where no
    rounding after the norm hides a mean that is one ulp off, over rows of
    very different scales."""
    torch.manual_seed(0)
    for dim in dims:
        for rows in (1, 7, 64):
            x = torch.randn(rows, dim) * torch.rand(rows, 1) * 10
            w = torch.randn(dim) * 0.5 + 1
            assert torch.equal(rms_norm(x, w, 1e-6), w * F.rms_norm(x, (dim,), None, 1e-6)), (dim, rows)
            r = torch.randn(rows, dim) * 3
            _, out = fused_ops.add_rms_norm(x, r, w, 1e-6)
            assert torch.equal(out, w * F.rms_norm(r + x, (dim,), None, 1e-6)), (dim, rows)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,dim", [(1, 576), (32, 576), (2048, 576), (5, 37)])
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(dtype, tokens, dim):
    torch.manual_seed(tokens + dim)
    wide = (torch.randn(tokens, dim + 8) * 3).to(dtype)
    x = wide[:, 8:]  # strided rows, as an o_proj / down_proj output slice could be
    residual = (torch.randn(tokens, dim) * 5).to(dtype)
    weight = (torch.randn(dim) * 0.5 + 1).to(dtype)
    h, out = fused_ops.add_rms_norm(x, residual, weight, 1e-5)
    ref_h = residual + x  # HF: hidden_states = residual + hidden_states
    assert torch.equal(h, ref_h)
    assert torch.equal(out, weight * F.rms_norm(ref_h, (dim,), None, 1e-5))
    e = _edge_values(2 * 64, dtype).view(2, 64)
    w64 = (torch.randn(64) * 0.5 + 1).to(dtype)
    eh, eo = fused_ops.add_rms_norm(e, e.flip(1), w64, 1e-5)
    _same(eh, e.flip(1) + e)
    _same(eo, w64 * F.rms_norm(e.flip(1) + e, (64,), None, 1e-5))


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_puts_each_row_in_its_slot(dtype):
    """The step's K/V rows (slices of the fused qkv, as the layer hands them
    over) land in exactly their slots; the others are left as they were."""
    torch.manual_seed(3)
    tokens, kvh, d, num_slots = 37, 3, 64, 200
    qkv = torch.randn(tokens, (9 + 2 * kvh) * d).to(dtype)
    k = qkv[:, 9 * d:(9 + kvh) * d].view(tokens, kvh, d)
    v = qkv[:, (9 + kvh) * d:].view(tokens, kvh, d)
    k_cache = torch.randn(num_slots, kvh, d).to(dtype)
    v_cache = torch.randn(num_slots, kvh, d).to(dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_slots)[:tokens]
    fused_ops.write_kv(k, v, k_cache, v_cache, slots)
    ref_k.index_copy_(0, slots, k)
    ref_v.index_copy_(0, slots, v)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.kvferry_fused.write_kv(k, v, k_cache, v_cache, slots + num_slots)
    assert torch.equal(k_cache, ref_k)  # refused before anything was written


@needs_ops
@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 31, 32, 33, 100, 1003, 49152])
def test_argmax_rows_is_torchs_argmax(n):
    """The same index as torch.argmax: first of equal maxima, the first NaN
    where a row has one, -inf rows, signed zeros, vector and tail positions."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(12, n, generator=gen)
    if n > 1:
        x[1, :] = 2.0  # all equal: index 0
        x[2, n // 2] = x[2, n - 1] = 99.0  # tie: the first
        x[3, n - 1] = float("nan")  # NaN in the tail
        x[4, n // 3] = float("nan")
        x[4, n - 1] = float("nan")  # two NaNs: the first
        x[4, 0] = 1e30
        x[5, :] = float("-inf")
        x[6, :] = 0.0
        x[6, n // 2] = -0.0  # -0 == 0: still index 0
        x[7, n - 1] = float("inf")
        x[8, 0] = float("nan")
    want = x.argmax(dim=-1)
    assert torch.equal(fused_ops.argmax_rows(x), want)
    # Strided rows (a row slice of a wider tensor), a single row and float64 (torch's path).
    wide = torch.randn(3, n + 8, generator=gen)
    assert torch.equal(fused_ops.argmax_rows(wide[:, :n]), wide[:, :n].argmax(dim=-1))
    assert torch.equal(fused_ops.argmax_rows(x[:1]), want[:1])
    assert torch.equal(fused_ops.argmax_rows(x.double()), want)
