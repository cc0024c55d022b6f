"""A GGUF conversion (minutes for a large file, seconds for the embedded
one) is announced with an estimate before it starts and timed after, once."""
from __future__ import annotations

import logging

from kvferry.model import gguf_convert
from tests.tiny_models import make_tiny_checkpoint, write_tiny_gguf


def test_conversion_logs_before_and_after_then_nothing_new(tmp_path, caplog):
    gguf_file = write_tiny_gguf(make_tiny_checkpoint(tmp_path, "llama"), tmp_path / "t.gguf")
    with caplog.at_level(logging.INFO, logger=gguf_convert.__name__):
        folder = gguf_convert.convert_gguf(gguf_file, out_root=tmp_path / "cache")
        messages = [r.getMessage() for r in caplog.records]
        assert messages[0] == f"converting the GGUF t.gguf to an HF folder in {folder}, once, ~5 s"
        assert messages[-1].startswith("converted the GGUF t.gguf in ") and str(folder) in messages[-1]
        caplog.clear()
        gguf_convert.convert_gguf(gguf_file, out_root=tmp_path / "cache")
        assert not [r for r in caplog.records if r.getMessage().startswith("convert")]
