"""Loading the quantized matmul (``csrc/quant_gemm.cpp``) and calling it.

The library is built at first use with paged_kernel.py's machinery (same
cache folder, the cache name hashes source, flags and CPU flags). With
``KVFERRY_KERNEL_ISA=avx2`` on an AVX-512 machine it is also built without
AVX-VNNI, so that build runs (and tests) the vpmaddubsw path an AVX2-only CPU
takes; a CPU with AVX-VNNI gets vpdpbusd in its native build.
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from kvferry import envs
from kvferry.model import paged_kernel
from kvferry.model.cpu_features import cpu_features
from kvferry.model.quant.formats import QuantizedWeight

_SOURCE = Path(__file__).parent.parent / "csrc" / "quant_gemm.cpp"
_library = paged_kernel.LazyLibrary(lambda: _load())
# Each thread's tile buffer, kept between calls: a fresh 4 MiB buffer per
# call costs ~1000 page faults, as long as dequantizing a tile.
_tiles = threading.local()
# The dequantized tile of a prefill-sized batch: 4 MiB of bf16 (1024 rows of
# K = 2048), one at a time. Smaller tiles pay oneDNN's fixed cost per call
# (~50 us, as much as a 128-row tile's multiply at 32 rows).
PREFILL_TILE_BYTES = 4 << 20
# Up to SMALL_TILE_MAX_ROWS rows of x the multiply is short and the tile's round trip
# through memory is not: a 1 MiB tile stays in a core's L2 between its dequantization
# and its multiply (measured, one thread, 49152 x 576 Q8_0 at 4-16 rows: 6.2-7.2 ms
# against 7.5-7.9 with 4 MiB tiles; at 64 rows 4 MiB is the faster).
SMALL_TILE_BYTES = 1 << 20
SMALL_TILE_MAX_ROWS = 16
# From this many rows of x, on a CPU with AMX (or a build without the K-quants'
# prefill dots: PREFILL_DOTS below), a dequantized bf16 tile and oneDNN beat
# the integer dot products, whose cost grows with every row
# while the tiles' is mostly the dequantization, paid once (8B at 16 rows:
# all 4.6 GiB of blocks a step). Measured on a Xeon with AMX (avx512vnni
# build), all matmuls of a 1B-shaped Q4_K_M step (bench/gguf_matmul_sequence.py
# 1b --rows ... --ab), a quiet moment of a shared machine, median CPU ms of
# all threads (rowsK: the K-quants' ymm dots before rowsK_512):
#   rows                        1     8     12    16    20    24    32
#   1 thread   dots             55   140   225   268   345   404   464
#              dots (rowsK)          182   276   353         563   774
#              tiles                            262   277   278   275
#   2 threads  dots             56   137   215   233   327   373   474
#              tiles                            271   287   296   306
# Loaded (2 cores at load 7-9), two threads' tiles cost 4-9x their quiet
# CPU time at 16-32 rows, the dots about 2x: each tile is two parallel
# regions (its dequantization, its oneDNN multiply), a dots call one, and
# each region waits for its slowest thread. One call, one thread, cold
# copies, loaded, CPU ms: Q4_K 14336 x 4096 (8B's gate/up) dots 9.5 / 11.3 /
# 15.9 at 12 / 16 / 24 rows, tiles 10.6 / 11.6 / 12.1; Q6_K 4096 x 14336 (its
# down) dots 10.0 / 12.0 / 14.5 at 12 / 16 / 20, tiles 18.3 / 19.7 / 15.3. So
# the K-quants take the dots below 20 rows (c16's decode steps: a tie with the
# tiles on one thread, ahead on two), at any thread count, so that a TP rank
# (fewer threads) takes the path TP 1 takes (tests/parallel/test_gguf_tp.py).
# The 32-blocks' many-row dots (rows32_512 in AVX-512 builds: each block
# decoded once for all rows, the one-row dot's arithmetic to the bit) were
# measured on AMD Zen 4 (AVX512-VNNI and AVX512-BF16, no AMX: the tiles run
# oneDNN's AVX512-BF16 kernels; bench/gguf_rows32.py, cold weights, bf16 x,
# 2 cores at load 12-16, medians of interleaved passes, CPU ms of one thread):
#   rows                          8     12    16    20    24    32
#   Q8_0 8192 x 2048   dots      3.80  5.63  6.76  8.35  9.24  11.7
#                      tiles     9.00  9.10  9.16  15.0  15.0  8.41
#   Q4_1 2048 x 8192   dots      3.84  5.02  6.57  8.00  9.53  12.5
#                      tiles     8.94  8.95  9.23  14.7  14.8  8.39
#   Q4_1 1536 x 576    dots      0.19  0.29  0.37  0.47  0.55  0.73
#                      tiles     0.32  0.33  0.34  0.47  0.48  0.47
#   Q8_0 49152 x 576   dots      6.10  10.8  13.1  16.3  18.4  24.0
#   (lm_head)          tiles     9.38  9.77  10.2  14.0  14.7  14.9
# (rows32, the kernel before, took 1.15-1.4x the dots' time at 4-32 rows on
# the 1B shapes, 1.15-1.3x on the embedded model's layers, 1.05-1.15x on its
# lm_head.) On one thread the 1B shapes
# take the dots' side by 1.3-2x up to 24 rows; the embedded model's whole
# step (30 Q4_1 layers and the Q8_0 lm_head) is dots / tiles 0.92, 1.11,
# 1.02, 1.14 at 12, 16, 20, 24 rows; at 32 the tiles win everywhere. On two
# threads (loaded) the tiles cost 5-20x the dots' CPU at 8-24 rows on the 1B
# shapes and 2.6-11x on the lm_head (each tile is two parallel regions, each
# waiting on its slowest thread; Q4_1 1536 x 576: 0.9x at 16, 1.2x at 24). So
# without AMX the 32-blocks take the dots below 25 rows, at any thread count.
# With AMX the tiles keep 12, as measured on a Xeon with rows32 (Q8_0 8192 x
# 2048, one thread: 3.4 / 5.1 / 6.9 ms at 8 / 12 / 16 rows, tiles 2.9 / 2.9 /
# 3.2): assumed, not measured (no AMX machine at hand), that rows32_512 gains
# there what it gains on Zen 4 (about 1.3x: ~2.6 / 3.9 / 5.3 ms), still
# behind AMX's tiles from 12 rows. tests/model/test_gguf_blocks.py's 8-row
# chunks take the dots on both.
BLOCK32_MIN_ROWS_AMX = 12
BLOCK32_MIN_ROWS = 25


def block32_min_rows(flags: frozenset[str]) -> int:
    """From how many rows of x the 32-blocks take the tiles on a CPU with
    these flags (cpu_features': AMX's only where the process may use it)."""
    return BLOCK32_MIN_ROWS_AMX if "amx_bf16" in flags else BLOCK32_MIN_ROWS


PREFILL_MIN_ROWS = {32: block32_min_rows(cpu_features().flags), 256: 20}  # by the format's block size
# PREFILL_DOTS: whether every type takes the integer dots at EVERY batch
# size (PREFILL_MIN_ROWS then unused): from PREFILL_DOTS_FROM_ROWS rows the
# prefill kernels of csrc/quant_prefill_dots.h (panels of 16 weight rows, one
# output per 32-bit lane, the blocks decoded once per call), below them the
# decode kernels (rows32_512, rowsK_512). None: decided from the CPU at load
# (configure): True where the build has those kernels (AVX512-VNNI) and the
# CPU lists no AMX flag. Without AMX, oneDNN's bf16 tiles run vdpbf16ps (32
# multiply-adds an instruction, after a dequantization) where vpdpbusd does
# 64. Measured on AMD EPYC Zen 4 (2 cores, loaded, CPU time of one thread,
# in-process A/B): one call (bench/quant_gemv.py --prefill smol 1b 8b), the
# tiles take 1.4-1.9x the prefill dots' time at 64-2048 rows, Q4_K and Q6_K
# at every 1B and 8B shape, and 1.3-1.8x for Q8_0 and Q4_1 at 12-512 rows;
# all matmuls of a 1B-shaped Q4_K_M step (bench/gguf_matmul_sequence.py 1b
# --rows ... --ab 12,20), tiles / dots: 2.3x at 20 rows, 2.1x at 24, 0.96x at
# 32 (rowsK_512 there), 1.36x at 64, 1.49x at 512. With AMX the tiles keep
# prefill (AMX-BF16; not measured against these dots). Never dependent on the
# thread count: a TP rank takes the path TP 1 takes.
PREFILL_DOTS: bool | None = None
_prefill_dots = False
# KVFERRY_QUANT_DOTS_ALWAYS=1: every batch size takes the dots, as llama.cpp's
# CPU backend quantizes x to 8 bits for every matmul, prefill included. Its
# greedy answers then agree with llama.cpp's on the same file as far as the
# other ops' rounding allows (tests/model/test_gguf_llama_cpp.py); the tiles
# round x to bf16 instead, a different model at this model's near ties.
# Read when the library loads (configure), not per call.
_dots_always = False
# From this many rows of x the dots take quant_prefill_dots.h's kernels
# (panels of 16 weight rows decoded once per call, one output per 32-bit
# lane), below them the decode kernels (rowsK_512, rows32_512: passes of 8
# rows, a row's value batch 1's to the bit). The prefill kernels keep one
# float sum per output where the decode kernels keep 8: their values differ
# in the last bits, and are the same in every batch from this many rows, so
# a decode step of at least this many rows no longer gives a row batch 1's
# bits (nor, for Q8_0, llama.cpp's: KVFERRY_QUANT_DOTS_ALWAYS=1 keeps both).
# Measured on AMD Zen 4 (AVX512-VNNI, no AMX; bench/quant_rows_ab.py, cold
# weights, bf16 x, one thread, CPU ms, medians of interleaved calls, 2 cores
# at load 12-14), with the panels transposed in registers and prefetched a
# panel ahead (their decoding had been ~60% of a 16-row call):
#   rows                                   2     4     6     8    12    16    32 (32: before the prefetch)
#   Q4_1 1536 x 576   decode / panel    0.89  1.24  1.31  1.49        2.00  2.38
#   Q4_1 576 x 1536   decode / panel    0.89  1.07  1.18  1.30        1.83  2.22
#   Q8_0 49152 x 576  decode / panel          0.84        1.21  1.87  2.00
#   Q4_K 14336 x 4096 decode / panel                      0.88  1.08  1.18  1.52
#                     (Q4_K decoded in registers)               1.18  1.28
#   Q4_K 4096 x 14336 decode / panel                      0.85  1.00  1.10  1.48
#                     (Q4_K decoded in registers)               1.09  1.18
#   Q6_K 14336 x 4096 decode / panel                      0.83  1.05  1.12  1.39
#   Q6_K 4096 x 14336 decode / panel                      0.89  0.95  1.02  1.28
# So the 32-blocks take the panels from 6 rows and the K-quants from 12 (a
# c16 decode step takes them). By default (KVFERRY_GGUF_PANELS) the K-quants' panels are
# packed once at load (quant/panels.py) and no call decodes them: 0.65-0.8x
# the panel's time at 12-16 rows on the 8B shapes (BENCHMARKS.md). Where the prefill dots do not fit (AMX, whose
# tiles take over from 12 or 20 rows; not measured against these panels)
# the decode kernels keep every batch below PREFILL_DOTS_FROM_ROWS_ELSE.
# On AMD Zen 5 (family 26 model 2; 2 cores at load 9-11, in-process, the two
# paths interleaved, CPU ms of one thread, medians of 7-9 passes, the 1B
# Q4_K_M step's matmuls) the K-quants' packed panels (the default) through
# the decode kernels' arithmetic (packed_rows) against the prefill kernels
# (prefill_rows_packed), prefill / decode: 1.59x at 8 rows, 1.37 at 10, 1.26
# at 12, 1.08-1.10 at 16, 0.98 at 20, 0.88 at 24, 0.82 at 32 (8B's shapes:
# 1.28x at 12, 1.04 at 16, 1.00 at 20). So Zen 5 and
# later take the K-quants' prefill kernels from 18 rows (a c16 step keeps
# batch 1's bits there). The blocks (KVFERRY_GGUF_PANELS=0) would rather
# take them from 12 (prefill / decode 0.84x at 12 rows, 0.72 at 16): one
# threshold serves both, so that the panels give the blocks' bits at every
# batch, and it follows the default. The 32-blocks keep 6 (on Zen 5 their
# prefill kernels lead from 4 rows already, 0.67x at 4 and 0.55 at 6 on the
# Q8_0 1B shapes; 2-5 rows not measured further).
K_QUANT_DOTS_FROM_ROWS_ZEN5 = 18


def prefill_dots_from_rows(features) -> dict[int, int]:
    """``PREFILL_DOTS_FROM_ROWS`` for a CPU (``cpu_features()``), by block size."""
    return {32: 6, 256: K_QUANT_DOTS_FROM_ROWS_ZEN5 if features.amd_zen5_or_later else 12}


PREFILL_DOTS_FROM_ROWS = prefill_dots_from_rows(cpu_features())  # by the format's block size
PREFILL_DOTS_FROM_ROWS_ELSE = 33
# How far ahead (bytes) the packed panels' dots prefetch their superblocks
# into L2, beside the L1 stream (csrc/quant_prefill_dots.h's far_prefetch; 0:
# none). Prefetches only: the same bits at any distance. 24 KiB was measured
# on AMD Zen 4 (the Q6_K panels read ~13 GB/s cold without it, 20-25 with
# it, 1 thread). On AMD Zen 5 (family 26 model 2, 2 cores at load 8-11,
# in-process, distances interleaved, CPU ms of the 1B Q4_K_M step's matmuls
# over the panels, 1 thread, medians of 15-21 passes) the far stream costs
# time at batch 1 and nothing is gained at 2-8 rows:
#   distance (KiB)    0      4      8     12     16     24     32     48
#   1 row           0.885  0.925  0.892  0.904  0.976  1.000  1.043  1.085  (x 24 KiB's time)
#   2 / 4 / 8 rows  0.98 / 1.00 / 1.00 at 0 (4-24 KiB within 0.95-1.05)
# (2 threads, 1 row: 0 KiB 0.78x; 8B's shapes, 1 thread: 0 KiB 0.918x at 1
# row, 0.99x at 8.) So Zen 5 and later takes none.
PANEL_FAR_AHEAD_ZEN4 = 24576


def panel_far_ahead(features) -> int:
    """The panels' far prefetch distance for a CPU (``cpu_features()``): none
    on AMD Zen 5 and later, Zen 4's 24 KiB elsewhere."""
    return 0 if features.amd_zen5_or_later else PANEL_FAR_AHEAD_ZEN4


