"""``kvferry serve`` over the embedded Q4_1 GGUF with its weights kept in
their blocks (`--quantization gguf`) against ``--quantization none`` (expanded to
float): both answer through the openai client, and the quantized server's
processes hold far less memory. An unsupported ``--quantization`` value
stops the server before it starts, in one line naming the supported ones."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.serve.server_process import MODEL_NAME, SERVE_ARGS, start_server


def _tree_rss_mb(pid: int) -> float:
    """VmRSS of ``pid`` and its descendants (the engine core runs in a child), MB."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1e3
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total


def _serve(tmp_path: Path, quantization: str) -> tuple[str, float]:
    srv = start_server(tmp_path / f"{quantization}.log", ["--quantization", quantization])
    try:
        with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=120) as c:
            r = c.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=6,
                                     temperature=0.0)
        return r.choices[0].text, _tree_rss_mb(srv.proc.pid)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_served_quantized_answers_and_holds_less_memory(tmp_path):
    text_q, rss_q = _serve(tmp_path, "gguf")
    text_f, rss_f = _serve(tmp_path, "none")
    print(f"RSS of the serving processes (float32): blocks {rss_q:.0f} MB, expanded {rss_f:.0f} MB")
    # Greedy: the first words agree (8-bit activations may flip a late near-tie).
    assert text_q.split()[:1] == text_f.split()[:1] and text_q.strip()
    # float32 expands the 30 layers' linear weights (106M parameters) to ~425 MB; their blocks are
    # ~68 MB; the token embedding, which is the tied lm_head, 30 MB of Q8_0 blocks against a float
    # table and its packed copy (2 x 113 MB). The KV pool, torch and the server are the same: measured
    # 1486 MB against 1781 MB on a 2-core Xeon with a float embedding; tests/model/test_gguf_memory.py
    # bounds the blocks' server by the file's size.
    assert rss_q < rss_f - 200


@pytest.mark.parametrize("value", ["awq", "fp8"])
def test_unsupported_quantization_is_one_line(value):
    r = subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", *SERVE_ARGS,
                        "--quantization", value], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert f"quantization '{value}' is not supported; supported: gguf, int8, compressed-tensors, none" in r.stderr
    assert "Traceback" not in r.stderr
