"""Naming a model: folder, .gguf file, or Hugging Face id from the local HF cache (offline)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvferry.model.loader import load_model
from kvferry.model.resolve import resolve_model
from tests.tiny_models import make_tiny_checkpoint

REPO_ID = "tiny-org/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("resolve"), "llama")


@pytest.fixture(autouse=True)
def _hf_env(monkeypatch):
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)


def add_to_hf_cache(hub: Path, repo_id: str, folder: Path, refs: bool = True) -> Path:
    """Lay ``folder``'s files out as huggingface_hub does: content in
    blobs/, the snapshot's files symlinks to them, refs/main naming it."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(p for p in folder.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"blob{i:04d}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    if refs:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def test_hf_id_from_hf_home(tmp_path, monkeypatch, checkpoint):
    snapshot = add_to_hf_cache(tmp_path / "hf" / "hub", REPO_ID, checkpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    resolved = resolve_model(REPO_ID)
    assert (resolved.path, resolved.kind, resolved.is_gguf) == (snapshot.resolve(), "hf-cache", False)
    by_id, by_folder = load_model(REPO_ID, dtype="float32"), load_model(str(checkpoint), dtype="float32")
    assert by_id.model_path == str(snapshot.resolve())
    # The same bytes, whether read through the cache's symlinks or not.
    assert by_id.fingerprint == by_folder.fingerprint
    assert by_id.tokenizer.encode("hello world") == by_folder.tokenizer.encode("hello world")


def test_hf_hub_cache_wins_and_refs_are_optional(tmp_path, monkeypatch, checkpoint):
    add_to_hf_cache(tmp_path / "home" / "hub", REPO_ID, checkpoint)
    preferred = add_to_hf_cache(tmp_path / "hub-cache", REPO_ID, checkpoint, refs=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    assert resolve_model(REPO_ID).path == preferred.resolve()


def test_llm_takes_an_hf_id(tmp_path, monkeypatch, checkpoint):
    from kvferry import LLM, SamplingParams

    add_to_hf_cache(tmp_path / "hf" / "hub", REPO_ID, checkpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    llm = LLM(model=REPO_ID, dtype="float32", num_kv_blocks=16, warm_up=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_not_cached_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    with pytest.raises(ValueError) as err:
        load_model("some-org/not-downloaded")
    message = str(err.value)
    assert "\n" not in message
    assert str(tmp_path / "hub-cache" / "models--some-org--not-downloaded") in message
    assert str(tmp_path / "hf" / "hub" / "models--some-org--not-downloaded") in message
    assert "hf download some-org/not-downloaded" in message


def test_folder_without_tokenizer_names_the_files(tmp_path, checkpoint):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(checkpoint, folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"missing tokenizer\.json; .*config\.json, tokenizer\.json and "
                                         r"\*\.safetensors") as err:
        load_model(str(folder))
    assert "\n" not in str(err.value)


def test_cached_snapshot_without_tokenizer_is_named(tmp_path, monkeypatch, checkpoint):
    snapshot = add_to_hf_cache(tmp_path / "hub", REPO_ID, checkpoint)
    (snapshot / "tokenizer.json").unlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=rf"{snapshot} is missing tokenizer\.json"):
        resolve_model(REPO_ID)


def test_gguf_passes_through(tmp_path, monkeypatch):
    local = tmp_path / "model.Q4_K_M.gguf"
    local.write_bytes(b"GGUF")  # not read: resolving only names the file
    resolved = resolve_model(str(local))
    assert (resolved.path, resolved.kind, resolved.is_gguf) == (local, "gguf", True)
    # A GGUF-only Hub repo resolves to its one .gguf, keeping the suffix (not the blob's name).
    files = tmp_path / "gguf-repo"
    files.mkdir()
    shutil.copyfile(local, files / "model.Q4_K_M.gguf")
    snapshot = add_to_hf_cache(tmp_path / "hub", "org/model-GGUF", files)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    resolved = resolve_model("org/model-GGUF")
    assert resolved.path == snapshot.absolute() / "model.Q4_K_M.gguf" and resolved.is_gguf


def test_wrong_paths_fail_by_name(tmp_path):
    with pytest.raises(ValueError, match="model path does not exist: .*/missing"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"weights\.bin is not a \.gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="missing config.json, tokenizer.json, \\*.safetensors"):
        resolve_model(str(tmp_path))
