"""The front end's tokenizer read while its cores load (input_processor.prefetch_tokenizer):
from the folder a core names in its ready message, never another, and a GGUF's
converted folder found by the same name the conversion gives it."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.engine import input_processor
from kvferry.engine.input_processor import load_tokenizer, prefetch_tokenizer
from kvferry.messages import EngineCoreReady
from kvferry.model.gguf_convert import convert_gguf
from kvferry.model.resolve import converted_gguf_folder
from tests.tiny_models import make_tiny_checkpoint, write_tiny_gguf


def _ready(model_path: Path | str) -> EngineCoreReady:
    return EngineCoreReady(pid=1, max_model_len=256, vocab_size=384, num_kv_blocks=8, block_size=16,
                           max_num_batched_tokens=256, enable_chunked_prefill=True, model_fingerprint="x",
                           model_path=str(model_path), eos_token_ids=[7, 9])


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return make_tiny_checkpoint(tmp_path, "llama")


@pytest.fixture(autouse=True)
def _nothing_prefetched():
    input_processor._prefetched.clear()
    yield
    input_processor._prefetched.clear()


def test_the_named_folder_gets_the_prefetched_tokenizer(checkpoint):
    prefetch_tokenizer(str(checkpoint))
    pending = input_processor._prefetched[str(checkpoint)]
    tokenizer = load_tokenizer(_ready(checkpoint))
    assert tokenizer is pending.result()  # read once, on the prefetch's thread
    assert tokenizer.eos_token_ids == [7, 9]  # the core's, as without the prefetch
    assert not input_processor._prefetched
    assert tokenizer.encode("hello world") == load_tokenizer(_ready(checkpoint)).encode("hello world")


def test_another_folder_is_read_from_the_ready_message(checkpoint, tmp_path):
    other = make_tiny_checkpoint(tmp_path, "llama", name="other")
    prefetch_tokenizer(str(checkpoint))
    pending = input_processor._prefetched[str(checkpoint)]
    tokenizer = load_tokenizer(_ready(other))
    assert tokenizer is not pending.result() and tokenizer.eos_token_ids == [7, 9]
    assert not input_processor._prefetched  # the unused one is dropped


def test_a_missing_model_or_folder_prefetches_nothing(tmp_path):
    prefetch_tokenizer(str(tmp_path / "nowhere"))
    prefetch_tokenizer(str(tmp_path / "model.gguf"))
    assert not input_processor._prefetched


def test_the_gguf_folders_are_the_ones_conversion_makes(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFERRY_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(checkpoint, tmp_path / "tiny.gguf")
    prefetch_tokenizer(str(gguf))
    assert not input_processor._prefetched  # not converted yet: nothing to read, nothing converted
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    root = tmp_path / "cache"
    for weights in (True, False):
        assert convert_gguf(gguf, weights=weights) == converted_gguf_folder(gguf, root, weights)
    prefetch_tokenizer(str(gguf))
    assert sorted(input_processor._prefetched) == sorted(str(converted_gguf_folder(gguf, root, w))
                                                         for w in (True, False))
    tokenizer = load_tokenizer(_ready(converted_gguf_folder(gguf, root, False)))
    assert tokenizer.vocab_size > 0 and not input_processor._prefetched
