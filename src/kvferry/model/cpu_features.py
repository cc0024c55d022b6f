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

A listed flag is not always a usable one: Linux hands out AMX's tile state
only to a process that asks for it (``arch_prctl(ARCH_REQ_XCOMP_PERM)``),
and a kernel or sandbox may refuse. Where it does, the ``amx_*`` flags are
dropped here, so every choice below (bf16 verdict, small-GEMM kernel,
benchmark records) sees the CPU as it really runs: AVX-512 without AMX.
"""
from __future__ import annotations

import ctypes
import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from kvferry import envs

# Linux x86-64: the arch_prctl syscall and its extended-state permission calls.
_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_AMX_FLAGS = frozenset(("amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "amx_complex"))

# Flags that mean bf16 dot products run in hardware.
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    flags: frozenset[str]
    torch_capability: str  # torch's kernel dispatch level: "AVX512", "AVX2", "DEFAULT", ...
    model_name: str
    # /proc/cpuinfo's vendor_id, cpu family and model (x86; "" and 0 elsewhere):
    # kernel settings tuned per core generation (quant/kernels.py) read them.
    vendor: str = ""
    family: int = 0
    model: int = 0

    @property
    def amd_zen5_or_later(self) -> bool:
        """AMD family 26 (0x1A, Zen 5) or later: 512-bit ops at full width, where
        Zen 4 (family 25) splits them in two."""
        return self.vendor == "AuthenticAMD" and self.family >= 26

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


def parse_cpu_id(text: str) -> tuple[str, int, int]:
    """(vendor_id, cpu family, model) of the first CPU in /proc/cpuinfo text;
    ("", 0, 0) for what it does not list (non-x86)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key in ("vendor_id", "cpu family", "model") and key not in found:
            found[key] = value.strip()

    def number(key: str) -> int:
        v = found.get(key, "")
        return int(v) if v.isdigit() else 0

    return found.get("vendor_id", ""), number("cpu family"), number("model")


def amx_permitted() -> bool:
    """Whether this process may use AMX tiles: asks the kernel for the tile
    data permission (what oneDNN also does before its first AMX kernel) and
    reads it back. False off x86-64 Linux and wherever the kernel refuses."""
    if platform.machine() not in ("x86_64", "AMD64") or platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
        granted = ctypes.c_uint64(0)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(granted)) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return bool(granted.value >> _XFEATURE_XTILEDATA & 1)


@functools.cache
def cpu_features() -> CpuFeatures:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags, so no bf16 and a machine-name fingerprint
        text = ""
    flags, model = parse_cpuinfo(text)
    vendor, family, model_number = parse_cpu_id(text)
    if flags & _AMX_FLAGS and not amx_permitted():
        flags -= _AMX_FLAGS  # listed but refused: the CPU runs as AVX-512 here
    return CpuFeatures(flags=flags, torch_capability=torch.backends.cpu.get_cpu_capability(), model_name=model,
                       vendor=vendor, family=family, model=model_number)


def auto_cpu_dtype() -> torch.dtype:
    """The dtype ``dtype="auto"`` serves on CPU, whatever the checkpoint says."""
    return torch.bfloat16 if cpu_features().native_bf16 else torch.float32