PANEL_FAR_AHEAD = panel_far_ahead(cpu_features())
# Up to this many rows the prefill tiles multiply as w @ x^T (see prefill).
TRANSPOSED_MAX_ROWS = 64


def _cflags() -> list[str]:
    isa = paged_kernel.kernel_isa()
    return paged_kernel._cflags() + ([] if paged_kernel.isa_is_native(isa) else ["-mno-avxvnni"])


def _load() -> bool:
    loaded = paged_kernel.try_load_library("kvferry_quant", _SOURCE, _cflags(),
                                           "the C++ quantized matmul", "dequantized float weights")
    if loaded:
        configure()
    return loaded


def configure() -> None:
    """Hand this module's path constants to the library's ``layer_linear``
    (the one-call decoder layer's matmul of a GGUF weight), so both layers
    take the same path at the same row count. Called at load; again by
    anything that changes the constants."""
    global _dots_always, _prefill_dots
    _dots_always = envs.quant_dots_always()
    _prefill_dots = prefill_dots_fit() if PREFILL_DOTS is None else PREFILL_DOTS
    torch.ops.kvferry_quant.configure(prefill_min_rows(32), prefill_min_rows(256), PREFILL_TILE_BYTES,
                                      SMALL_TILE_BYTES, SMALL_TILE_MAX_ROWS, TRANSPOSED_MAX_ROWS,
                                      prefill_dots_from(32), prefill_dots_from(256), PANEL_FAR_AHEAD)


