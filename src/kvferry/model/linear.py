"""Linear layers on CPU through oneDNN with weights prepacked once.

``F.linear`` on CPU hands the plain ``[out, in]`` weight to the BLAS on every
call, which re-blocks it each time. oneDNN can reorder a weight once into its
own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, an opaque
tensor) and then multiply with it directly (``_linear_pointwise``). Measured
on one AVX-512 core (SmolLM2-135M shapes, batch 32): the layers' matmuls take
~17% less time in bf16 and ~25% less in float32; the 49152-row lm_head gains
most (25-40%). Prefill-sized batches gain 0-10%.

Where ``small_gemm``'s kernel applies (bf16: AVX512-BF16 without AMX;
float32: AVX-512F or AVX2+FMA) and the weight has no bias, its packed copy is
the weight's only one: it matches or beats oneDNN at every row count, from
decode batches (1-64 rows: 0.4-0.9x oneDNN's time) to 2048-row prefill
chunks (0.94-1.0x), measured on Zen5 with both AVX-512 and AVX2 builds
(oneDNN capped by ``ONEDNN_MAX_CPU_ISA=AVX2``) against each. On Zen4
(AVX512-BF16 issued at half Zen5's rate) a 1B model's prefill matmuls at
512-2048 rows run at 90-95% of one core's vdpbf16ps peak through this
copy, as fast as oneDNN's prepacked copy (vLLM's CPU call) and 2-9% ahead
of ``F.linear`` (BENCHMARKS.md, Prefill): a second, oneDNN copy for
prefill would buy nothing there.

Once a model has packed its weights, the plain parameter of every packed
weight is released (``release_plain``): the packed copy is then the only
one in memory, as in vLLM, instead of three (plain, oneDNN's, small_gemm's:
3x the weights' bytes). ``LlamaModel.load_weights`` gives them storage
again before it copies new weights in. Packing is skipped, and ``F.linear``
used on the plain weight, for non-CPU tensors, other dtypes, a torch without
oneDNN, when ``KVFERRY_DISABLE_ONEDNN_PACKING=1`` (and small_gemm does not
apply), or if packing fails. float32 results differ from ``F.linear`` only
by summation order (~1e-6 relative).

oneDNN builds a primitive (a JIT kernel) for each new number of rows and
keeps it in a cache of ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` entries: a row
count seen for the first time cost ~0.4 ms more per call (bf16, 576 x 3072,
two threads), ~50 ms over a step's 120 matmuls. A served step's row count
is its token count, which varies from step to step, so beyond
``EXACT_ROWS`` the rows are padded up to a multiple of ``ROW_BUCKET``: at
most a few hundred row counts exist then (the padding rows are zeros,
sliced off the result, and cost at most ``ROW_BUCKET - 1`` rows of work),
and the cache is raised to hold them all for every matmul shape.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvferry import envs
from kvferry.model import huge_pages, small_gemm

logger = logging.getLogger(__name__)

# Read by oneDNN when it first builds a primitive (this module is imported
# before any model runs); a value set by the user is kept. 1024 by default.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")

EXACT_ROWS = 64  # row counts up to this run as they are (decode batches)
ROW_BUCKET = 16  # above it, rows are padded to a multiple of this


def padded_rows(rows: int) -> int:
    """The row count a matmul of ``rows`` rows runs with."""
    return rows if rows <= EXACT_ROWS else -(-rows // ROW_BUCKET) * ROW_BUCKET

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_failure_logged = False


def packing_disabled() -> bool:
    return envs.disabled(envs.DISABLE_ONEDNN_PACKING)


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight's packed copy: exactly one of ``onednn`` and ``small``."""
    onednn: torch.Tensor | None  # oneDNN's blocked copy (opaque)
    small: torch.Tensor | None  # small_gemm's copy, for every row count
    out_features: int


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """weight [out, in] -> its packed copy, or None where none applies.

    small_gemm's where its kernel applies and there is no bias (it has no
    bias epilogue, and a separate add would round bf16 twice), else oneDNN's.
    """
    small = small_gemm.pack(weight) if bias is None else None
    onednn = _pack_onednn(weight) if small is None else None
    if small is None and onednn is None:
        return None
    return PackedWeight(onednn, None if small is None else on_huge_pages(small), weight.shape[0])


# Below this a packed weight stays where small_gemm put it (4 KiB pages): a
# matrix this small is mostly read from the L3 cache anyway.
HUGE_PAGE_MIN_BYTES = 4 << 20
# The arena that on_huge_pages packs into while huge_page_arena() is open (a
# model's packing); None: packed copies stay where small_gemm put them.
_arena: huge_pages.Arena | None = None


