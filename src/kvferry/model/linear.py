"""Linear layers on CPU through oneDNN with weights prepacked once.

``F.linear`` on CPU hands the plain ``[out, in]`` weight to the BLAS on every
call, which re-blocks it each time. oneDNN can reorder a weight once into its
own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, an opaque
tensor) and then multiply with it directly (``_linear_pointwise``). Measured
on one AVX-512 core (SmolLM2-135M shapes, batch 32): the layers' matmuls take
~17% less time in bf16 and ~25% less in float32; the 49152-row lm_head gains
most (25-40%). Prefill-sized batches gain 0-10%.

Decode-sized batches (up to ``small_gemm.MAX_ROWS`` rows) go to
``small_gemm`` instead where it applies (bf16: AVX512-BF16 without AMX;
float32: AVX-512F or AVX2+FMA), which is faster than oneDNN there; such a
weight keeps both packed copies.

The plain weight stays the model's parameter (loading, tying and
fingerprinting read it); the packed copies (``PackedWeight``) sit beside it. Packing is skipped,
and ``F.linear`` used, for non-CPU tensors, other dtypes, a torch without
oneDNN, when ``KVFERRY_DISABLE_ONEDNN_PACKING=1``, or if packing fails.
float32 results differ from ``F.linear`` only by summation order (~1e-6
relative).

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

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvferry.model import small_gemm

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
    return os.environ.get("KVFERRY_DISABLE_ONEDNN_PACKING", "") not in ("", "0")


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight's packed copies (the plain weight stays the model's parameter)."""
    onednn: torch.Tensor | None  # oneDNN's blocked copy (opaque); None: F.linear
    small: torch.Tensor | None  # small_gemm's copy, for row counts up to small_gemm.MAX_ROWS
    out_features: int


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """weight [out, in] -> its packed copies, or None where neither applies."""
    small = small_gemm.pack(weight)
    onednn = _pack_onednn(weight)
    if small is None and onednn is None:
        return None
    return PackedWeight(onednn, small, weight.shape[0])


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out]; ``packed`` is ``pack_weight(weight)`` or None."""
    rows = x.shape[0]
    if packed is None or rows == 0:
        return F.linear(x, weight, bias)
    # A small copy exists only where the kernel was available when the weight
    # was packed: no per-call check on this path (121 calls a decode step).
    if packed.small is not None and rows <= small_gemm.MAX_ROWS and bias is None and x.dtype == packed.small.dtype:
        return small_gemm.linear(x, packed.small, packed.out_features)
    if packed.onednn is None:
        return F.linear(x, weight, bias)
    onednn = packed.onednn
    padded = padded_rows(rows)
    if padded != rows:
        xp = x.new_empty((padded, x.shape[1]))
        xp[:rows] = x
        xp[rows:].zero_()
        return torch.ops.mkldnn._linear_pointwise(xp, onednn, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), onednn, bias, "none", [], "")
