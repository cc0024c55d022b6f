"""write_kv into a float8_e5m2 cache (--kv-cache-dtype fp8_e5m2): every
element rounded bit for bit as ``tensor.to(torch.float8_e5m2)`` rounds it,
over every bf16 bit pattern and sweeps of float32 ones (ties, subnormals,
overflow, NaN), on the C++ op and on the torch path."""
from __future__ import annotations

import pytest
import torch

from kvferry.model import fused_ops

FP8 = torch.float8_e5m2


@pytest.fixture(scope="module")
def op():
    if not fused_ops.fused_ops_available():
        pytest.skip("the C++ fused ops are not available")
    return torch.ops.kvferry_fused.write_kv


def through_write_kv(op, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N] -> the fp8 bytes write_kv stores for it as K and (reversed) as V,
    in rows of 67 elements (a vector body and a scalar tail) at shuffled slots."""
    n, d = x.numel(), 67
    rows = torch.cat([x, torch.zeros((-n) % d, dtype=x.dtype)]).view(-1, 1, d)
    kc = torch.empty(rows.shape, dtype=FP8)
    vc = torch.empty(rows.shape, dtype=FP8)
    slots = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(0))
    op(rows, rows.flip(0).contiguous(), kc, vc, slots)
    return (kc.view(torch.uint8)[slots].reshape(-1)[:n],
            vc.view(torch.uint8)[slots].flip(0).reshape(-1)[:n])


def as_float32(bits: torch.Tensor) -> torch.Tensor:
    bits = torch.where(bits >= (1 << 31), bits - (1 << 32), bits)
    return bits.to(torch.int32).view(torch.float32)


def test_every_bf16_pattern_rounds_as_torch(op):
    x = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    want = x.to(FP8).view(torch.uint8)
    k, v = through_write_kv(op, x)
    assert torch.equal(k, want) and torch.equal(v, want)


def test_float32_ties_specials_and_sweeps_round_as_torch(op):
    g = torch.Generator().manual_seed(1)
    # Every sign, exponent and kept mantissa, with the dropped 21 bits at and around the tie.
    base = torch.arange(0, 1 << 11, dtype=torch.int64) << 21
    offsets = torch.tensor([0, 1, 2, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, (1 << 21) - 1, 1 << 13, (1 << 13) - 1])
    ties = as_float32((base[:, None] + offsets[None, :]).reshape(-1))
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 57344.0, 61439.996, 61440.0,
                            65504.0, -61440.0, 2.0 ** -16, 2.0 ** -17, 1.5 * 2.0 ** -17, 3 * 2.0 ** -17,
                            2.0 ** -14, 2.0 ** -14 - 2.0 ** -18, 1e-40, -1e-45, 1.125, 1.375, 1.1250001, 3.4e38])
    # The top 22 bits swept (every exponent and tie region), the low 10 random.
    sweep = as_float32((torch.arange(0, 1 << 22, dtype=torch.int64) << 10)
                       | torch.randint(0, 1 << 10, (1 << 22,), generator=g, dtype=torch.int64))
    x = torch.cat([special, ties, sweep, torch.randn(100_000, generator=g) * 1000])
    want = x.to(FP8).view(torch.uint8)
    k, v = through_write_kv(op, x)
    bad = (k != want).nonzero()
    assert bad.numel() == 0, (x[bad[:5, 0]], k[bad[:5, 0]], want[bad[:5, 0]])
    assert torch.equal(v, want)


@pytest.mark.parametrize("fused", [True, False])
def test_strided_qkv_slices_into_an_fp8_cache(fused, monkeypatch):
    if not fused:
        monkeypatch.setenv("KVFERRY_DISABLE_FUSED_OPS", "1")  # the torch path: index_copy_into
    elif not fused_ops.fused_ops_available():
        pytest.skip("the C++ fused ops are not available")
    qkv = torch.randn(37, 15 * 64).bfloat16()  # 9 query heads, 3 K, 3 V
    k, v = qkv[:, 9 * 64:12 * 64].view(37, 3, 64), qkv[:, 12 * 64:].view(37, 3, 64)
    kc, vc = torch.zeros(200, 3, 64, dtype=FP8), torch.zeros(200, 3, 64, dtype=FP8)
    slots = torch.randperm(200, generator=torch.Generator().manual_seed(2))[:37]
    fused_ops.write_kv(k, v, kc, vc, slots)
    want_k, want_v = torch.zeros(200, 3, 64, dtype=torch.uint8), torch.zeros(200, 3, 64, dtype=torch.uint8)
    want_k[slots], want_v[slots] = k.to(FP8).view(torch.uint8), v.to(FP8).view(torch.uint8)
    assert torch.equal(kc.view(torch.uint8), want_k) and torch.equal(vc.view(torch.uint8), want_v)


def test_fp8_rows_copy_and_mismatches_are_refused(op):
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
    assert torch.equal(kc.view(torch.uint8)[[9, 0, 3, 4, 7]], k.to(FP8).view(torch.uint8))
    with pytest.raises(RuntimeError, match="out of range"):
        op(k, v, kc, vc, torch.tensor([9, 0, 3, 4, 10]))
