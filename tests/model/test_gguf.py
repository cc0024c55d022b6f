"""GGUF conversion: tiny checkpoints written as llama.cpp GGUF load back exactly."""
from __future__ import annotations

import json

import pytest
import torch

from kvferry.model import gguf_convert
from kvferry.model.loader import load_model
from kvferry.model.tokenizer import Tokenizer
from tests.model.own_cache import own_model_cache
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import load_hf_model, make_tiny_checkpoint, write_tiny_gguf

TEXTS = ["Hello world! Paris is the capital of France.", "日本語 😀 12345 café", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path):
    """Conversions into tmp; built C++ kernels from the shared cache (a cold build takes minutes)."""
    with own_model_cache(tmp_path):
        yield


def test_permute_roundtrip():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(gguf_convert.unpermute_qk(gguf_convert.permute_qk(w, 4), 4), w)
    assert not torch.equal(gguf_convert.permute_qk(w, 4), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_matches_hf(tmp_path, arch):
    hf_path = make_tiny_checkpoint(tmp_path, arch)
    gguf_file = write_tiny_gguf(hf_path, tmp_path / f"tiny-{arch}.gguf")
    # Expanded (--quantization none): HF's float model, exactly; the blocks path has tests/model/test_gguf_blocks.py.
    loaded = load_model(str(gguf_file), dtype="float32", quantization="none")
    assert loaded.model_path.startswith(str(tmp_path / "cache"))
    seq = list(range(3, 3 + 19))
    got = PagedHarness(loaded.model).step({0: seq}, {0: len(seq)})[0]
    with torch.no_grad():
        want = load_hf_model(hf_path)(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_gguf_tokenizer_matches_original(tmp_path):
    hf_path = make_tiny_checkpoint(tmp_path, "llama")
    folder = gguf_convert.convert_gguf(write_tiny_gguf(hf_path, tmp_path / "t.gguf"))
    original, converted = Tokenizer(hf_path), Tokenizer(folder)
    for text in TEXTS:
        assert converted.encode(text) == original.encode(text)
        assert converted.decode(original.encode(text)) == original.decode(original.encode(text))
    assert converted.eos_token_ids == [2]
    assert converted.bos_token_id == 1
    messages = [{"role": "user", "content": "hi"}]
    assert converted.apply_chat_template(messages) == original.apply_chat_template(messages)


def test_conversion_is_cached(tmp_path):
    hf_path = make_tiny_checkpoint(tmp_path, "llama")
    gguf_file = write_tiny_gguf(hf_path, tmp_path / "t.gguf")
    first = gguf_convert.convert_gguf(gguf_file)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert gguf_convert.convert_gguf(gguf_file) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".converting-")]
    cfg = json.loads((first / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="GGUF file not found"):
        gguf_convert.convert_gguf(tmp_path / "nope.gguf")


def _convert_in_process(args):
    gguf_file, cache = args
    import os

    os.environ["KVFERRY_CACHE_DIR"] = cache
    return str(gguf_convert.convert_gguf(gguf_file))


def test_concurrent_conversions_agree(tmp_path):
    import multiprocessing as mp

    hf_path = make_tiny_checkpoint(tmp_path, "llama")
    gguf_file = write_tiny_gguf(hf_path, tmp_path / "t.gguf")
    cache = str(tmp_path / "shared-cache")
    with mp.get_context("spawn").Pool(3) as pool:
        folders = pool.map(_convert_in_process, [(str(gguf_file), cache)] * 3)
    assert len(set(folders)) == 1
    assert sorted(p.name for p in (tmp_path / "shared-cache").iterdir()) == [folders[0].rsplit("/", 1)[1]]
    assert load_model(folders[0]).config.num_hidden_layers == 2
