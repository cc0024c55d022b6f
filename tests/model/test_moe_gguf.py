"""GGUF mixtures of experts (model/moe_convert.py): llama.cpp's layout of a
tiny MoE checkpoint, written with the ``gguf`` package, loads and gives HF's
logits (float32 tensors: HF's own; Q8_0: HF's with every quantized matrix
round-tripped through Q8_0)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvferry.model import gguf_convert
from kvferry.model.loader import load_model
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import load_hf_model
from tests.tiny_moe_models import make_tiny_moe_checkpoint, write_tiny_moe_gguf

ATOL = 1e-4
CASES = ["qwen3_moe_top2", "qwen2_moe_top2", "mixtral_top2"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe_gguf")


def _load_gguf(root, gguf_file):
    """What load_model does with a .gguf and --quantization none, converting
    into the test's folder (not KVFERRY_CACHE_DIR: the built kernels live there)."""
    return load_model(str(gguf_convert.convert_gguf(gguf_file, out_root=root / "converted")), dtype="float32")


def _logits(model, ids: list[int]) -> torch.Tensor:
    return PagedHarness(model).step({0: ids}, {0: len(ids)})[0]


def _q8_round_trip(hf) -> None:
    """Every matrix the GGUF writer quantizes, through Q8_0 and back (blocks run along rows)."""
    import gguf

    kind = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "proj" in name and p.dim() >= 2:
                a = p.detach().float().numpy()
                back = gguf.quants.dequantize(gguf.quants.quantize(a, kind), kind).reshape(a.shape)
                p.copy_(torch.from_numpy(np.ascontiguousarray(back)))


@pytest.mark.parametrize("case", CASES)
def test_f32_gguf_moe_matches_hf(root, case):
    path = make_tiny_moe_checkpoint(root, case)
    gguf_file = write_tiny_moe_gguf(path, root / f"{case}.gguf")
    loaded = _load_gguf(root, gguf_file)
    want = load_model(str(path), dtype="float32").config
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "shared_expert_intermediate_size", "mlp_only_layers", "attention_bias", "qk_norm"):
        assert getattr(loaded.config, field) == getattr(want, field), field
    ids = [random.Random(7).randrange(3, want.vocab_size) for _ in range(11)]
    with torch.no_grad():
        ref = load_hf_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(loaded.model, ids), ref, atol=ATOL, rtol=0)


def test_q8_0_experts_dequantize_exactly(root):
    path = make_tiny_moe_checkpoint(root, "qwen2_moe_top2")
    gguf_file = write_tiny_moe_gguf(path, root / "qwen2_moe_top2-q8_0.gguf", qtype="Q8_0")
    loaded = _load_gguf(root, gguf_file)
    hf = load_hf_model(path)
    _q8_round_trip(hf)
    ids = [random.Random(8).randrange(3, loaded.config.vocab_size) for _ in range(9)]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(loaded.model, ids), ref, atol=ATOL, rtol=0)
    # --quantization gguf keeps the experts in their blocks: tests/model/test_moe_quant_gguf.py
