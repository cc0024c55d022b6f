"""A tensor-parallel shard's one-call C++ layer (layer_op.run_tp_layer:
tp_attention, all-reduce, tp_mlp, all-reduce) gives the Python TP layer's
results to the bit, its all-reduces in the same places.

One process holds rank 0's shard; its group is a stand-in whose sum doubles
each partial product (two ranks with the same partial sums) and whose
gather repeats the logits, so that a path that skipped or moved an
all-reduce would differ. tests/parallel/test_tensor_parallel.py runs real
ranks against HF; a .gguf's blocks over ranks run the op too (kind 100 + t)."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from kvferry.model import layer_op, quant, small_gemm
from kvferry.model.layers.gguf import GGUFLinearMethod
from kvferry.model.layers.parallel import TPShard
from kvferry.model.loader import load_model
from tests.model.own_cache import own_model_cache
from tests.model.paged_harness import PagedHarness
from tests.model.test_layer_op import PLANS, SEQS, _same
from tests.tiny_models import make_tiny_checkpoint, write_tiny_gguf


class Doubling:
    """Two ranks' collectives where both ranks hold this rank's tensors."""

    def __init__(self) -> None:
        self.sums = 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.sums += 1
        return tensor.add_(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return torch.cat([tensor, tensor], dim=dim)


def _run(model, monkeypatch, disabled: str) -> tuple[list[dict[int, torch.Tensor]], torch.Tensor, set[str], int]:
    monkeypatch.setenv("KVFERRY_DISABLE_LAYER_OP", disabled)
    group = model.shard.group = Doubling()
    harness = PagedHarness(model, seed=3)
    c = model.config  # this rank's KV heads only
    harness.kv_cache = torch.full((c.num_hidden_layers, 2, 64, 4, model.num_kv_heads, c.head_dim), float("nan"),
                                  dtype=model.dtype)
    with profile() as prof:
        logits = [harness.step(SEQS, plan) for plan in PLANS]
    return logits, harness.kv_cache, {e.key for e in prof.key_averages()}, group.sums


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("qwen2", "float32"), ("qwen3", "float32"),
                                        ("llama-Q8_0", "float32")])
def test_tp_layer_op_equals_python_tp_layer(tmp_path, monkeypatch, arch, dtype):
    if not small_gemm.available(getattr(torch, dtype)) or not layer_op.available():
        pytest.skip(f"small_gemm for {dtype} or the layer op is not available on this CPU / build")
    arch, _, qtype = arch.partition("-")
    if qtype and not quant.available():
        pytest.skip("the C++ quantized matmul did not build here")
    with own_model_cache(tmp_path):
        path = make_tiny_checkpoint(tmp_path, arch, num_hidden_layers=2)
        if qtype:  # GGUF blocks, each rank its slice of them (kinds 100 + t in the op)
            path = write_tiny_gguf(path, tmp_path / f"tiny-{qtype}.gguf", qtype=qtype)
        model = load_model(str(path), dtype=dtype, quantization="gguf" if qtype else None,
                           shard=TPShard(0, 2)).model
    if qtype:  # the row-parallel slices too are whole blocks here
        assert all(isinstance(lin.method, GGUFLinearMethod) for lin in (model.layers[0].self_attn.o_proj,
                                                                        model.layers[0].mlp.down_proj))
    fast, fast_cache, fast_ops, fast_sums = _run(model, monkeypatch, "0")
    slow, slow_cache, slow_ops, slow_sums = _run(model, monkeypatch, "1")
    assert "kvferry_layer::tp_attention" in fast_ops and "kvferry_layer::tp_mlp" in fast_ops
    assert "kvferry_layer::tp_attention" not in slow_ops
    # The embedding's sum and two a layer, every step, on either path.
    assert fast_sums == slow_sums == len(PLANS) * (1 + 2 * model.config.num_hidden_layers)
    for got, want in zip(fast, slow, strict=True):
        assert got.keys() == want.keys()
        for rid in got:
            assert _same(got[rid], want[rid]), f"request {rid}: logits differ"
    assert _same(fast_cache, slow_cache)
