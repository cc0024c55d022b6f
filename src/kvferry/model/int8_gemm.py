"""int8 weights (W8A8): quantizing a weight per output channel, and the
matmul over it (``csrc/int8_gemm.cpp``).

A weight [N, K] is kept as int8 values and one float32 scale per row (per
output channel, symmetric: ``w ~ q * scale``, ``scale = max|w_row| / 127``),
a quarter of float32's bytes and half of bf16's. The activations are
quantized per call, per row (dynamic per-token, symmetric), so each output
is one exact integer dot product times two scales: AVX512-VNNI / AVX-VNNI
``vpdpbusd`` where the CPU has it, AVX2 ``vpmaddubsw`` otherwise (the
C++ file says how each stays exact).

The library builds at first use with paged_kernel.py's machinery (same
cache, same ISA switch): ``KVFERRY_KERNEL_ISA=avx2`` on an AVX-512 machine
also drops AVX-VNNI, so that build runs the vpmaddubsw path an AVX2-only
CPU takes. Without the library (no compiler, ``KVFERRY_DISABLE_CPP_KERNELS=1``,
not x86) the same arithmetic runs through ``torch._int_mm``: slower, same
numbers up to float32 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvferry.model import paged_kernel

_SOURCE = Path(__file__).parent / "csrc" / "int8_gemm.cpp"
_library = paged_kernel.LazyLibrary(lambda: _load())
# |int8 sum| <= K * 255 * 128 must fit in int32 (the kernel checks it too).
MAX_IN_FEATURES = 65536


def _cflags() -> list[str]:
    isa = paged_kernel.kernel_isa()
    return paged_kernel._cflags() + ([] if paged_kernel.isa_is_native(isa) else ["-mno-avxvnni"])


def _load() -> bool:
    return paged_kernel.try_load_library("kvferry_int8", _SOURCE, _cflags(), "the C++ int8 matmul",
                                         "torch._int_mm")


def available() -> bool:
    """Whether the library is loaded (building it on the first call)."""
    return not paged_kernel.kernels_disabled() and _library.available()


def kernel_path() -> str | None:
    """The integer dot product the build runs: "avx512vnni", "avxvnni", "avx2" or "none"."""
    return torch.ops.kvferry_int8.path() if available() else None


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A linear weight [out_features, in_features] as int8 rows and their scales."""

    name: str  # the checkpoint tensor's name, for errors
    qweight: torch.Tensor  # int8 [N, K], contiguous
    scale: torch.Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.qweight.shape[1])

    @classmethod
    def from_checkpoint(cls, name: str, qweight: torch.Tensor, scale: torch.Tensor) -> "Int8Weight":
        """A compressed-tensors weight (int8 [N, K]) and its ``weight_scale``
        ([N, 1] or [N], any float dtype); ValueError naming ``name`` where they do not fit."""
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"weight {name!r}: int8 [out, in] expected, got {qweight.dtype} {list(qweight.shape)}")
        if not scale.is_floating_point() or scale.numel() != qweight.shape[0]:
            raise ValueError(f"weight {name!r}: weight_scale must hold one float per output channel "
                             f"({qweight.shape[0]}), got {scale.dtype} {list(scale.shape)} (only per-channel "
                             "int8 is supported)")
        return cls(name, qweight.contiguous(), scale.reshape(-1).float().contiguous())


def quantize_weight(w: torch.Tensor, name: str = "") -> Int8Weight:
    """Symmetric int8 per output row: q = round(w / s), s = max|w_row| / 127
    (a zero row keeps s = 0 and q = 0). Rounding error <= s / 2 per element."""
    if w.dim() != 2:
        raise ValueError(f"weight {name!r}: [out, in] expected, got {list(w.shape)}")
    wf = w.detach().float()
    scale = wf.abs().amax(dim=1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(wf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(name, q.contiguous(), scale.contiguous())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scale [M]): the activations' dynamic
    per-token quantization, as the kernel does it (round half to even)."""
    xf = x.float()
    d = xf.abs().amax(dim=1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(xf * inv[:, None]).to(torch.int8), d


def row_sums(qweight: torch.Tensor) -> torch.Tensor:
    """Each row's sum of int8 values, int32 [N] (the VNNI path's offset term)."""
    return qweight.sum(dim=1, dtype=torch.int32).contiguous()


def gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, wsum: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32/bf16 -> x @ (q * scale)^T [M, N] float32, x quantized per row to int8."""
    if x.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise ValueError(f"x must be [M, {qweight.shape[1]}], got {list(x.shape)}")
    if available():
        return torch.ops.kvferry_int8.gemm(x, qweight, scale, wsum)
    xq, d = quantize_rows(x)
    if x.shape[0] == 0:
        return torch.empty(0, qweight.shape[0])
    acc = _int_mm(xq, qweight)
    return acc.float() * d[:, None] * scale[None, :]


def kernel_gemm():  # noqa: ANN201
    """The C++ ``gemm`` itself, ``(x, qweight, scale, wsum) -> y``, for a
    caller that checked ``available()`` once (at load) and calls it many
    times a step: ``gemm`` reads the kernel switches' environment on every
    call (a draft head's depth makes three)."""
    if not available():
        raise RuntimeError("the C++ int8 matmul is not loaded")
    return torch.ops.kvferry_int8.gemm


def _int_mm(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    # torch._int_mm wants more than 16 rows on some builds: pad small batches.
    m = xq.shape[0]
    if m <= 16:
        xq = torch.cat([xq, xq.new_zeros(17 - m, xq.shape[1])])
    return torch._int_mm(xq, qweight.t())[:m]
