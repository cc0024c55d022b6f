"""Quantized GGUF tensors: dequantized at conversion, logged, or refused by type name.

The files are written here with the ``gguf`` package as llama.cpp lays them
out: 2-D weights quantized along their rows, norms kept F32. The package
quantizes Q8_0 (and Q4_0, Q5_*) itself but no K-quant, so Q4_K blocks are
packed by ``quantize_q4_k`` below, the inverse of ``gguf``'s own Q4_K
dequantizer.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvferry import envs
from kvferry.model import gguf_convert
from kvferry.model.loader import load_model
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import _gguf_hparams, _gguf_name, _gguf_tokenizer, load_hf_model, make_tiny_checkpoint

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
SEQ = list(range(3, 3 + 19))


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    """Conversions into tmp; built C++ kernels still from the shared cache
    (rebuilding them cold takes minutes)."""
    kernels = envs.cache_dir() / "torch_ext"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "torch_ext").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("KVFERRY_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # Rows of 256 (K-quant super-blocks); hidden 256 is still a ~2 MB model.
    # HF's usual init scale (not tiny_models' 0.1): a random model that
    # amplifies weight noise as little as trained ones do.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gguf-types"), "llama",
                                hidden_size=256, intermediate_size=512, initializer_range=0.02)


@pytest.fixture(scope="module")
def float_logits(checkpoint) -> torch.Tensor:
    with torch.no_grad():
        return load_hf_model(checkpoint)(torch.tensor([SEQ])).logits[0]


# ---- writing quantized files ----

def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> Q4_K bytes [rows, cols / 256 * 144].

    Per super-block of 256: 8 sub-blocks of 32 with a 6-bit scale and min
    each, themselves scaled by the block's float16 d and dmin; values are
    4-bit, value = d * sc * q - dmin * m."""
    rows = x.shape[0]
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    n = sub.shape[0]
    mn = np.maximum(-sub.min(-1), 0.0)
    step = (sub.max(-1) + mn) / 15
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = (mn.max(-1) / 63).astype(np.float16)
    d32 = np.where(d == 0, 1, d).astype(np.float32)[:, None]
    dmin32 = np.where(dmin == 0, 1, dmin).astype(np.float32)[:, None]
    sc = np.clip(np.ceil(step / d32), 1, 63).astype(np.uint8)
    m = np.clip(np.round(mn / dmin32), 0, 63).astype(np.uint8)
    q = np.clip(np.round((sub + (dmin32 * m)[..., None]) / (d32 * sc)[..., None]), 0, 15).astype(np.uint8)
    scales = np.empty((n, 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] & 0x30) << 2)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] & 0x30) << 2)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)
    blocks = np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), scales, qs], axis=1)
    return blocks.reshape(rows, -1)


def quantize(x: np.ndarray, qtype: Q) -> np.ndarray:
    return quantize_q4_k(x) if qtype == Q.Q4_K else gguf.quants.quantize(x, qtype)


def write_quantized_gguf(hf_folder: Path, out_file: Path, qtype: Q) -> Path:
    """``hf_folder`` as a llama GGUF with every 2-D weight in ``qtype``."""
    cfg = json.loads((hf_folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(out_file), "llama")
    _gguf_hparams(w, cfg)
    _gguf_tokenizer(w, hf_folder, "default")
    for name, t in load_file(str(hf_folder / "model.safetensors")).items():
        if ".q_proj." in name:
            t = gguf_convert.permute_qk(t, cfg["num_attention_heads"])
        elif ".k_proj." in name:
            t = gguf_convert.permute_qk(t, cfg["num_key_value_heads"])
        array = t.float().numpy()
        if array.ndim == 2:
            w.add_tensor(_gguf_name(name), quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_file


def round_tripped_checkpoint(hf_folder: Path, out: Path, qtype: Q) -> Path:
    """A copy of ``hf_folder`` whose 2-D weights went through ``qtype`` and
    back: the float model the quantized GGUF encodes. Blocks run along rows,
    so quantizing before or after the Q/K row permutation is the same."""
    shutil.copytree(hf_folder, out)
    tensors = {name: torch.from_numpy(gguf.quants.dequantize(quantize(t.numpy(), qtype), qtype).reshape(t.shape))
               if t.ndim == 2 else t
               for name, t in load_file(str(hf_folder / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def served_logits(path: Path, quantization: str = "none") -> torch.Tensor:
    """The expanded path's logits (``quantization="none"``; these tests check its
    dequantization exactly) or the blocks path's ("gguf")."""
    loaded = load_model(str(path), dtype="float32", quantization=quantization)
    return PagedHarness(loaded.model).step({0: SEQ}, {0: len(SEQ)})[0]


# ---- tests ----

def test_q4_k_packing_matches_gguf_dequantizer():
    x = np.random.default_rng(0).normal(0, 0.1, (4, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q4_k(x), Q.Q4_K)
    # 4-bit steps over each 32-value range (~0.5 here): error within half a step plus f16 scale rounding.
    assert np.abs(back - x).max() < 0.03
    assert np.abs(back - x).mean() < 0.01


def test_supported_types_are_what_gguf_dequantizes():
    supported = gguf_convert.supported_tensor_types()
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"):
        assert name in supported
    for name in ("Q8_K", "I32", "F64"):
        assert name not in supported


# Two checks. Exact (atol 1e-4, float32 summation order): the served model
# is HF transformers running the dequantized weights, so the block layout,
# the Q/K unpermutation and the cast are right. Close: the logits' relative
# RMS error against the float model is within 4x the weights' own (Q8_0
# ~0.5%, this test's simple Q4_K packing ~8%); this model amplifies it
# ~2.4x, and a wrong dequantization would be ~100%.
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_quantized_gguf_serves_its_weights(tmp_path, checkpoint, float_logits, caplog, qtype):
    gguf_file = write_quantized_gguf(checkpoint, tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    with caplog.at_level(logging.INFO, logger="kvferry.model.gguf_convert"):
        got = served_logits(gguf_file)
    # 7 weights per layer x 2 layers + embedding + output
    assert f"dequantizing 16 tensors of types {qtype.name} to float32" in caplog.text
    round_tripped = round_tripped_checkpoint(checkpoint, tmp_path / "rt", qtype)
    with torch.no_grad():
        want = load_hf_model(round_tripped)(torch.tensor([SEQ])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

    original = load_file(str(checkpoint / "model.safetensors"))
    quantized = load_file(str(round_tripped / "model.safetensors"))
    weight_err = np.mean([((quantized[k] - w).norm() / w.norm()).item() for k, w in original.items() if w.ndim == 2])
    logit_err = ((got - float_logits).norm() / float_logits.norm()).item()
    assert 0 < logit_err < 4 * weight_err, (logit_err, weight_err)
    # The same file in its blocks (the default): the same weights, x in 8 bits or bf16 tiles.
    blocks = served_logits(gguf_file, "gguf")
    assert ((blocks - got).norm() / got.norm()).item() < 0.02


def test_unsupported_type_is_refused_by_name(tmp_path):
    out = tmp_path / "q8k.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(1)
    block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_K][1]
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, block_bytes), dtype=np.uint8), raw_dtype=Q.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"tensor type Q8_K is not supported.*blk\.0\.attn_q\.weight.*Q8_0") as err:
        load_model(str(out))
    assert "\n" not in str(err.value)
    assert not list((tmp_path / "cache").glob("q8k-*"))  # nothing half-converted left behind
