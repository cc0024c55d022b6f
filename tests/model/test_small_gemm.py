"""The small-batch matmuls (model/small_gemm.py, csrc/small_gemm.cpp): bf16
results within one rounding of a float32 reference, float32 results within
summation-order noise of a float64 one, exact on small integers at every row
count (decode batches and prefill chunks, which run in passes of rows), and
linear() routing every row count of a packed weight to them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvferry.model import small_gemm
from kvferry.model.linear import linear, pack_weight
from kvferry.model.loader import load_model
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import load_hf_model, make_tiny_checkpoint

needs_kernel = pytest.mark.skipif(not small_gemm.available(torch.bfloat16),
                                  reason="the bf16 small-batch matmul needs AVX512-BF16 without AMX and a compiler")
needs_f32 = pytest.mark.skipif(not small_gemm.available(torch.float32),
                               reason="the float32 small-batch matmul needs AVX2+FMA or AVX-512 and a compiler")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 sums of the bf16 products, rounded once to bf16."""
    return (x.float() @ w.float().T).to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("n,k", [(16, 32), (96, 64), (960, 576), (576, 1536), (3072, 576), (100, 7), (65, 577), (1, 64)])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 32, 64])
def test_matches_float32_reference(n, k, rows):
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    packed = small_gemm.pack(w)
    assert packed is not None
    got = small_gemm.linear(x, packed, n)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    want = _reference(x, w)
    # Summation order differs from the reference: at most a rounding step of the output apart.
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert (got == want).float().mean() > 0.9


@needs_kernel
@pytest.mark.parametrize("rows", [1, 6, 7, 9, 300])
def test_linear_prefetch_is_linear_to_the_bit(rows):
    """linear_prefetch only changes which software prefetch runs (moe_experts.cpp
    picks it by rows on Zen 4): every choice gives linear's bits; a bad one raises."""
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(200, 2 * 96 + 1, generator=gen) * 0.05).to(torch.bfloat16)  # 5 blocks, odd K
    x = torch.randn(rows, w.shape[1], generator=gen).to(torch.bfloat16)
    packed = small_gemm.pack(w)
    want = small_gemm.linear(x, packed, 200)
    for prefetch in (0, 1, 2, 3):
        assert torch.equal(torch.ops.kvferry_gemm.linear_prefetch(x, packed, 200, prefetch), want), prefetch
    with pytest.raises(RuntimeError, match="prefetch must be 0"):
        torch.ops.kvferry_gemm.linear_prefetch(x, packed, 200, 4)


