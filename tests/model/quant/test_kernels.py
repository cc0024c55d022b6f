"""The quantized matmul against gguf's float dequantization, for every block type.

Two checks per case:

* exact kernel: against (x rounded to 8 bits per block as the kernel does)
  @ W_ref^T, to float32 summation error (rel. 1e-4 of the row's scale);
* the bound the 8-bit activations allow: against the float x @ W_ref^T,
  |y - y_ref| <= sum_k |W[n, k]| * d_k / 2, where d_k / 2 is the largest
  rounding error of x's element k (its block's max|x| / 254). That is the
  worst case of rounding x; the weights' own error is not in it, since the
  reference is the dequantized weight itself.
"""
from __future__ import annotations

import pytest
import torch

from kvferry import envs
from kvferry.model import quant
from kvferry.model.cpu_features import cpu_features
from kvferry.model.quant import kernels
from tests.model.quant.blocks import ggml_q8_0, quantized_x, weight

pytestmark = pytest.mark.skipif(not quant.available(), reason="the C++ quantized matmul did not build here")

TYPES = list(quant.FORMATS)
K, N = 512, 67  # two K-superblocks, sixteen 32-blocks; odd N


def check(y: torch.Tensor, x: torch.Tensor, w: quant.QuantizedWeight, ref: torch.Tensor, exact: bool = True) -> None:
    xq, half_step = quantized_x(x, w.fmt.block)
    scale = (x.abs() @ ref.abs().T).amax(dim=1, keepdim=True)  # a row's largest |terms| sum
    if exact:
        assert ((y - xq @ ref.T).abs() <= 1e-4 * scale).all(), (y - xq @ ref.T).abs().max()
    bound = half_step @ ref.abs().T + 1e-4 * scale
    assert ((y - x @ ref.T).abs() <= bound).all(), ((y - x @ ref.T).abs() / bound).max()


@pytest.fixture(scope="module", params=TYPES)
def typed(request):
    return weight(request.param, N, K)


def test_dequantize_is_ggufs(typed):
    w, ref = typed
    assert torch.equal(quant.dequantize_rows(w), ref)
    assert torch.equal(quant.dequantize_rows(w, 5, 9), ref[5:9])
    assert torch.equal(quant.dequantize_rows(w, dtype=torch.bfloat16), ref.bfloat16())


@pytest.mark.parametrize("m", [1, 3, 16, 32, 200])
def test_gemv(typed, m):
    w, ref = typed
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    check(quant.gemv(x, w), x, w, ref)


BLOCK32 = [n for n in TYPES if quant.block_format(n).block == 32]


@pytest.mark.parametrize("name", BLOCK32)
def test_decode_row_with_a_tail_of_blocks(name):
    """Batch 1 over 32-blocks takes eight blocks and four weight rows at a time:
    K = 576 is two groups of 8 blocks and a tail of 2; 37 rows, passes of 4
    and a tail. linear writes x's dtype directly: the float32 result rounded once."""
    w, ref = weight(name, 37, 576)
    for x in (torch.randn(1, 576), torch.randn(1, 576).bfloat16()):
        y = quant.gemv(x, w)
        check(y, x.float(), w, ref)
        assert torch.equal(quant.linear(x, w), y.to(x.dtype))


def test_prefill_and_linear(typed, monkeypatch):
    w, ref = typed
    x = torch.randn(200, K)
    monkeypatch.setattr(kernels, "PREFILL_TILE_BYTES", 16 * K * 4)  # tiles of 16 rows: 4 and a tail of 3
    y = quant.prefill(x, w, torch.float32)
    torch.testing.assert_close(y, x @ ref.T, rtol=1e-4, atol=1e-4)
    # bf16 tiles: x and W each rounded to 8 bits of mantissa
    torch.testing.assert_close(quant.prefill(x, w), x.bfloat16().float() @ ref.bfloat16().float().T,
                               rtol=2e-2, atol=2e-2 * (x.abs() @ ref.abs().T).max().item() / 64)
    assert quant.linear(x[:5], w).dtype == torch.float32
    assert quant.linear(x[:5].bfloat16(), w).dtype == torch.bfloat16
    check(quant.linear(x[:5], w), x[:5], w, ref)


