"""CPU feature detection and the dtype "auto" resolves to from it."""
from __future__ import annotations

import torch

from kvferry.model.cpu_features import CpuFeatures, auto_cpu_dtype, cpu_features, parse_cpu_id, parse_cpuinfo
from kvferry.model.loader import read_config, resolve_dtype
from tests.tiny_models import make_tiny_checkpoint

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni
processor\t: 1
flags\t\t: fpu ignored_second_cpu
"""
AVX2_ONLY = "model name\t: Intel Xeon E5\nflags\t\t: fpu sse2 avx avx2 fma\n"
ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni avx_vnni
processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
"""


def _features(text: str) -> CpuFeatures:
    flags, model = parse_cpuinfo(text)
    return CpuFeatures(flags=flags, torch_capability="AVX2", model_name=model)


def test_parse_cpuinfo_reads_first_cpu():
    flags, model = parse_cpuinfo(ZEN4)
    assert model == "AMD EPYC 9654"
    assert {"avx512f", "avx512_bf16"} <= flags
    assert "ignored_second_cpu" not in flags


def _features_id(text: str) -> CpuFeatures:
    vendor, family, model = parse_cpu_id(text)
    return CpuFeatures(flags=parse_cpuinfo(text)[0], torch_capability="AVX512", model_name="",
                       vendor=vendor, family=family, model=model)


def test_parse_cpu_id_reads_first_cpu_and_tells_zen5():
    """vendor, family and model of the first CPU; AMD family 26 (Zen 5) on,
    not Zen 4 (family 25), not Intel nor a CPU listing none."""
    assert parse_cpu_id(ZEN5) == ("AuthenticAMD", 26, 2)
    zen4 = ZEN4.replace("model name", "cpu family\t: 25\nmodel\t\t: 17\nmodel name")
    assert parse_cpu_id(zen4) == ("AuthenticAMD", 25, 17)
    assert parse_cpu_id(AVX2_ONLY) == ("", 0, 0)
    assert _features_id(ZEN5).amd_zen5_or_later
    assert not _features_id(zen4).amd_zen5_or_later
    assert not _features_id(AVX2_ONLY).amd_zen5_or_later
    intel = "vendor_id\t: GenuineIntel\ncpu family\t: 26\nmodel\t: 1\n"
    assert not _features_id(intel).amd_zen5_or_later


def test_native_bf16_from_flags(monkeypatch):
    monkeypatch.delenv("KVFERRY_CPU_BF16", raising=False)
    zen4, avx2 = _features(ZEN4), _features(AVX2_ONLY)
    assert zen4.native_bf16 and zen4.avx512
    assert not avx2.native_bf16 and not avx2.avx512
    assert _features("flags\t: avx2 amx_bf16 amx_tile\n").native_bf16
    # The build cache key differs between the two machines.
    assert zen4.fingerprint != avx2.fingerprint
    assert "avx512_bf16" in zen4.describe() and "EPYC" in zen4.describe()


def test_override(monkeypatch):
    monkeypatch.setenv("KVFERRY_CPU_BF16", "0")
    assert not _features(ZEN4).native_bf16
    monkeypatch.setenv("KVFERRY_CPU_BF16", "1")
    assert _features(AVX2_ONLY).native_bf16


def test_this_machine_matches_proc_cpuinfo(monkeypatch):
    monkeypatch.delenv("KVFERRY_CPU_BF16", raising=False)
    with open("/proc/cpuinfo") as f:
        text = f.read()
    native = "avx512_bf16" in text or "amx_bf16" in text
    assert cpu_features().native_bf16 == native
    assert auto_cpu_dtype() == (torch.bfloat16 if native else torch.float32)
    assert cpu_features().torch_capability == torch.backends.cpu.get_cpu_capability()
    assert (cpu_features().vendor, cpu_features().family, cpu_features().model) == parse_cpu_id(text)


def test_auto_dtype_ignores_saved_dtype_on_cpu(tmp_path, monkeypatch, caplog):
    """A float32 checkpoint is served in bf16 on a native-bf16 CPU, float32 elsewhere;
    explicit dtypes are kept; CUDA is unaffected."""
    config = read_config(make_tiny_checkpoint(tmp_path, "llama"))
    assert config.torch_dtype == "float32"
    monkeypatch.setenv("KVFERRY_CPU_BF16", "1")
    with caplog.at_level("INFO", logger="kvferry.model.loader"):
        assert resolve_dtype("auto", config, "cpu") == torch.bfloat16
    assert "dtype auto -> bfloat16" in caplog.text
    assert resolve_dtype("float32", config, "cpu") == torch.float32
    monkeypatch.setenv("KVFERRY_CPU_BF16", "0")
    assert resolve_dtype("auto", config, "cpu") == torch.float32
    assert resolve_dtype("bfloat16", config, "cpu") == torch.bfloat16
    assert resolve_dtype("auto", config, "cuda") == torch.bfloat16


def test_amx_flags_kept_only_where_the_kernel_grants_tiles():
    """In a fresh process (no permission asked yet): AMX counts only where
    the CPU lists it and the kernel grants the tile state."""
    import subprocess
    import sys

    code = ("from kvferry.model.cpu_features import amx_permitted, cpu_features;"
            "print(int(amx_permitted()), int('amx_bf16' in cpu_features().flags))")
    permitted, kept = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                     check=True).stdout.split()
    with open("/proc/cpuinfo") as f:
        listed = " amx_tile" in f.read()
    if not listed:
        assert kept == "0"
    assert kept == ("1" if listed and permitted == "1" else "0")
