"""A real ``kvferry serve`` on a damaged .gguf file stops before it serves,
with one line naming the tensor: a truncated file, a tensor whose rows do
not hold whole blocks of its type, a type kvferry has no reader for. The
same for the file served in its blocks (the default) and expanded to float
(``--quantization none``): both read every tensor's extent before anything
is loaded."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.model.own_cache import own_model_cache
from tests.tiny_models import make_tiny_checkpoint, write_tiny_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """name -> a damaged file; the tensor each one names is in the test's table."""
    with own_model_cache(tmp_path_factory.mktemp("gguf-bad")) as tmp:
        good = write_tiny_gguf(make_tiny_checkpoint(tmp, "llama"), tmp / "good.gguf", qtype="Q8_0")
        out = {"good": good}
        out["truncated"] = tmp / "truncated.gguf"
        shutil.copy(good, out["truncated"])
        os.truncate(out["truncated"], good.stat().st_size - 100)
        # Rows of 16 values in a type whose blocks hold 32: the same byte count, a wrong shape.
        out["wrong-block"] = tmp / "wrong-block.gguf"
        shutil.copy(good, out["wrong-block"])
        r = gguf.GGUFReader(str(out["wrong-block"]), "r+")
        t = next(t for t in r.tensors if t.name == "blk.0.attn_output.weight")
        t.field.parts[3][:] = (16, int(np.prod(t.shape)) // 16)
        r.data.flush()
        del r, t
        # A type id no ggml version has: the header names it, nothing can read it.
        out["unknown-type"] = tmp / "unknown-type.gguf"
        shutil.copy(good, out["unknown-type"])
        r = gguf.GGUFReader(str(out["unknown-type"]), "r+")
        t = next(t for t in r.tensors if t.name == "blk.1.ffn_up.weight")
        t.field.parts[4][:] = 200
        r.data.flush()
        del r, t
        yield out


def _last_tensor(path: Path) -> str:
    return gguf.GGUFReader(str(path)).tensors[-1].name


def _serve(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", "--model", str(path),
                           "--dtype", "float32", "--kv-cache-memory-gb", "0.1", "--no-warm-up", *extra],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("quantization", [[], ["--quantization", "none"]], ids=["default", "none"])
@pytest.mark.parametrize("kind,pattern", [
    ("truncated", "tensor {last!r}.*truncated"),
    ("wrong-block", r"blk\.0\.attn_output\.weight.*block size 32"),
    ("unknown-type", r"blk\.1\.ffn_up\.weight.*type"),
])
def test_bad_file_stops_serve_in_one_line(files, kind, pattern, quantization):
    import re

    r = _serve(files[kind], *quantization)
    assert r.returncode != 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "ready on" not in r.stdout + r.stderr
    error = [line for line in r.stderr.splitlines() if line.strip()]
    assert error, r.stdout[-2000:]
    assert re.search(pattern.format(last=_last_tensor(files["good"])), error[-1]), r.stderr[-3000:]
