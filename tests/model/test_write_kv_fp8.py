"""write_kv into fp8 caches (--kv-cache-dtype fp8_e5m2 / fp8_e4m3): every
element rounded bit for bit as ``tensor.to(torch.float8_e5m2)`` rounds it,
or for e4m3 as ``tensor.clamp(-448, 448).to(torch.float8_e4m3fn)`` does (a
saturating write: torch alone turns |x| >= 480 into NaN), over every bf16
bit pattern and sweeps of float32 ones (ties, subnormals, overflow, NaN), on
the C++ op and on the torch path."""
from __future__ import annotations

import pytest
import torch

from kvferry.model import fused_ops
from kvferry.model.kv_cache_dtype import to_cache_dtype

FORMATS = pytest.mark.parametrize("fp8", [torch.float8_e5m2, torch.float8_e4m3fn], ids=["e5m2", "e4m3"])


def reference(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """The bytes a cache of ``fp8`` must hold for x, from torch's own conversion."""
    if fp8 == torch.float8_e4m3fn:
        x = torch.where(x.isnan(), x, x.clamp(-448.0, 448.0))
    return x.to(fp8).view(torch.uint8)


@pytest.fixture(scope="module")
def op():
    if not fused_ops.fused_ops_available():
        pytest.skip("the C++ fused ops are not available")
    return torch.ops.kvferry_fused.write_kv


def through_write_kv(op, x: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N] -> the fp8 bytes write_kv stores for it as K and (reversed) as V,
    in rows of 67 elements (a vector body and a scalar tail) at shuffled slots."""
    n, d = x.numel(), 67
    rows = torch.cat([x, torch.zeros((-n) % d, dtype=x.dtype)]).view(-1, 1, d)
    kc = torch.empty(rows.shape, dtype=fp8)
    vc = torch.empty(rows.shape, dtype=fp8)
    slots = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(0))
    op(rows, rows.flip(0).contiguous(), kc, vc, slots)
    return (kc.view(torch.uint8)[slots].reshape(-1)[:n],
            vc.view(torch.uint8)[slots].flip(0).reshape(-1)[:n])


def as_float32(bits: torch.Tensor) -> torch.Tensor:
    bits = torch.where(bits >= (1 << 31), bits - (1 << 32), bits)
    return bits.to(torch.int32).view(torch.float32)


@FORMATS
def test_every_bf16_pattern_rounds_as_torch(op, fp8):
    x = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    want = reference(x, fp8)
    k, v = through_write_kv(op, x, fp8)
    assert torch.equal(k, want) and torch.equal(v, want)


@FORMATS
def test_float32_ties_specials_and_sweeps_round_as_torch(op, fp8):
    g = torch.Generator().manual_seed(1)
    # Every sign, exponent and kept mantissa, with the dropped bits (21 for e5m2, 20 for e4m3) at
    # and around the tie.
    drop = 21 if fp8 == torch.float8_e5m2 else 20
    base = torch.arange(0, 1 << (32 - drop), dtype=torch.int64) << drop
    half = 1 << (drop - 1)
    offsets = torch.tensor([0, 1, 2, half - 1, half, half + 1, (1 << drop) - 1, 1 << 13, (1 << 13) - 1])
    ties = as_float32((base[:, None] + offsets[None, :]).reshape(-1))
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 57344.0, 61439.996,
                            61440.0, 65504.0, -61440.0, 2.0 ** -16, 2.0 ** -17, 1.5 * 2.0 ** -17, 3 * 2.0 ** -17,
                            2.0 ** -14, 2.0 ** -14 - 2.0 ** -18, 1e-40, -1e-45, 1.125, 1.375, 1.1250001, 3.4e38,
                            # e4m3: the top normal, the saturation boundaries, its subnormal steps and ties
                            448.0, -448.0, 464.0, 464.00003, 479.99997, 480.0, -480.0, 1e6, 2.0 ** -6,
                            2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -9, 2.5 * 2.0 ** -9, 2.0 ** -6 - 2.0 ** -10,
                            1.0625, 1.1875, 1.0625001])
    # The top 22 bits swept (every exponent and tie region), the low 10 random.
    sweep = as_float32((torch.arange(0, 1 << 22, dtype=torch.int64) << 10)
                       | torch.randint(0, 1 << 10, (1 << 22,), generator=g, dtype=torch.int64))
    x = torch.cat([special, ties, sweep, torch.randn(100_000, generator=g) * 1000])
    want = reference(x, fp8)
    k, v = through_write_kv(op, x, fp8)
    bad = (k != want).nonzero()
    assert bad.numel() == 0, (x[bad[:5, 0]], k[bad[:5, 0]], want[bad[:5, 0]])
    assert torch.equal(v, want)


@FORMATS
@pytest.mark.parametrize("fused", [True, False])
def test_strided_qkv_slices_into_an_fp8_cache(fused, fp8, monkeypatch):
    if not fused:
        monkeypatch.setenv("KVFERRY_DISABLE_FUSED_OPS", "1")  # the torch path: index_copy_into
    elif not fused_ops.fused_ops_available():
        pytest.skip("the C++ fused ops are not available")
    qkv = (torch.randn(37, 15 * 64) * 200).bfloat16()  # 9 query heads, 3 K, 3 V; some past e4m3's 448
    k, v = qkv[:, 9 * 64:12 * 64].view(37, 3, 64), qkv[:, 12 * 64:].view(37, 3, 64)
    kc, vc = torch.zeros(200, 3, 64, dtype=fp8), torch.zeros(200, 3, 64, dtype=fp8)
    slots = torch.randperm(200, generator=torch.Generator().manual_seed(2))[:37]
    fused_ops.write_kv(k, v, kc, vc, slots)
    want_k, want_v = torch.zeros(200, 3, 64, dtype=torch.uint8), torch.zeros(200, 3, 64, dtype=torch.uint8)
    want_k[slots], want_v[slots] = reference(k, fp8), reference(v, fp8)
    assert torch.equal(to_cache_dtype(k, fp8).view(torch.uint8), reference(k, fp8))
    assert torch.equal(kc.view(torch.uint8), want_k) and torch.equal(vc.view(torch.uint8), want_v)


@FORMATS
def test_fp8_rows_copy_and_mismatches_are_refused(op, fp8):
    FP8 = fp8
    k, v = torch.randn(5, 3, 64), torch.randn(5, 3, 64)
    for kc_dtype, k_dtype, v_dtype, vc_dtype in [(FP8, torch.float16, torch.float16, FP8),
                                                 (FP8, torch.bfloat16, torch.float32, FP8),
                                                 (FP8, torch.float32, torch.float32, torch.bfloat16),
                                                 (torch.float32, torch.float32, torch.float32, FP8)]:
        with pytest.raises(RuntimeError, match="share one dtype"):
            op(k.to(k_dtype), v.to(v_dtype), torch.zeros(10, 3, 64, dtype=kc_dtype),
               torch.zeros(10, 3, 64, dtype=vc_dtype), torch.arange(5))
    kc, vc = torch.zeros(10, 3, 64, dtype=FP8), torch.zeros(10, 3, 64, dtype=FP8)
    op(k.to(FP8), v.to(FP8), kc, vc, torch.tensor([9, 0, 3, 4, 7]))  # fp8 rows: copied as they are
    other = torch.float8_e4m3fn if fp8 == torch.float8_e5m2 else torch.float8_e5m2
    with pytest.raises(RuntimeError, match="share one dtype"):  # the other format's cache for V
        op(k, v, torch.zeros(10, 3, 64, dtype=FP8), torch.zeros(10, 3, 64, dtype=other), torch.arange(5))
    assert torch.equal(kc.view(torch.uint8)[[9, 0, 3, 4, 7]], k.to(FP8).view(torch.uint8))
    with pytest.raises(RuntimeError, match="out of range"):
        op(k, v, kc, vc, torch.tensor([9, 0, 3, 4, 10]))