def prefill_min_rows(block: int) -> int:
    """From how many rows of x a weight of this block size takes the tiles
    (``PREFILL_MIN_ROWS``; never with KVFERRY_QUANT_DOTS_ALWAYS=1, nor for
    the K-quants where their prefill dots fit the CPU: ``PREFILL_DOTS``)."""
    return 1 << 62 if _dots_always or _prefill_dots else PREFILL_MIN_ROWS[block]


def prefill_dots_from(block: int) -> int:
    """From how many rows of x the dots of this block size take the prefill
    kernels (``PREFILL_DOTS_FROM_ROWS`` where they fit the CPU: ``PREFILL_DOTS``,
    else ``PREFILL_DOTS_FROM_ROWS_ELSE``; never with KVFERRY_QUANT_DOTS_ALWAYS=1,
    whose dots are the decode kernels at every size: llama.cpp's arithmetic)."""
    if _dots_always:
        return 1 << 62
    return PREFILL_DOTS_FROM_ROWS[block] if _prefill_dots else PREFILL_DOTS_FROM_ROWS_ELSE


def prefill_dots_fit() -> bool:
    """Whether the K-quants' prefill dots beat the bf16 tiles here: the build
    has them (AVX512-VNNI) and the CPU has no AMX (its tiles' bf16 is AMX's)."""
    return bool(torch.ops.kvferry_quant.prefill_dots(12)) and not any(f.startswith("amx") for f in
                                                                       cpu_features().flags)


