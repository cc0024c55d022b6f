"""The one-call C++ decoder layer (layer_op.py): taken where it applies, not
where it does not, and the Python layer's results to the bit."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.profiler import profile

from kvferry.model import layer_op, small_gemm
from kvferry.model.loader import load_model
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import load_hf_model, make_tiny_checkpoint

OP = "kvferry_layer::decoder_layer"

# Chunked prefill over cached context, a new prompt beside decodes, decodes.
SEQS = {0: list(range(3, 40)), 1: list(range(50, 70)), 2: list(range(100, 130))}
PLANS = [{0: 9, 1: 6}, {0: 5, 1: 1}, {0: 1, 1: 1, 2: 12}, {0: 1, 1: 1, 2: 1}, {0: 1, 2: 1}]


def _needs_op(dtype: torch.dtype) -> None:
    if not small_gemm.available(dtype) or not layer_op.available():
        pytest.skip(f"small_gemm for {dtype} or the layer op is not available on this CPU / build")


def _run(model, monkeypatch, disabled: str,
         cache_dtype: torch.dtype | None = None) -> tuple[list[dict[int, torch.Tensor]], torch.Tensor, set[str]]:
    """Every plan through a fresh harness (same seed: same block tables)
    with the layer op on or off; the logits, the KV cache and the ops seen."""
    monkeypatch.setenv("KVFERRY_DISABLE_LAYER_OP", disabled)
    harness = PagedHarness(model, seed=3, cache_dtype=cache_dtype)
    with profile() as prof:
        logits = [harness.step(SEQS, plan) for plan in PLANS]
    return logits, harness.kv_cache, {e.key for e in prof.key_averages()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit, NaN (never-written cache slots) where the other has NaN."""
    if a.dtype in (torch.float8_e5m2, torch.float8_e4m3fn):
        a, b = a.float(), b.float()
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


@pytest.mark.parametrize("arch,dtype,matmuls", [
    ("llama", "float32", "small_gemm"), ("llama", "bfloat16", "small_gemm"),
    ("llama", "float32", "onednn"), ("llama", "bfloat16", "onednn"),
    ("qwen2", "float32", "small_gemm"),  # the biased qkv goes to oneDNN, the other matmuls to small_gemm
    ("qwen3", "float32", "small_gemm"), ("qwen3", "bfloat16", "small_gemm"),  # per-head q/k norms
])
def test_layer_op_equals_python_layer(tmp_path, monkeypatch, arch, dtype, matmuls):
    if matmuls == "small_gemm":
        _needs_op(getattr(torch, dtype))
    elif not layer_op.available() or not torch.backends.mkldnn.is_available():
        pytest.skip("the layer op or oneDNN is not available")
    else:  # oneDNN's packed matmuls, as on an AMX machine
        monkeypatch.setenv("KVFERRY_DISABLE_SMALL_GEMM", "1")
    path = make_tiny_checkpoint(tmp_path, arch, num_hidden_layers=3)
    model = load_model(str(path), dtype=dtype).model
    fast, fast_cache, fast_ops = _run(model, monkeypatch, "0")
    attn = model.layers[0].self_attn
    if matmuls == "onednn" and attn.o_proj.packed is None:
        pytest.skip(f"oneDNN does not pack {dtype} weights on this CPU")
    kinds = {"small" if p.small is not None else "onednn" for p in (attn.qkv_proj.packed, attn.o_proj.packed)}
    assert kinds == ({"onednn"} if matmuls == "onednn" else {"small", "onednn"} if arch == "qwen2" else {"small"})
    slow, slow_cache, slow_ops = _run(model, monkeypatch, "1")
    assert OP in fast_ops and OP not in slow_ops
    for got, want in zip(fast, slow, strict=True):
        assert got.keys() == want.keys()
        for rid in got:
            assert _same(got[rid], want[rid]), f"request {rid}: logits differ"
    assert _same(fast_cache, slow_cache)  # the same K/V written to the same slots
    if dtype == "float32":  # and both are HF's
        with torch.no_grad():
            want = load_hf_model(path)(torch.tensor([SEQS[0][:16]])).logits[0]
        got = torch.cat([fast[0][0], fast[1][0], fast[2][0], fast[3][0]])  # request 0's first 16 tokens
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fp8", [torch.float8_e5m2, torch.float8_e4m3fn], ids=["e5m2", "e4m3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_op_over_an_fp8_cache_equals_python_layer(tmp_path, monkeypatch, dtype, fp8):
    """--kv-cache-dtype fp8_e5m2 / fp8_e4m3: the op writes and reads the same
    fp8 K/V as the Python layer (both call write_kv and the paged kernel)."""
    _needs_op(getattr(torch, dtype))
    model = load_model(str(make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=3)), dtype=dtype).model
    fast, fast_cache, fast_ops = _run(model, monkeypatch, "0", fp8)
    slow, slow_cache, slow_ops = _run(model, monkeypatch, "1", fp8)
    assert OP in fast_ops and OP not in slow_ops
    for got, want in zip(fast, slow, strict=True):
        for rid in got:
            assert _same(got[rid], want[rid]), f"request {rid}: logits differ"
    assert fast_cache.dtype == fp8 and _same(fast_cache, slow_cache)


