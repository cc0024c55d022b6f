"""Fused elementwise ops of the decoder layer (``csrc/fused_ops.cpp``), built at first use.

``silu_and_mul(gate_up)``: ``[T, 2 * inter]`` (gate | up) -> ``[T, inter]``,
``silu(gate) * up`` with HF's roundings in one pass over memory, bit for bit
torch's ``F.silu(gate) * up`` (the same Sleef exp torch's silu kernel uses).

``rope_neox(x, cos, sin)``: rotate-half RoPE in one op, every product and
sum rounded to the dtype as torch's seven ops (and HF) round them.

``rms_norm(x, weight, eps)``: HF's RMSNorm, bit for bit ``weight *
F.rms_norm(x, ...)``, in one pass per row: the float32 squares summed in
at::sum's own order (so the mean is torch's to the bit), the normalization
and the weight.

``write_kv(k, v, k_cache, v_cache, slots)``: the step's new K/V rows into
their cache slots, one copy per token (``index_copy_`` elsewhere).

``add_rms_norm(x, residual, weight, eps)``: ``h = residual + x`` and
``rms_norm(h, ...)`` with the add in the same pass (the decoder
layer's residual add fused into the norm that follows it).

``argmax_rows(x)``: ``x.argmax(dim=-1)`` over float32 rows (greedy sampling),
the same index (first maximum; a NaN wins) in one vectorized pass.

Where an op is unavailable (``KVFERRY_DISABLE_CPP_KERNELS=1``,
``KVFERRY_DISABLE_FUSED_OPS=1``, no compiler, a failed build, a non-CPU
tensor) it is exactly the torch ops it replaces.

The build shares paged_kernel.py's machinery and cache folder
(``$KVFERRY_CACHE_DIR/torch_ext``), keyed by this source, the flags, torch's
version and the CPU. It is compiled for the vector level torch dispatches to
on this CPU (``torch.backends.cpu.get_cpu_capability()``, capped by
``KVFERRY_KERNEL_ISA``), so that at::vec picks the same exp as torch.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from kvferry import envs
from kvferry.model import paged_kernel
from kvferry.model.cpu_features import cpu_features
from kvferry.model.kv_cache_dtype import index_copy_into, is_fp8

_SOURCE = Path(__file__).parent / "csrc" / "fused_ops.cpp"
_library = paged_kernel.LazyLibrary(lambda: _load())


def fused_ops_disabled() -> bool:
    return paged_kernel.kernels_disabled() or envs.disabled(envs.DISABLE_FUSED_OPS)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * inter] -> [T, inter]."""
    if gate_up.device.type == "cpu" and fused_ops_available():
        return torch.ops.kvferry_fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] (head_dim contiguous), cos/sin [T, 1, head_dim // 2]
    in x's dtype -> rotate-half RoPE, [T, heads, head_dim] contiguous."""
    if x.device.type == "cpu" and x.stride(-1) == 1 and x.numel() and fused_ops_available():
        n = x.shape[0]
        return torch.ops.kvferry_fused.rope_neox(x, cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous())
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: ``weight * F.rms_norm(x, (dim,), None, eps)``, bit for bit,
    in one pass per row (the squares summed in torch's own order)."""
    if (x.device.type == "cpu" and x.dim() == 2 and x.stride(-1) == 1 and weight.dtype == x.dtype
            and fused_ops_available()):
        return torch.ops.kvferry_fused.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block's residual add and the RMSNorm after it:
    ``h = residual + x`` and ``rms_norm(h, weight, eps)``, bit for bit, in one
    pass fewer over memory."""
    if (x.device.type == "cpu" and x.dim() == 2 and residual.shape == x.shape and x.stride(-1) == 1
            and residual.stride(-1) == 1 and residual.dtype == x.dtype == weight.dtype and fused_ops_available()):
        return torch.ops.kvferry_fused.add_rms_norm(x, residual, weight, eps)
    h = residual + x
    return h, rms_norm(h, weight, eps)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, KVH, D] into k_cache / v_cache [slots, KVH, D] at ``slots``
    [T]: ``index_copy_`` (with k / v cast to the cache's dtype), one row
    copy per token on CPU (converting bf16 / float32 rows as it goes into
    an fp8 cache, rounded as ``kv_cache_dtype.to_cache_dtype`` rounds)."""
    same = k.dtype == v.dtype == k_cache.dtype
    to_fp8 = is_fp8(k_cache.dtype) and k.dtype == v.dtype and k.dtype in (torch.bfloat16, torch.float32)
    if (k.device.type == "cpu" and (same or to_fp8) and k.stride(-1) == 1 and v.stride(-1) == 1
            and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2] and fused_ops_available()):
        torch.ops.kvferry_fused.write_kv(k, v, k_cache, v_cache, slots)
        return
    index_copy_into(k_cache, 0, slots, k)
    index_copy_into(v_cache, 0, slots, v)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] -> [rows] int64: ``x.argmax(dim=-1)`` (first maximum; a NaN wins)."""
    if (x.device.type == "cpu" and x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0
            and x.stride(-1) == 1 and fused_ops_available()):
        return torch.ops.kvferry_fused.argmax_rows(x)
    return x.argmax(dim=-1)


def fused_ops_available() -> bool:
    """True once the library is loaded (building or loading it on the first call)."""
    if fused_ops_disabled():
        return False  # checked per call, so tests can switch paths per test
    return _library.available()


def _capability() -> str:
    """The at::vec level to compile: torch's dispatch level, capped by the ISA build."""
    level = cpu_features().torch_capability
    if paged_kernel.kernel_isa() == "avx2" and level.startswith("AVX512"):
        level = "AVX2"
    return level if level in ("AVX512", "AVX2") else "DEFAULT"


def _cflags() -> list[str]:
    level = _capability()
    # -ffp-contract=off: no fused multiply-adds, so that each product is
    # rounded before the sum as in torch's separate ops.
    flags = paged_kernel._cflags() + ["-ffp-contract=off", f"-DCPU_CAPABILITY={level}"]
    return flags + ([f"-DCPU_CAPABILITY_{level}"] if level != "DEFAULT" else [])


def _load() -> bool:
    return paged_kernel.try_load_library("kvferry_fused", _SOURCE, _cflags(), "the C++ fused ops", "torch ops")
