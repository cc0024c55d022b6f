"""``--quantization`` left out: a named .gguf keeps its blocks, as llama.cpp
and Ollama serve it, and is expanded to float (one log line) only where the
blocks do not run; ``none`` expands it; the embedded default model stays
expanded unless ``gguf`` is asked for."""
from __future__ import annotations

import logging

import pytest

from kvferry.model.loader import _keeps_blocks, load_model
from kvferry.model.resolve import resolve_model
from tests.model.own_cache import own_model_cache
from tests.tiny_models import make_tiny_checkpoint, write_tiny_gguf


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    with own_model_cache(tmp_path_factory.mktemp("gguf-default")) as tmp:
        yield write_tiny_gguf(make_tiny_checkpoint(tmp, "llama"), tmp / "tiny-q8_0.gguf", qtype="Q8_0")


def test_named_gguf_keeps_its_blocks_by_default(q8):
    assert load_model(str(q8), dtype="float32").model.linear_config.name == "gguf"
    assert load_model(str(q8), dtype="float32", quantization="none").model.linear_config.name != "gguf"


def test_deterministic_expands_in_one_log_line(q8, caplog):
    with caplog.at_level(logging.INFO, logger="kvferry.model.loader"):
        m = load_model(str(q8), dtype="float32", deterministic=True)
    assert m.model.linear_config.name != "gguf"
    assert sum("--deterministic's batch-invariant kernels take float weights: expanded" in r.message
               for r in caplog.records) == 1


def test_where_the_blocks_do_not_run(q8):
    named, embedded = resolve_model(str(q8)), resolve_model(None)
    assert _keeps_blocks(named, None, "cpu", False)  # TP ranks and pipeline stages keep their parts of the blocks
    assert not _keeps_blocks(named, None, "cuda", False)
    assert not _keeps_blocks(named, None, "cpu", True)  # --deterministic
    assert not _keeps_blocks(named, "none", "cpu", False)
    assert not _keeps_blocks(embedded, None, "cpu", False)
    assert _keeps_blocks(embedded, "gguf", "cpu", False)