def test_layer_op_over_more_rows_than_exact_rows(tmp_path, monkeypatch):
    """A step of more than EXACT_ROWS tokens pads oneDNN's rows as linear.py does."""
    from kvferry.model.linear import EXACT_ROWS

    if not layer_op.available() or not torch.backends.mkldnn.is_available():
        pytest.skip("the layer op or oneDNN is not available")
    monkeypatch.setenv("KVFERRY_DISABLE_SMALL_GEMM", "1")
    model = load_model(str(make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=2)), dtype="float32").model
    seqs = {0: list(range(3, 3 + EXACT_ROWS + 9))}
    outs = []
    for disabled in ("0", "1"):
        monkeypatch.setenv("KVFERRY_DISABLE_LAYER_OP", disabled)
        with profile() as prof:
            outs.append(PagedHarness(model, num_blocks=64).step(seqs, {0: EXACT_ROWS + 9})[0])
        assert (OP in {e.key for e in prof.key_averages()}) == (disabled == "0")
    assert _same(outs[0], outs[1])


def test_layer_op_not_taken_for_a_chunk_left_to_sdpa(tmp_path, monkeypatch):
    """A chunk longer than the kernel takes goes to SDPA: that step runs the Python layer."""
    from kvferry.model import attention

    _needs_op(torch.float32)
    model = load_model(str(make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=2)), dtype="float32").model
    monkeypatch.setenv("KVFERRY_DISABLE_LAYER_OP", "0")
    harness = PagedHarness(model)
    with profile() as prof:
        harness.step(SEQS, {0: 5})  # within the kernel's chunk limit
    assert OP in {e.key for e in prof.key_averages()}
    monkeypatch.setattr(attention, "_KERNEL_MAX_PREFILL_TOKENS", 4)
    with profile() as prof:
        harness.step(SEQS, {0: 8})
    assert OP not in {e.key for e in prof.key_averages()}


def test_layer_op_in_a_process_without_small_gemm(tmp_path):
    """With small_gemm off its library is never loaded: the op must not need it."""
    import subprocess
    import sys

    if not layer_op.available() or not torch.backends.mkldnn.is_available():
        pytest.skip("the layer op or oneDNN is not available")
    path = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    script = f"""
import torch
from torch.profiler import profile
from kvferry.model.loader import load_model
from tests.model.paged_harness import PagedHarness
model = load_model({str(path)!r}, dtype="float32").model
with profile() as prof:
    PagedHarness(model).step({{0: list(range(3, 20))}}, {{0: 17}})
assert model.layers[0].mlp.down_proj.packed.small is None
from kvferry.model import small_gemm
assert small_gemm._library._available is None  # its library never loaded
print("{OP}" in {{e.key for e in prof.key_averages()}})
"""
    env = {**os.environ, "KVFERRY_DISABLE_SMALL_GEMM": "1", "KVFERRY_DISABLE_LAYER_OP": "0"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_layer_args_record_is_the_ops_schema_order():
    """LayerArgs, the one record of a layer's arguments both paths take,
    names the C++ ops' arguments in their order: decoder_layer's after its
    step tensors (LayerStack.add's), tp_attention's and tp_mlp's parts of it."""
    if not layer_op.available():
        pytest.skip("the layer op is not available on this build")
    ops = torch.ops.kvferry_layer

    def names(op, after: str) -> list[str]:
        args = [a.name for a in op.default._schema.arguments]
        return args[args.index(after) + 1:]

    fields = list(layer_op.LayerArgs._fields)
    assert fields == names(ops.decoder_layer, "tree_masks")
    by_name = layer_op.LayerArgs(*fields)  # each field holding its own name
    assert list(by_name.attention()) == names(ops.tp_attention, "tree_masks")
    assert list(by_name.mlp()) == names(ops.tp_mlp, "h")