@needs_kernel
@pytest.mark.parametrize("rows", [5, 6, 8, 9, 10])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_pass_kernel_is_the_row_blocks_to_the_bit(rows, threads):
    """linear_rows' one_pass runs 5-10 rows as one register block (each
    weight line loaded once for every row; linear takes it at 9-10 rows, the
    experts at 9-10 on Zen 4): the bits of register blocks of up to 8 rows
    (9-10 rows: two blocks) at every prefetch, odd K and N tails included,
    for strided and repeated (stride 0) rows; within a rounding of the float
    reference; exact on small integers."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    lr = torch.ops.kvferry_gemm.linear_rows
    try:
        for n, k in [(200, 193), (2048, 1024), (48, 64), (1, 7)]:
            gen = torch.Generator().manual_seed(n + k + rows)
            w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
            packed = small_gemm.pack(w)
            wide = torch.randn(rows, k + 3, generator=gen).to(torch.bfloat16)
            for x in (wide[:, :k].contiguous(), wide[:, 3:], wide[:1, :k].expand(rows, k)):
                blocks = lr(x, packed, n, 0, 0)
                for prefetch in (0, 1, 2, 3):
                    assert torch.equal(lr(x, packed, n, prefetch, 1), blocks), (n, k, prefetch, x.stride())
                assert torch.equal(small_gemm.linear(x, packed, n), blocks)
                torch.testing.assert_close(blocks.float(), _reference(x, w).float(), atol=1e-2, rtol=1e-2)
            xi = torch.randint(-3, 4, (rows, k), generator=gen).to(torch.bfloat16)
            wi = torch.randint(-3, 4, (n, k), generator=gen).to(torch.bfloat16)
            got = lr(xi, small_gemm.pack(wi), n, 3, 1)
            assert torch.equal(got, (xi.float() @ wi.float().T).to(torch.bfloat16)), (n, k)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("rows", [7, 8, 9])
@pytest.mark.parametrize("threads", [1, 2])
def test_in_stream_prefetch_near_the_weights_end(rows, threads):
    """Mode 3 prefetches the stream 128 lines ahead of its loads; a weight
    shorter than that (one block, and a K whose block is under 128 lines)
    clamps it to the copy's end: linear's bits, on one thread or with the
    blocks split between two."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in [(48, 64), (100, 85), (2048, 1024)]:
            gen = torch.Generator().manual_seed(n + k + rows)
            w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            packed = small_gemm.pack(w)
            got = torch.ops.kvferry_gemm.linear_prefetch(x, packed, n, 3)
            assert torch.equal(got, small_gemm.linear(x, packed, n)), (n, k)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_exact_on_integers():
    """Small integers multiply and add exactly in float32: the result is exact,
    whatever the summation order, so a layout or tail bug cannot hide in tolerance."""
    gen = torch.Generator().manual_seed(0)
    for n, k, rows in [(48, 96, 5), (3072, 576, 33), (3000, 575, 64), (49152, 576, 9)]:
        w = torch.randint(-3, 4, (n, k), generator=gen).to(torch.bfloat16)
        x = torch.randint(-3, 4, (rows, k), generator=gen).to(torch.bfloat16)
        got = small_gemm.linear(x, small_gemm.pack(w), n)
        assert torch.equal(got, _reference(x, w))


@needs_kernel
def test_strided_rows_and_inputs_it_declines():
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 64, generator=gen) * 0.05).to(torch.bfloat16)
    wide = torch.randn(8, 128, generator=gen).to(torch.bfloat16)
    packed = pack_weight(w)
    assert packed is not None and packed.small is not None
    torch.testing.assert_close(linear(wide[:, ::2], w, None, packed).float(), _reference(wide[:, ::2], w).float(),
                               atol=1e-2, rtol=1e-2)
    # A repeated row (stride 0) and no rows at all.
    row = torch.randn(1, 64, generator=gen).to(torch.bfloat16).expand(5, 64)
    assert torch.equal(small_gemm.linear(row, packed.small, 64), small_gemm.linear(row.contiguous(), packed.small, 64))
    assert small_gemm.linear(wide[:0, :64], packed.small, 64).shape == (0, 64)
    # Other dtypes get no small copy; a wrong n or K is refused with an error.
    assert small_gemm.pack(torch.randn(64, 64).half()) is None
    with pytest.raises(RuntimeError):
        small_gemm.linear(wide[:, :64], packed.small, 200)
    with pytest.raises(RuntimeError):
        small_gemm.linear(wide[:, :96].contiguous(), packed.small, 64)


