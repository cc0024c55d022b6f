"""What this CPU can do, detected once at run time.

Two decisions hang on it:

* ``dtype="auto"`` on CPU: bfloat16 where the CPU multiplies bf16 natively
  (AVX512-BF16 or AMX-BF16: oneDNN then runs bf16 matmuls at about twice the
  float32 rate and every weight read is half the bytes), float32 elsewhere
  (on AVX2-only CPUs bf16 matmul is emulated and several times slower).
* The C++ kernels' build: they are compiled with ``-march=native``, so the
  build cache key includes the CPU's feature flags (``fingerprint``).

Sources: ``/proc/cpuinfo`` flags (Linux x86 and Arm) and torch's own dispatch
level (``torch.backends.cpu.get_cpu_capability()``: "AVX512", "AVX2", ...).
``KVFERRY_CPU_BF16=0|1`` overrides the bf16 verdict (for tests and for
comparing both dtypes on one machine).
"""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from kvferry import envs

# Flags that mean bf16 dot products run in hardware.
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    flags: frozenset[str]
    torch_capability: str  # torch's kernel dispatch level: "AVX512", "AVX2", "DEFAULT", ...
    model_name: str

    @property
    def native_bf16(self) -> bool:
        override = envs.cpu_bf16()
        if override is not None:
            return override
        return any(f in self.flags for f in _NATIVE_BF16_FLAGS)

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def fingerprint(self) -> str:
        """Stable text naming the instruction sets a native build may use."""
        return " ".join(sorted(self.flags)) or platform.machine() + platform.processor()

    def describe(self) -> str:
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in self.flags]
        return f"{self.model_name or platform.machine()} [{' '.join(isa) or 'no AVX'}; torch {self.torch_capability}]"


def parse_cpuinfo(text: str) -> tuple[frozenset[str], str]:
    """(flags of the first CPU, model name) from /proc/cpuinfo text."""
    flags: frozenset[str] = frozenset()
    model = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
        elif key == "model name" and not model:
            model = value.strip()
    return flags, model


@functools.cache
def cpu_features() -> CpuFeatures:
    try:
        flags, model = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux: no flags, so no bf16 and a machine-name fingerprint
        flags, model = frozenset(), ""
    return CpuFeatures(flags=flags, torch_capability=torch.backends.cpu.get_cpu_capability(), model_name=model)


def auto_cpu_dtype() -> torch.dtype:
    """The dtype ``dtype="auto"`` serves on CPU, whatever the checkpoint says."""
    return torch.bfloat16 if cpu_features().native_bf16 else torch.float32
