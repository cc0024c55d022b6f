"""The integer dots at prefill sizes (csrc/quant_prefill_dots.h) and their
routing: a row's value does not depend on the batch it is in nor on the
thread count, it is the decode kernels' to float32 rounding (the same 8-bit
x, the same integers per block), and on a CPU without AMX whose build has
them (AVX512-VNNI) every batch takes the dots, never the bf16 tiles."""
from __future__ import annotations

import pytest
import torch

from kvferry.model import quant
from kvferry.model.quant import kernels
from tests.model.quant.blocks import weight

pytestmark = pytest.mark.skipif(not quant.available(), reason="the C++ quantized matmul did not build here")

TYPES = list(quant.FORMATS)


def has_prefill_dots() -> bool:
    return bool(torch.ops.kvferry_quant.prefill_dots(12))


@pytest.mark.parametrize("name", TYPES)
def test_a_rows_prefill_value_is_the_same_in_every_batch(name):
    """45 weight rows: two panels of 16 and a tail of 13; 2 and 1 threads
    split them differently. From prefill_dots_from's rows (passes of 6 rows
    and their tails) each row's value is the 300-row batch's to the bit, and
    the decode kernels' to float32 rounding (one float sum per output here, 8
    lanes summed at the end there)."""
    if not has_prefill_dots():
        pytest.skip("this build has no prefill dots (AVX512-VNNI only)")
    w, _ = weight(name, 45, 2048, seed=7)
    x = torch.randn(300, 2048, generator=torch.Generator().manual_seed(3))
    first = kernels.prefill_dots_from(w.fmt.block)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = quant.gemv(x, w)
        for m in (first, first + 1, first + 5, 64, 97, 257):
            assert torch.equal(quant.gemv(x[:m], w), full[:m]), m
            assert torch.equal(quant.gemv(x[300 - m:], w), full[300 - m:]), m
        torch.set_num_threads(1)
        assert torch.equal(quant.gemv(x, w), full)
    finally:
        torch.set_num_threads(before)
    few = torch.cat([quant.gemv(x[r:r + 2], w)[:1] for r in range(0, 300, 23)])  # the decode kernels
    scale = (x[::23].abs() @ quant.dequantize_rows(w).abs().T).amax(dim=1, keepdim=True)
    assert ((full[::23] - few).abs() <= 1e-5 * scale).all()
    # Below prefill_dots_from: rowsK_512's or rows32_512's passes, batch 1's to the bit.
    alone = torch.cat([quant.gemv(x[r:r + 1], w) for r in range(first - 1)])
    assert torch.equal(quant.gemv(x[:first - 1], w), alone)


@pytest.mark.parametrize("name", TYPES)
def test_a_c16_decode_step_takes_the_panels(name):
    """Where the prefill dots fit (AVX512-VNNI, no AMX), a decode step of 16
    rows (c16), and of 12, takes them (every type; the 32-blocks from 6 rows:
    measured faster than the decode kernels on Zen 4, quant/kernels.py), so
    its rows are a prefill batch's to the bit, at 1 and 2 threads; on AMD
    Zen 5 the K-quants from 18 rows (their decode kernels on the packed
    panels lead there), so a c16 step keeps batch 1's bits. Below, the
    decode kernels: batch 1's bits."""
    from kvferry.model.cpu_features import cpu_features

    if not kernels.prefill_dots_fit():
        pytest.skip("the prefill dots do not fit this CPU or build")
    w, _ = weight(name, 45, 2048, seed=11)
    x = torch.randn(64, 2048, generator=torch.Generator().manual_seed(16))
    k_from = 18 if cpu_features().amd_zen5_or_later else 12
    assert kernels.prefill_dots_from(w.fmt.block) == (6 if w.fmt.block == 32 else k_from)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = quant.gemv(x, w)
            for m in (k_from, k_from + 4) if w.fmt.block == 256 else (6, 8, 16):
                assert torch.equal(quant.gemv(x[:m], w), full[:m]), (threads, m)
            below = kernels.prefill_dots_from(w.fmt.block) - 1
            alone = torch.cat([quant.gemv(x[r:r + 1], w) for r in range(below)])
            assert torch.equal(quant.gemv(x[:below], w), alone), threads
    finally:
        torch.set_num_threads(before)


def test_the_k_quants_first_prefill_row_follows_the_cpu():
    """AMD Zen 5 and later: the K-quants' prefill kernels from 18 rows; Zen 4
    and other CPUs from 12; the 32-blocks from 6 everywhere. This CPU's at import."""
    from kvferry.model.cpu_features import CpuFeatures, cpu_features

    def cpu(vendor: str, family: int) -> CpuFeatures:
        return CpuFeatures(flags=frozenset(), torch_capability="AVX512", model_name="", vendor=vendor, family=family)

    assert kernels.prefill_dots_from_rows(cpu("AuthenticAMD", 26)) == {32: 6, 256: 18}
    assert kernels.prefill_dots_from_rows(cpu("AuthenticAMD", 25)) == {32: 6, 256: 12}
    assert kernels.prefill_dots_from_rows(cpu("GenuineIntel", 6)) == {32: 6, 256: 12}
    assert kernels.PREFILL_DOTS_FROM_ROWS == kernels.prefill_dots_from_rows(cpu_features())


def test_k_quants_take_the_dots_at_every_batch_size_without_amx(monkeypatch):
    """Where the prefill dots fit (this build has them and the CPU no AMX),
    batches of any size take the integer dots at any thread count, in linear
    and in the one-call layer's configured path: the dots' values.
    PREFILL_DOTS = False (an AMX CPU's routing) gives the tiles from 20 rows
    of K-quants and the 32-blocks' threshold (12 with AMX, 25 without) again."""
    wk, _ = weight("Q4_K", 67, 512)
    w32, _ = weight("Q8_0", 67, 512)
    fits = kernels.prefill_dots_fit()
    m32 = kernels.PREFILL_MIN_ROWS[32]
    expect = "dots" if fits else "tiles"
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(64)).bfloat16()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert [kernels.path_for(m, wk) for m in (19, 20, 64, 512, 2048)] == ["dots"] + [expect] * 4, threads
            assert [kernels.path_for(m, w32) for m in (m32 - 1, m32, 512)] == ["dots", expect, expect], threads
            if fits:
                for w in (wk, w32):
                    dots = quant.gemv(x, w).bfloat16()
                    assert torch.equal(quant.linear(x, w), dots)
                    assert torch.equal(torch.ops.kvferry_quant.layer_linear(x, w.data, w.fmt.ggml_type, 67), dots)
                    assert torch.equal(quant.linear_parts(x, [w, wk]), torch.cat([dots, quant.gemv(x, wk).bfloat16()], 1))
        monkeypatch.setattr(kernels, "PREFILL_DOTS", False)
        kernels.configure()
        assert [kernels.path_for(m, wk) for m in (19, 20, 512)] == ["dots", "tiles", "tiles"]
        assert [kernels.path_for(m, w32) for m in (m32 - 1, m32, 512)] == ["dots", "tiles", "tiles"]
        assert not torch.equal(quant.linear(x, wk), quant.gemv(x, wk).bfloat16())
    finally:
        torch.set_num_threads(before)
        monkeypatch.undo()
        kernels.configure()

