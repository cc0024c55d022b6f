"""Matmuls for decode-sized batches (``csrc/small_gemm.cpp``), built at first use.

A decode step multiplies every weight by a few dozen rows. oneDNN's kernels
are tuned for large row counts: at 32 rows they reach about 60% of their
large-batch rate, and less when the weights stream from DRAM, as they do in
a step (each layer's weights are read once). These kernels keep a register
block of rows by column vectors over the whole reduction, with the weights
packed once into one contiguous stream per column block and the next block
prefetched while the current one is multiplied.

    pack(weight)          weight [N, K] bf16 / float32 -> the packed copy, or None where it does not apply
    linear(x, packed, n)  x [M, K] in the weight's dtype -> [M, n] (float32 sums; bf16 rounded once)

(bf16 also has ``torch.ops.kvferry_gemm.linear_prefetch(x, packed, n,
prefetch)``: linear's bits with another software prefetch, which the MoE
layer picks by rows on Zen 4; csrc/small_gemm.cpp.)

bf16 (vdpbf16ps) applies on a CPU with AVX512-BF16 but no AMX (oneDNN's AMX
kernels are faster at every size); float32 (FMA) on any CPU with AVX-512F or
AVX2+FMA. Both need the native build (with ``KVFERRY_KERNEL_ISA=avx2`` on an
AVX-512 machine oneDNN still runs AVX-512, which the AVX2 kernel cannot
beat). Where they apply they serve every row count: a prefill chunk runs
in passes of rows that stay in L2, and then matches oneDNN (linear.py).
``KVFERRY_DISABLE_SMALL_GEMM=1`` (or ``KVFERRY_DISABLE_CPP_KERNELS=1``) turns
them off; a failed build logs a warning and leaves oneDNN in charge.

The build shares paged_kernel.py's machinery and cache folder.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kvferry import envs
from kvferry.model import paged_kernel
from kvferry.model.cpu_features import cpu_features

_SOURCE = Path(__file__).parent / "csrc" / "small_gemm.cpp"
_library = paged_kernel.LazyLibrary(lambda: _load())


def small_gemm_disabled() -> bool:
    return paged_kernel.kernels_disabled() or envs.disabled(envs.DISABLE_SMALL_GEMM)


def cpu_fits(dtype: torch.dtype) -> bool:
    """Whether the kernel for ``dtype`` beats oneDNN on this CPU, in this build."""
    if not paged_kernel.isa_is_native(paged_kernel.kernel_isa()):
        return False
    flags = cpu_features().flags
    if dtype == torch.bfloat16:
        return "avx512_bf16" in flags and "amx_bf16" not in flags
    if dtype == torch.float32:
        return "avx512f" in flags or ("avx2" in flags and "fma" in flags)
    return False


def pack(weight: torch.Tensor, fastest_only: bool = True) -> torch.Tensor | None:
    """weight [N, K] -> the kernel's packed copy (any N, K), or None where the kernel does not apply.

    ``fastest_only=False``: wherever the kernel builds, even where oneDNN is
    faster (AMX): its rows' results do not depend on the row count
    (layers/unquantized.py's batch-invariant method)."""
    usable = available(weight.dtype) if fastest_only else builds(weight.dtype)
    if weight.device.type != "cpu" or weight.dim() != 2 or not usable:
        return None
    w = weight.detach().contiguous()
    if weight.dtype == torch.bfloat16:
        return torch.ops.kvferry_gemm.pack(w)
    return torch.ops.kvferry_gemm.pack_f32(w)


def linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] (any M), packed's dtype -> [M, n]."""
    if packed.dtype == torch.bfloat16:
        return torch.ops.kvferry_gemm.linear(x, packed, n)
    return torch.ops.kvferry_gemm.linear_f32(x, packed, n)


def cpu_supports(dtype: torch.dtype) -> bool:
    """Whether this build's kernel for ``dtype`` runs on this CPU at all."""
    if not paged_kernel.isa_is_native(paged_kernel.kernel_isa()):
        return False
    flags = cpu_features().flags
    if dtype == torch.bfloat16:
        return "avx512_bf16" in flags
    return cpu_fits(dtype)


def builds(dtype: torch.dtype = torch.bfloat16) -> bool:
    """True once the library is loaded on a CPU that runs ``dtype``'s kernel."""
    if small_gemm_disabled() or not cpu_supports(dtype):
        return False
    return _library.available()


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """True once the library is loaded on a CPU where ``dtype``'s kernel fits
    (building it on the first call)."""
    if small_gemm_disabled() or not cpu_fits(dtype):
        return False  # checked per call, so tests can switch paths per test
    return _library.available()


def _load() -> bool:
    return paged_kernel.try_load_library("kvferry_gemm", _SOURCE, paged_kernel._cflags(),
                                         "the C++ small-batch matmul", "oneDNN")