def test_bf16_x_and_path():
    w, ref = weight("Q4_K", N, K)
    x = torch.randn(3, K).bfloat16()
    check(quant.gemv(x, w), x.float(), w, ref)
    assert quant.kernel_path() in ("avx512vnni", "avxvnni", "avx2")


def massive_x(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows with a few massive activations (10^3x the rest), as SmolLM2's ffn_down
    inputs carry, where any other rounding than llama.cpp's moves greedy answers."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.where(torch.rand(m, k, generator=g) < 0.01, 1000.0, 1.0)


def test_q8_0_is_llama_cpps_arithmetic_to_the_bit(monkeypatch):
    """Q8_0 is ggml's CPU arithmetic to the bit (blocks.ggml_q8_0), at batch 1
    (eight-block groups with a tail of blocks and of rows) and the decode
    kernels' other row counts (below kernels.prefill_dots_from: 5 rows where
    the prefill dots fit, 32 elsewhere; every count with
    KVFERRY_QUANT_DOTS_ALWAYS=1): what greedy agreement with llama.cpp on a
    Q8_0 file needs (tests/model/test_gguf_llama_cpp.py)."""
    def check_rows(rows):
        for n, k in ((37, 576), (N, K)):
            w, _ = weight("Q8_0", n, k)
            for m in rows:
                x = massive_x(m, k, seed=m)
                assert torch.equal(quant.gemv(x, w), ggml_q8_0(x, w)), (n, k, m)
    check_rows([m for m in (1, 3, 5, 9) if m < kernels.prefill_dots_from(32)])
    try:
        monkeypatch.setenv(envs.QUANT_DOTS_ALWAYS, "1")
        kernels.configure()
        check_rows((1, 3, 9))
    finally:
        monkeypatch.delenv(envs.QUANT_DOTS_ALWAYS)
        kernels.configure()


def test_dots_always_is_llama_cpps_arithmetic_at_prefill(monkeypatch):
    """KVFERRY_QUANT_DOTS_ALWAYS=1: a prefill-sized batch takes the dots too
    (the decode kernels, llama.cpp's Q8_0 arithmetic to the bit, never the
    prefill dots), in linear and in the library's configured path (the
    one-call layer's); unset, the tiles again (the prefill dots on a CPU
    where they fit: test_prefill_dots.py)."""
    w, _ = weight("Q8_0", 37, 576)
    x = massive_x(40, 576)
    try:
        monkeypatch.setenv(envs.QUANT_DOTS_ALWAYS, "1")
        kernels.configure()
        assert kernels.path_for(x.shape[0], w) == "dots"
        assert torch.equal(quant.linear(x, w), ggml_q8_0(x, w))
        assert torch.equal(quant.linear_parts(x, [w, w]), torch.cat([ggml_q8_0(x, w)] * 2, dim=1))
    finally:
        monkeypatch.delenv(envs.QUANT_DOTS_ALWAYS)
        kernels.configure()
    assert kernels.path_for(x.shape[0], w) == ("dots" if kernels.prefill_dots_fit() else "tiles")
    assert not torch.equal(quant.linear(x, w), ggml_q8_0(x, w))


def test_k_quants_take_the_dots_below_20_rows(monkeypatch):
    """K-quant batches below 20 rows (a c16 decode step's 16) take the integer
    dots, at any thread count, in linear and in the library's configured path
    (the one-call layer's): the dots' values, not the bf16 tiles'. From 20 rows
    the tiles where the K-quants' prefill dots are off (an AMX CPU's routing;
    test_prefill_dots.py has the other); the 32-blocks from their own
    threshold (below)."""
    wk, _ = weight("Q4_K", N, K)
    w32, _ = weight("Q8_0", N, K)
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(19)).bfloat16()
    before = torch.get_num_threads()
    monkeypatch.setattr(kernels, "PREFILL_DOTS", False)
    kernels.configure()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert [kernels.path_for(m, wk) for m in (16, 19, 20)] == ["dots", "dots", "tiles"], threads
            m32 = kernels.PREFILL_MIN_ROWS[32]
            assert [kernels.path_for(m, w32) for m in (m32 - 1, m32)] == ["dots", "tiles"], threads
            for m in (16, 19):
                dots = quant.gemv(x[:m], wk).bfloat16()
                assert torch.equal(quant.linear(x[:m], wk), dots), (threads, m)
                assert torch.equal(torch.ops.kvferry_quant.layer_linear(x[:m], wk.data, wk.fmt.ggml_type, N), dots)
        tiles = quant.linear(torch.cat([x, x[:1]]), wk)[:19]  # 20 rows: x rounded to bf16, not to 8 bits
        assert not torch.equal(tiles, quant.gemv(x, wk).bfloat16())
    finally:
        torch.set_num_threads(before)
        monkeypatch.undo()
        kernels.configure()


