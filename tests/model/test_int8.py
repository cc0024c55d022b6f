"""int8 weights (W8A8): the kernel against float references on every ISA
path this CPU can build, the layer method, and a tiny Llama under
``--quantization int8`` against its float32 model.

Kernel checks, per output y[m, n]:

* exact: against (xq @ wq^T) * d[m] * s[n] with xq, d the activations
  quantized as the kernel does (per row, round half to even): the integer
  sum is exact, so only float32 rounding remains (rel. 1e-5 of the row's
  largest |terms| sum);
* against the float product x @ w^T of the unquantized operands: within
  sum_k (d[m] / 2) |w[n, k]| + |x[m, k]| (s[n] / 2) (+ the same float
  slack): each operand's rounding is at most half its step. On random
  Gaussian data that bound is ~1% of the row's |terms| sum, and the error
  measured is well under it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from safetensors.torch import load_file, save_file

from kvferry.config import EngineArgs
from kvferry.model import int8_gemm
from kvferry.model.layers import BatchInvariantConfig
from kvferry.model.layers.int8 import Int8Config, Int8LinearMethod
from kvferry.model.loader import load_model
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import make_tiny_checkpoint

N = 67  # odd: tails everywhere


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    iw = int8_gemm.quantize_weight(w)
    xq, d = int8_gemm.quantize_rows(x)
    terms = (x.abs() @ w.abs().T).amax(dim=1, keepdim=True) + 1e-30
    exact = (xq.double() @ iw.qweight.double().T) * d.double()[:, None] * iw.scale.double()[None, :]
    assert ((y.double() - exact).abs() <= 1e-5 * terms).all(), ((y.double() - exact).abs() / terms).max()
    bound = (d[:, None] / 2) * w.abs().sum(1)[None, :] + x.abs().sum(1)[:, None] * (iw.scale[None, :] / 2)
    assert ((y - x @ w.T).abs() <= bound + 1e-5 * terms).all(), ((y - x @ w.T).abs() / bound).max()


def _case(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m * 1000 + k)
    return torch.randn(m, k, generator=g), torch.randn(N, k, generator=g) * 0.05


@pytest.mark.skipif(not int8_gemm.available(), reason="the C++ int8 matmul did not build here")
@pytest.mark.parametrize("k", [64, 100, 2048])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 64])
def test_kernel(m, k):
    x, w = _case(m, k)
    iw = int8_gemm.quantize_weight(w)
    y = int8_gemm.gemm(x, iw.qweight, iw.scale, int8_gemm.row_sums(iw.qweight))
    check(y, x, w)
    # bf16 activations: the same kernel over x's bf16 values
    y16 = int8_gemm.gemm(x.bfloat16(), iw.qweight, iw.scale, int8_gemm.row_sums(iw.qweight))
    check(y16, x.bfloat16().float(), w)


def test_torch_fallback_matches(monkeypatch):
    x, w = _case(5, 256)
    iw = int8_gemm.quantize_weight(w)
    monkeypatch.setattr(int8_gemm, "available", lambda: False)
    check(int8_gemm.gemm(x, iw.qweight, iw.scale, int8_gemm.row_sums(iw.qweight)), x, w)


def test_edge_values():
    """-128 (a compressed-tensors checkpoint may hold it), zero rows of x and
    of w, and no rows: exact, on whichever path runs."""
    k = 192
    q = torch.randint(-128, 128, (N, k), dtype=torch.int8)
    q[0] = -128
    q[1] = 0
    s = torch.rand(N) + 0.5
    x = torch.randn(4, k)
    x[2] = 0
    x[3, :] = 1000.0  # every activation at the int8 maximum
    y = int8_gemm.gemm(x, q, s, int8_gemm.row_sums(q))
    xq, d = int8_gemm.quantize_rows(x)
    ref = (xq.double() @ q.double().T) * d.double()[:, None] * s.double()[None, :]
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(y[2], torch.zeros(N)) and torch.equal(y[:, 1], torch.zeros(4))
    assert int8_gemm.gemm(torch.zeros(0, k), q, s, int8_gemm.row_sums(q)).shape == (0, N)


_PROBE = """
import torch
from kvferry.model import int8_gemm, paged_kernel
{setup}
if not int8_gemm.available():
    print("no build"); raise SystemExit