def available() -> bool:
    """Whether the library is loaded (building it on the first call)."""
    return not paged_kernel.kernels_disabled() and _library.available()


def kernel_path() -> str | None:
    """The integer dot product the build runs: "avx512vnni", "avxvnni", "avx2" or "none"."""
    return torch.ops.kvferry_quant.path() if available() else None


def _ops():
    if not available():
        raise RuntimeError("the C++ quantized matmul is unavailable (disabled or not built; see the log)")
    return torch.ops.kvferry_quant


def _check_x(x: torch.Tensor, weight: QuantizedWeight) -> None:
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"tensor {weight.name!r}: x must be [M, {weight.in_features}], got {list(x.shape)}")


def dequantize_rows(weight: QuantizedWeight, start: int = 0, stop: int | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows start..stop of the weight as floats [rows, in_features] (float32 or bf16)."""
    data = weight.data[start:stop]
    out = torch.empty(data.shape[0], weight.in_features, dtype=dtype)
    _dequant_rows_into(weight, start, start + data.shape[0], out)
    return out


def _dequant_rows_into(weight: QuantizedWeight, start: int, stop: int, out: torch.Tensor) -> None:
    """Rows start..stop of the weight into ``out``: from its packed panels where
    it has them (its blocks may be handed back, quant/panels.py), else its blocks."""
    ops, t = _ops(), weight.fmt.ggml_type
    if t in (12, 14) and ops.dequant_packed_rows(weight.data, t, torch.arange(start, stop), out):
        return
    ops.dequant_into(weight.data[start:stop], t, out)


def embedding(ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` [T] of a quantized table, dequantized: [T, in_features] in
    ``dtype`` (float32 or bf16). Only the looked-up rows' blocks are read
    (gathered, T x bytes_per_row, then decoded), never the whole table."""
    ops = _ops()
    out = torch.empty(ids.numel(), weight.in_features, dtype=dtype)
    # A table packed into panels (a tied lm_head's, quant/panels.py) may have handed its blocks back.
    if weight.fmt.ggml_type in (12, 14) and ops.dequant_packed_rows(weight.data, weight.fmt.ggml_type, ids, out):
        return out
    rows = weight.data.index_select(0, ids.reshape(-1))  # [T, bytes_per_row] uint8
    ops.dequant_into(rows, weight.fmt.ggml_type, out)
    return out


def gemv(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [M, K] float32/bf16 -> x @ W^T [M, N] float32 with integer dot products
    (x quantized to 8 bits per block, once per row)."""
    _check_x(x, weight)
    return _ops().gemm(x, weight.data, weight.fmt.ggml_type, weight.out_features)


def prefill(x: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype = torch.bfloat16,
            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x @ W^T [M, N] in ``out_dtype`` through oneDNN, dequantizing one tile of weight
    rows at a time into one reused buffer (``dtype``: bf16, or float32 for checks)."""
    _check_x(x, weight)
    ops, xd = _ops(), x.to(dtype)
    tile_bytes = PREFILL_TILE_BYTES if x.shape[0] > SMALL_TILE_MAX_ROWS else min(PREFILL_TILE_BYTES,
                                                                                 SMALL_TILE_BYTES)
    rows = max(16, tile_bytes // (weight.in_features * dtype.itemsize))
    tile = _tile_buffer(min(rows, weight.out_features) * weight.in_features, dtype)
    y = torch.empty(x.shape[0], weight.out_features, dtype=out_dtype)
    # Up to TRANSPOSED_MAX_ROWS rows of x, each tile's product is taken as w @ x^T
    # (the tile as oneDNN's A operand, read as it lies) and copied back transposed;
    # x @ w^T makes oneDNN reorder the whole tile as its B operand on every call
    # (measured on the 49152 x 576 lm_head, one thread, 16-32 rows: 2-3 ms of 10-13).
    transposed = x.shape[0] <= TRANSPOSED_MAX_ROWS
    for start in range(0, weight.out_features, rows):
        stop = min(start + rows, weight.out_features)
        w = tile[:(stop - start) * weight.in_features].view(stop - start, weight.in_features)
        _dequant_rows_into(weight, start, stop, w)
        y[:, start:stop] = (w @ xd.t()).t() if transposed else xd @ w.t()
    return y


def _tile_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = getattr(_tiles, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = _tiles.buf = torch.empty(numel, dtype=dtype)
    return buf


def path_for(rows: int, weight: QuantizedWeight) -> str:
    """The path ``linear`` takes for ``rows`` rows of x: "dots" (``gemv``) or "tiles" (``prefill``)."""
    # Without AVX2 the library has only its scalar dequantizer: every M takes the tiles.
    small = rows < prefill_min_rows(weight.fmt.block) and kernel_path() != "none"
    return "dots" if small else "tiles"


def linear_args(weight: QuantizedWeight) -> tuple:
    """The arguments after (x, w) of the C++ ``linear`` (``csrc/quant_gemm.cpp``),
    which runs ``linear``'s paths with this module's constants: the type, the
    rows, then the path and tile sizes. The one-call decoder layer passes the
    same (layers/gguf.py's ``matmul_args``)."""
    return (weight.fmt.ggml_type, weight.out_features, prefill_min_rows(weight.fmt.block), PREFILL_TILE_BYTES,
            SMALL_TILE_BYTES, SMALL_TILE_MAX_ROWS, TRANSPOSED_MAX_ROWS)


def linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """y = x @ W^T in x's dtype, by the path that fits M
    (``path_for``), in one C++ call: the dots write x's dtype directly; the
    tiles are ``prefill``'s, in C++."""
    _check_x(x, weight)
    return _ops().linear(x, weight.data, *linear_args(weight))


def linear_parts(x: torch.Tensor, weights: list[QuantizedWeight]) -> torch.Tensor:
    """y = x @ [W_0; W_1; ...]^T in x's dtype: a fused layer's shards kept
    apart (types that differ), in one C++ call. Where every part takes the
    dots at M rows, x is quantized once per block size and all parts' rows
    share one parallel region; else each part takes ``linear``'s path and the
    results are concatenated. Each part's columns are ``linear(x, W_i)``'s to
    the bit. The paths' constants are the ones ``configure`` last handed the
    library (this module's, at load)."""
    for w in weights:
        _check_x(x, w)
    return _ops().layer_linear_parts(x, [w.data for w in weights], [w.fmt.ggml_type for w in weights])