@contextlib.contextmanager
def huge_page_arena(move: bool = True) -> Iterator[None]:
    """While open, on_huge_pages moves packed copies into one arena of their
    own (huge_pages.Arena): back to back in 256 MiB chunks, where a mapping
    each would fault in up to 2 MiB of its last page unwritten. The tensors
    keep their chunks alive and nothing else does once this closes, so a
    reload's packing frees the old chunks with the old weights. ``move``
    False: none moved meanwhile (MoE experts, which moe.py moves into a slab
    of their own: a copy left in the arena would keep its bytes there)."""
    global _arena
    before, _arena = _arena, huge_pages.Arena() if move else None
    try:
        yield
    finally:
        _arena = before


def on_huge_pages(packed: torch.Tensor) -> torch.Tensor:
    """small_gemm's packed copy moved onto 2 MiB pages (huge_pages.py) while
    huge_page_arena() is open, the kernel has transparent huge pages and the
    copy is at least ``HUGE_PAGE_MIN_BYTES``; else ``packed`` itself. A
    decode step streams every packed weight once, front to back: on 4 KiB
    pages that is a TLB miss every 64 cache lines and a stop of the hardware
    prefetchers at every page. Measured on Zen 4, one thread, batch 1
    (BENCHMARKS.md, Tensor parallelism): a TP 2 rank's layers took 0.75x
    the CPU time. The same bytes, so the same results."""
    nbytes = packed.numel() * packed.element_size()
    if (_arena is None or nbytes < HUGE_PAGE_MIN_BYTES or not packed.is_contiguous()
            or not huge_pages.thp_enabled()):
        return packed
    # Each copy on a cache line, as small_gemm's own allocation is.
    moved = _arena.empty(-(-nbytes // 64) * 64)[:nbytes].view(packed.dtype).view(packed.shape)
    moved.copy_(packed)
    return moved


def release_plain(param: torch.Tensor) -> torch.Size:
    """Free a packed weight's plain storage (the packed copy serves every
    call); returns the shape, for ``restore_plain``. Reading the released
    parameter fails loudly: it is then an empty tensor."""
    shape = param.shape
    param.data = param.data.new_empty(0)
    return shape


def restore_plain(param: torch.Tensor, shape: torch.Size) -> None:
    """Give a released parameter storage of its old shape again (contents undefined)."""
    param.data = param.data.new_empty(shape)


def _pack_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    global _failure_logged
    if (weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES or packing_disabled()
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        return _reorder(weight.detach())
    except Exception as e:  # an op missing from this torch build: plain F.linear is still right
        if not _failure_logged:
            logger.warning("oneDNN weight packing unavailable, using F.linear: %s", e)
            _failure_logged = True
        return None


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def linear_fixed_blocks(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] -> [T, out] through oneDNN's copy in blocks of exactly
    ``ROW_BUCKET`` rows (the last one padded with zeros): every row then goes
    through the one primitive of that shape, whose K reduction does not
    depend on the other rows or on the row's place in the block (measured:
    bf16 with AMX, 1 or 2 threads), while oneDNN picks another blocking
    for each row count. --deterministic's matmul where oneDNN is the
    faster kernel (layers/unquantized.py); csrc/decoder_layer.cpp's kind 3.
    16 rows, one AMX tile's: a decode's padding then costs little (a 1-row
    bf16 matmul of 2048 x 8192 took as long as the plain one, 64-row blocks
    1.5x), while prefill chunks keep most of AMX's rate."""
    rows, k = x.shape
    out = x.new_empty((rows, packed.out_features))
    for s in range(0, rows, ROW_BUCKET):
        m = min(ROW_BUCKET, rows - s)
        block = x.new_zeros((ROW_BUCKET, k))
        block[:m] = x[s:s + m]
        out[s:s + m] = torch.ops.mkldnn._linear_pointwise(block, packed.onednn, bias, "none", [], "")[:m]
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out]; ``packed`` is ``pack_weight(weight, bias)`` or
    None. With a packed copy the plain ``weight`` is never read (it may have
    been released)."""
    if packed is None:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if rows == 0:
        return x.new_empty((0, packed.out_features))
    # A small copy exists only where the kernel was available when the weight
    # was packed: no per-call check on this path (121 calls a decode step).
    if packed.small is not None:
        y = small_gemm.linear(x, packed.small, packed.out_features)
        return y if bias is None else y.add_(bias)
    onednn = packed.onednn
    padded = padded_rows(rows)
    if padded != rows:
        xp = x.new_empty((padded, x.shape[1]))
        xp[:rows] = x
        xp[rows:].zero_()
        return torch.ops.mkldnn._linear_pointwise(xp, onednn, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), onednn, bias, "none", [], "")