from tests.model.test_int8 import check, _case
print("path", int8_gemm.kernel_path())
for m in (1, 3, 8, 9, 17, 64):
    for k in (64, 100, 2048):
        x, w = _case(m, k)
        iw = int8_gemm.quantize_weight(w)
        check(int8_gemm.gemm(x, iw.qweight, iw.scale, int8_gemm.row_sums(iw.qweight)), x, w)
print("int8 ok")
"""
# The AVX-VNNI build (256-bit vpdpbusd) an AVX-VNNI CPU without AVX-512 runs:
# built here by dropping AVX-512 but keeping AVX-VNNI (its own cache name).
_AVXVNNI = ("int8_gemm._cflags = lambda: paged_kernel._BASE_CFLAGS + ['-mno-avx512f']\n"
            "int8_gemm._library = paged_kernel.LazyLibrary(int8_gemm._load)")


@pytest.mark.parametrize("isa,setup,path", [("avx2", "", "avx2"), ("native", _AVXVNNI, "avxvnni")])
def test_other_isa_builds_are_right_too(isa, setup, path):
    """The vpmaddubsw path of AVX2-only CPUs (KVFERRY_KERNEL_ISA=avx2, the
    existing switch) and the AVX-VNNI one, built on this CPU where it can."""
    from kvferry.model.cpu_features import cpu_features

    flags = cpu_features().flags
    if path == "avxvnni" and "avx_vnni" not in flags:
        pytest.skip("this CPU has no AVX-VNNI")
    if path == "avx2" and "avx512f" not in flags and "avx_vnni" in flags:
        pytest.skip("the AVX2 build is the native AVX-VNNI one on this CPU")
    env = {**os.environ, "KVFERRY_KERNEL_ISA": isa, "KVFERRY_DISABLE_CPP_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", _PROBE.format(setup=setup)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    if "no build" in done.stdout:
        pytest.skip(f"the {path} build did not build here")
    assert f"path {path}" in done.stdout and "int8 ok" in done.stdout, done.stdout


# ---- the layer and the model ----


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("int8"), "llama", num_hidden_layers=3)


def _logits(path, quantization, rows: int = 24) -> torch.Tensor:
    m = load_model(str(path), dtype="float32", quantization=quantization)
    seq = [(7 * i + 3) % 300 + 3 for i in range(rows)]
    return PagedHarness(m.model).step({0: seq}, {0: rows})[0]


def test_tiny_llama_int8_against_float(tiny):
    loaded = load_model(str(tiny), dtype="float32", quantization="int8")
    lm = loaded.model
    lins = lm.linears()
    assert all(isinstance(lin.method, Int8LinearMethod) for lin in lins if lin.prefix != "lm_head")
    assert not isinstance(lm.logits_proj.method, Int8LinearMethod)  # the lm_head stays float
    # int8 weights only: no float matrix on any int8 layer
    int8_bytes = float_params = 0
    for lin in lins:
        if isinstance(lin.method, Int8LinearMethod):
            assert lin.weight is None and lin.qweight.dtype == torch.int8
            int8_bytes += lin.method.nbytes(lin)
            float_params += lin.in_features * lin.out_features
    # one byte a weight, plus 8 per output row (scale and row sum)
    assert int8_bytes == float_params + 8 * sum(lin.out_features for lin in lins if lin.weight is None)
    assert loaded.fingerprint != load_model(str(tiny), dtype="float32").fingerprint
    with pytest.raises(ValueError, match="keeps int8 weights"):  # --deterministic's plain methods
        lm.set_linear_config(BatchInvariantConfig())
    a, b = _logits(tiny, "int8"), _logits(tiny, None)
    da = (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs()
    # Teacher-forced over 24 positions of a random-weight model, whose near-flat logits make
    # near-ties common. Measured: top-1 agreement 22/24, |d logprob| mean 0.022, max 0.137.
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
    assert da.mean() < 0.06 and da.max() < 0.4, (da.mean(), da.max())


def test_int8_config_keeps_what_it_must_plain():
    cfg = Int8Config(ignore=["re:.*layers\\.1\\.mlp.*", "model.layers.0.self_attn.k_proj"])
    assert not isinstance(cfg.get_linear_method("lm_head"), Int8LinearMethod)
    assert not isinstance(cfg.get_linear_method("model.layers.1.mlp.gate_up_proj"), Int8LinearMethod)
    assert not isinstance(cfg.get_linear_method("model.layers.0.self_attn.qkv_proj"), Int8LinearMethod)
    assert isinstance(cfg.get_linear_method("model.layers.0.self_attn.o_proj"), Int8LinearMethod)
    assert isinstance(cfg.get_linear_method("model.layers.2.mlp.down_proj"), Int8LinearMethod)


_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True}}}}


def write_w8a8(hf, out, scheme=None, drop_scale: str | None = None):
    """``hf`` as llm-compressor writes a W8A8 int8 checkpoint: each linear's
    weight int8 with a weight_scale [out, 1] (float32 here), config.json's
    quantization_config saying so."""
    shutil.copytree(hf, out)
    tensors = {}
    for name, t in load_file(str(out / "model.safetensors")).items():
        if name.endswith(".weight") and name.split(".")[-2] in _LINEARS:
            iw = int8_gemm.quantize_weight(t)
            tensors[name] = iw.qweight
            if name != drop_scale:
                tensors[name + "_scale"] = iw.scale[:, None].clone()
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = scheme or W8A8
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_compressed_tensors_w8a8_loads_as_it_is(tiny, tmp_path):
    ct = write_w8a8(tiny, tmp_path / "w8a8")
    loaded = load_model(str(ct), dtype="float32")  # found from config.json, no flag needed
    assert all(isinstance(lin.method, Int8LinearMethod) for lin in loaded.model.linears() if lin.prefix != "lm_head")
    # The same int8 values and scales as quantizing the float checkpoint at load: the same logits.
    assert torch.equal(_logits(ct, None), _logits(tiny, "int8"))
    assert torch.equal(_logits(ct, "compressed-tensors"), _logits(ct, "int8"))
    with pytest.raises(ValueError, match="compressed-tensors int8 checkpoint: serve it with --quantization int8"):
        load_model(str(ct), dtype="float32", quantization="none")
    with pytest.raises(ValueError, match="needs a compressed-tensors checkpoint"):
        load_model(str(tiny), dtype="float32", quantization="compressed-tensors")


def test_compressed_tensors_other_schemes_are_refused(tiny, tmp_path):
    static = json.loads(json.dumps(W8A8))
    static["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(ValueError, match="input_activations dynamic is False; kvferry loads int8 W8A8 only"):
        load_model(str(write_w8a8(tiny, tmp_path / "static", static)), dtype="float32")
    grouped = json.loads(json.dumps(W8A8))
    grouped["config_groups"]["group_0"]["weights"].update(strategy="group", num_bits=4)
    with pytest.raises(ValueError, match="weights num_bits is 4"):
        load_model(str(write_w8a8(tiny, tmp_path / "w4", grouped)), dtype="float32")
    name = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=f"{name} has no weight_scale"):
        load_model(str(write_w8a8(tiny, tmp_path / "noscale", drop_scale=name)), dtype="float32")


@pytest.mark.parametrize("value", ["awq", "gptq", "fp8", "bitsandbytes", "gptq_marlin"])
def test_unsupported_quantization_names_the_supported(value):
    with pytest.raises(ValueError, match=f"quantization '{value}' is not supported; supported: gguf, int8, "
                                         "compressed-tensors, none"):
        EngineArgs(quantization=value)


# Mixtures of experts (experts int8 too): tests/model/test_moe_quant_int8.py