@needs_kernel
def test_linear_routes_by_row_count(monkeypatch):
    """Where the kernel applies, a packed weight has only the small copy and
    every row count takes it (a 2048-row prefill chunk too); a bias goes to
    oneDNN; with KVFERRY_DISABLE_SMALL_GEMM=1 no small copy is made."""
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(256, 128, generator=gen) * 0.05).to(torch.bfloat16)
    packed = pack_weight(w)
    assert packed is not None and packed.small is not None and packed.onednn is None
    for rows in (1, 64, 65, 300, 2048):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
        got = linear(x, torch.empty(0), None, packed)  # the plain weight is never read
        assert torch.equal(got, small_gemm.linear(x, packed.small, 256))
        torch.testing.assert_close(got.float(), _reference(x, w).float(), atol=1e-2, rtol=1e-2)
    assert linear(x[:0], torch.empty(0), None, packed).shape == (0, 256)
    b = torch.randn(256, generator=gen).to(torch.bfloat16)
    biased = pack_weight(w, b)
    assert biased is not None and biased.small is None and biased.onednn is not None
    monkeypatch.setenv("KVFERRY_DISABLE_SMALL_GEMM", "1")
    assert not small_gemm.available(torch.bfloat16) and not small_gemm.available(torch.float32)
    off = pack_weight(w)
    assert off is not None and off.small is None
    torch.testing.assert_close(linear(x, w, None, off).float(), F.linear(x, w).float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,rows", [(96, 576, 700), (576, 1536, 150), (100, 577, 1000), (48, 7, 3000)])
def test_passes_over_rows_exact_on_integers(dtype, n, k, rows):
    """A prefill-sized M runs in passes of rows (csrc rows_per_pass: ~384 KB
    of x each, so 3 passes of K = 576 bf16 at 700 rows, 3 of K = 1536 float32
    at 150): every pass's rows, the last pass's short one included, are exact."""
    if not small_gemm.available(dtype):
        pytest.skip(f"no small-batch matmul for {dtype} on this CPU")
    gen = torch.Generator().manual_seed(rows + k)
    w = torch.randint(-3, 4, (n, k), generator=gen).to(dtype)
    x = torch.randint(-3, 4, (rows, k), generator=gen).to(dtype)
    want = (x.float() @ w.float().T).to(dtype)
    assert torch.equal(small_gemm.linear(x, small_gemm.pack(w), n), want)
    # Strided rows of a wider tensor take the same passes.
    wide = torch.zeros(rows, k + 5, dtype=dtype)
    wide[:, :k] = x
    assert torch.equal(small_gemm.linear(wide[:, :k], small_gemm.pack(w), n), want)


@needs_kernel
def test_bf16_model_with_small_gemm_matches_hf(tmp_path):
    """A bf16 tiny model's decode steps (a few rows) run through the kernel and
    stay within bf16 noise of HF's logits."""
    path = make_tiny_checkpoint(tmp_path, "llama")
    model = load_model(str(path), dtype="bfloat16").model
    seq = list(range(3, 20))
    harness = PagedHarness(model)
    got = harness.step({0: seq, 1: seq[:7]}, {0: len(seq), 1: 7})
    assert model.layers[0].mlp.gate_up_proj.packed.small is not None
    hf = load_hf_model(path).to(torch.bfloat16)
    with torch.no_grad():
        want = hf(torch.tensor([seq])).logits[0].float()
    torch.testing.assert_close(got[0].float(), want, atol=5e-2, rtol=5e-2)


@needs_f32
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (3072, 576), (100, 7), (65, 577), (1, 64)])
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 17, 32, 33, 64])
def test_float32_matches_float64_reference(n, k, rows):
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen)
    packed = small_gemm.pack(w)
    assert packed is not None and packed.dtype == torch.float32
    got = small_gemm.linear(x, packed, n)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, (x.double() @ w.double().T).float(), atol=1e-4, rtol=1e-4)


@needs_f32
def test_float32_exact_on_integers_and_routed_by_linear():
    gen = torch.Generator().manual_seed(3)
    for n, k, rows in [(48, 96, 5), (3072, 576, 33), (3000, 575, 64), (49152, 576, 9)]:
        w = torch.randint(-3, 4, (n, k), generator=gen).float()
        x = torch.randint(-3, 4, (rows, k), generator=gen).float()
        packed = pack_weight(w)
        assert packed is not None and packed.small is not None
        want = x @ w.T
        assert torch.equal(small_gemm.linear(x, packed.small, n), want)
        assert torch.equal(linear(x, w, None, packed), want)
    # Strided rows; a bias packed with its weight goes to oneDNN (F.linear's
    # fused add); one passed to a small copy is added after it.
    wide = torch.randn(8, 128, generator=gen)
    w = torch.randn(64, 64, generator=gen) * 0.05
    b = torch.randn(64, generator=gen)
    packed = pack_weight(w)
    torch.testing.assert_close(linear(wide[:, ::2], w, None, packed), F.linear(wide[:, ::2], w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear(wide[:, :64], w, b, packed), F.linear(wide[:, :64], w, b), atol=1e-5, rtol=1e-5)
    biased = pack_weight(w, b)
    assert biased is not None and biased.small is None
    torch.testing.assert_close(linear(wide[:, :64], w, b, biased), F.linear(wide[:, :64], w, b), atol=1e-5, rtol=1e-5)