def test_32_blocks_take_the_tiles_from_12_rows_with_amx_else_from_25():
    """The 32-blocks' threshold follows the CPU, never the thread count (a TP
    rank takes TP 1's path): with AMX (usable by this process) the bf16 tiles
    from 12 rows; without, the integer dots up to 24 (measured on Zen 4,
    where the tiles run on AVX512-BF16; kernels.py's comment)."""
    assert kernels.block32_min_rows(frozenset({"avx512f", "avx512_vnni", "amx_tile", "amx_bf16"})) == 12
    assert kernels.block32_min_rows(frozenset({"avx512f", "avx512_vnni", "avx512_bf16"})) == 25
    assert kernels.block32_min_rows(frozenset({"avx2"})) == 25
    assert kernels.PREFILL_MIN_ROWS[32] == kernels.block32_min_rows(cpu_features().flags)


def test_zero_rows_and_zero_x():
    w, _ = weight("Q8_0", N, K)
    assert quant.gemv(torch.zeros(0, K), w).shape == (0, N)
    assert torch.equal(quant.gemv(torch.zeros(2, K), w), torch.zeros(2, N))


_AVX2_PROBE = """
import torch
from kvferry.model import quant
from tests.model.quant.test_kernels import check, massive_x, TYPES, K, N
from tests.model.quant.blocks import ggml_q8_0, weight
if not quant.available():
    print("no build"); raise SystemExit
assert quant.kernel_path() == "avx2", quant.kernel_path()
for name in TYPES:
    w, ref = weight(name, N, K)
    assert torch.equal(quant.dequantize_rows(w), ref), name
    for m in (1, 3, 16, 32, 200):
        x = torch.randn(m, K)
        check(quant.gemv(x, w), x, w, ref)
    if w.fmt.block == 32:  # batch 1's eight-block groups with a tail of blocks and of rows
        w, ref = weight(name, 37, 576)
        x = torch.randn(1, 576)
        check(quant.gemv(x, w), x, w, ref)
w, _ = weight("Q8_0", 37, 576)
for m in (1, 3, 9):
    x = massive_x(m, 576, seed=m)
    assert torch.equal(quant.gemv(x, w), ggml_q8_0(x, w)), m
print("avx2 quant ok")
"""


def test_the_avx2_build_is_right_too():
    """The vpmaddubsw path an AVX2-only CPU runs (KVFERRY_KERNEL_ISA=avx2 builds it here)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVFERRY_KERNEL_ISA": "avx2", "KVFERRY_DISABLE_CPP_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", _AVX2_PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    if "no build" in done.stdout:
        pytest.skip("the AVX2 build did not build here")
    assert "avx2 quant ok" in done.stdout
