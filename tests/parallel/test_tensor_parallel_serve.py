"""A real ``kvferry serve --tensor-parallel-size 2`` through the openai client:
greedy output equals HF transformers (float32, tiny random Llama), and a
worker rank killed with SIGKILL ends its core whole (the core's process
exits with an error naming the rank), after which the server restarts the
core and serves again."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest

from kvferry import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, load_hf
from tests.serve.server_process import start_server
from tests.tiny_models import make_tiny_checkpoint

PROMPT = [5, 17, 33, 100, 200, 7, 7, 9]
MAX_NEW = 8


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tp-serve"), arch="llama", num_attention_heads=8,
                                num_key_value_heads=4, vocab_size=387,
                                max_position_embeddings=1024)
    return str(path)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("tp-serve-log") / "server.log",
                       ["--model", checkpoint, "--tensor-parallel-size", "2", "--cpu-threads-per-rank", "1"])
    yield srv
    assert srv.stop() == 0, srv.log()[-5000:]  # SIGTERM drains: rank 0 stops its workers


def complete(srv) -> str:
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_NEW
    return r.choices[0].text


def test_served_greedy_output_equals_hf(server, checkpoint):
    expected = hf_greedy(load_hf(checkpoint), PROMPT, MAX_NEW)
    offline = LLM(model=checkpoint, dtype="float32", kv_cache_memory_gb=0.02)
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))[0]
    assert ref.outputs[0].token_ids == expected
    assert complete(server) == ref.outputs[0].text


def test_a_killed_worker_rank_ends_its_core_and_the_server_restarts_it(server, checkpoint):
    complete(server)
    cores = [p for p in _children(server.proc.pid) if "kvferry: engine-0" in _title(p)]
    assert len(cores) == 1, [(p, _title(p)) for p in _children(server.proc.pid)]
    core = cores[0]
    workers = [p for p in _children(core) if "rank 1" in _title(p)]
    assert len(workers) == 1, [(p, _title(p)) for p in _children(core)]
    os.kill(workers[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while _alive(core) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(core), "the core outlived its killed rank"
    assert "tensor-parallel rank 1" in server.log() and "SIGKILL" in server.log()
    # Restarted whole (new ranks), it serves again.
    deadline = time.monotonic() + 300
    while True:
        try:
            complete(server)
            break
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    new = [p for p in _children(server.proc.pid) if "kvferry: engine-0" in _title(p)]
    assert new and core not in new
    assert [p for p in _children(new[0]) if "rank 1" in _title(p)]
