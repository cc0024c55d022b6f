"""``quant.linear_parts``: a fused layer's shards of mixed types (Q4_K_M's
q/k in Q4_K and v in Q6_K) in one call, each part's columns ``quant.linear``'s
for that part alone to the bit, at decode rows (one dots call: x quantized
once per block size, the parts' rows split among threads by bytes) and
prefill rows (each part's tiles), at any thread count; and the same in the
AVX2 build (vpmaddubsw)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvferry import envs
from kvferry.model import paged_kernel, quant
from kvferry.model.cpu_features import cpu_features
from kvferry.model.quant import kernels
from tests.model.quant.blocks import weight

pytestmark = pytest.mark.skipif(not quant.available(), reason="the C++ quantized matmul did not build here")

K = 512
# Q4_K_M's q, k, v; a 32-block pair; both block sizes in one call (x quantized twice);
# more parts than a thread's prefetch stream keeps (8: the rest stream unprefetched).
MIXES = [(("Q4_K", 96), ("Q4_K", 40), ("Q6_K", 40)), (("Q8_0", 37), ("Q4_1", 64)), (("Q5_0", 9), ("Q4_K", 70)),
         tuple((("Q4_K", "Q4_1", "Q8_0")[i % 3], 8 + 3 * i) for i in range(10))]
# Dots for all at 1 and 3; the 32-blocks' tiles from 12 rows with AMX, from 25
# without (quant/kernels.py), the K-quants' from 20.
ROWS = [1, 3, 13, 20, 25]


def parts_of(mix: tuple[tuple[str, int], ...]) -> list[quant.QuantizedWeight]:
    return [weight(name, n, K, seed=i)[0] for i, (name, n) in enumerate(mix)]


def check_parts(threads: tuple[int, ...]) -> None:
    before = torch.get_num_threads()
    try:
        for mix in MIXES:
            ws = parts_of(mix)
            for m in ROWS:
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(dtype)
                    want = torch.cat([quant.linear(x, w) for w in ws], dim=1)
                    for t in threads:
                        torch.set_num_threads(t)
                        got = quant.linear_parts(x, ws)
                        assert got.dtype == dtype and torch.equal(got, want), (mix, m, dtype, t)
    finally:
        torch.set_num_threads(before)


def test_parts_are_each_parts_linear():
    check_parts((1, 2, 3))


def test_one_part_is_linear_and_bad_x_is_refused():
    (w,) = parts_of((("Q4_K", 33),))
    x = torch.randn(2, K)
    assert torch.equal(quant.linear_parts(x, [w]), quant.linear(x, w))
    with pytest.raises(ValueError, match="x must be"):
        quant.linear_parts(torch.randn(2, K + 32), [w])


_AVX2_PROBE = """
from kvferry.model import quant
from tests.model.quant.test_parts import K_QUANTS, check_batch_1, check_parts
if not quant.available():
    print("no build"); raise SystemExit
assert quant.kernel_path() == "avx2", quant.kernel_path()
check_parts((1, 2))
for name in K_QUANTS:
    check_batch_1(name)
print("avx2 parts ok")
"""


def test_the_avx2_build_is_right_too():
    """The vpmaddubsw path an AVX2-only CPU runs (KVFERRY_KERNEL_ISA=avx2 builds it here)."""
    env = {**os.environ, "KVFERRY_KERNEL_ISA": "avx2", "KVFERRY_DISABLE_CPP_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", _AVX2_PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    if "no build" in done.stdout:
        pytest.skip("the AVX2 build did not build here")
    assert "avx2 parts ok" in done.stdout


K_QUANTS = [n for n in quant.FORMATS if quant.block_format(n).block == 256]
BLOCK32 = [n for n in quant.FORMATS if quant.block_format(n).block == 32]


@pytest.mark.parametrize("name", K_QUANTS + BLOCK32)
def test_batch_1_is_the_many_row_kernel_to_the_bit(name):
    """Batch 1 has its own kernels (K-quants: two groups per register for Q4_K
    and Q6_K in the AVX-512 build; 32-blocks: eight blocks and four weight rows
    at a time), and so have 2-32 rows (passes of 8 rows, weight rows 4 at a
    time past one pass): a row's value is the same at every batch size they
    take, to the bit (x's rows are quantized independently). They take every
    size below the prefill dots' first row count (kernels.prefill_dots_from;
    6 rows of the 32-blocks and 12 of the K-quants where the prefill dots fit),
    and every size with KVFERRY_QUANT_DOTS_ALWAYS=1. 45 weight rows: 11 tiles
    of 4 and a tail; every row count 1-32: tail passes of each size, whole
    passes, odd tails. The 32-blocks' K = 1120 is 35 blocks: four groups of
    eight and a tail of three, where the one-row dot sums the offsets apart."""
    if name in BLOCK32 and not (cpu_features().avx512 and paged_kernel.kernel_isa() == "native"):
        # rows32_512 is the AVX-512 builds' kernel; the AVX2 build's rows32 sums
        # a 32-block's offsets per row in another order than its one-row dot.
        pytest.skip("the 32-blocks' many-row dots are batch 1's to the bit in AVX-512 builds only")
    check_batch_1(name)


def check_batch_1(name: str) -> None:
    k = 2048 if name in K_QUANTS else 1120
    w, _ = weight(name, 45, k, seed=7)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([quant.gemv(x[r:r + 1], w) for r in range(32)])
    for m in range(2, min(33, kernels.prefill_dots_from(w.fmt.block))):
        assert torch.equal(quant.gemv(x[:m], w), alone[:m]), m
    saved = os.environ.get(envs.QUANT_DOTS_ALWAYS)
    try:
        os.environ[envs.QUANT_DOTS_ALWAYS] = "1"
        kernels.configure()
        for m in range(2, 33):
            assert torch.equal(quant.gemv(x[:m], w), alone[:m]), ("dots always", m)
    finally:
        if saved is None:
            os.environ.pop(envs.QUANT_DOTS_ALWAYS, None)
        else:
            os.environ[envs.QUANT_DOTS_ALWAYS] = saved
        kernels.configure()
