"""A GGUF mixture of experts costs the file's bytes, not the float model's
(model/moe_quant.py): the experts' blocks are views of the mapped file, and
a real ``kvferry serve --quantization gguf`` over it answers through the
openai client within the memory bound of tests/model/test_gguf_memory.py.

The file (tests/moe_gguf_writer.py): a Qwen3-MoE of 2 layers, 32 experts
of 1024 x 1024, top-4, random Q4_0 blocks. Its experts are 113 MB in the
file and would be 805 MB as float32 (the servers' dtype), 403 MB in bf16:
either breaks the bound many times over."""
from __future__ import annotations

import os

import openai
import pytest

from kvferry.model.loader import load_model
from kvferry.model.moe_quant import QuantizedExperts
from tests.model.own_cache import own_model_cache
from tests.model.paged_harness import PagedHarness
from tests.model.test_gguf_memory import CORE_OVERHEAD_MB, _status, _tree
from tests.moe_gguf_writer import MoeShape, write_random_moe_gguf
from tests.serve.server_process import start_server

SHAPE = MoeShape(layers=2, experts=32, top_k=4, hidden=1024, moe_inter=1024)
KV_GB = 0.25


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    with own_model_cache(tmp_path_factory.mktemp("moe-quant-mem")) as tmp:
        yield write_random_moe_gguf(tmp / "moe-q4_0.gguf", SHAPE, "Q4_0")


def test_expert_weights_are_the_files_bytes(moe_file):
    lm = load_model(str(moe_file), dtype="float32", quantization="gguf").model
    stacks = [m for m in lm.modules() if isinstance(m, QuantizedExperts)]
    assert sum(s.method.nbytes(s) for s in stacks) == SHAPE.expert_bytes("Q4_0")
    before = _status_self()
    seq = list(range(3, 67))  # 64 tokens: about every expert routed to, its pages read
    PagedHarness(lm).step({0: seq}, {0: len(seq)})
    after = _status_self()
    # Reading every expert maps the file's pages (RssFile), and allocates no copy of them (RssAnon).
    float_mb = SHAPE.expert_bytes("Q4_0") / 2**20 * 32 / 4.5  # the experts in float32
    assert after["RssAnon"] - before["RssAnon"] < 0.1 * float_mb, (before, after)
    assert after["RssFile"] - before["RssFile"] <= moe_file.stat().st_size / 2**20 + 16, (before, after)


def _status_self() -> dict[str, float]:
    return _status(os.getpid())


def test_served_moe_answers_within_the_files_memory(moe_file, tmp_path):
    srv = start_server(tmp_path / "server.log", ["--model", str(moe_file), "--quantization", "gguf",
                                                 "--served-model-name", "moe", "--kv-cache-memory-gb", str(KV_GB)])
    try:
        with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300) as c:
            r = c.completions.create(model="moe", prompt="hello world", max_tokens=8, temperature=0.0)
            chat = c.chat.completions.create(model="moe", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, temperature=0.0)
        assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
        assert chat.choices[0].finish_reason == "length"
        procs = _tree(srv.proc.pid)
        core = next(_status(p) for p, name in procs.items() if name.startswith("kvferry: engine"))
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    file_mb, kv_mb = moe_file.stat().st_size / 2**20, KV_GB * 1024
    print(f"\nfile {file_mb:.0f} MB, KV pool {kv_mb:.0f} MB, engine core {core}")
    assert core["VmRSS"] <= 1.15 * file_mb + kv_mb + CORE_OVERHEAD_MB, core
