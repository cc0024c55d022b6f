"""A real ``kvferry serve --tensor-parallel-size 2`` through the openai client:
greedy output equals HF transformers (float32, tiny random Llama),
``/v1/admin/workers`` lists the core's two ranks with the pids of its real
processes, and a worker rank killed with SIGKILL ends its core whole (the
core's process exits with an error naming the rank), after which the server
restarts the core, lists the new ranks and serves again. A standalone
``kvferry engine-core -tp 2`` joined by a server serves the same text and
lists its ranks too."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from kvferry import LLM, SamplingParams, envs
from tests.parallel.ranks import stop_core
from tests.engine.hf_reference import hf_greedy, load_hf
from tests.serve.server_process import start_server
from tests.serve.test_core_join_secret import _free_port_pair, _secret
from tests.serve.test_flag_errors import assert_one_line_error
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


def _reference(checkpoint: str) -> str:
    """The offline engine's greedy text, whose tokens are HF float32's."""
    expected = hf_greedy(load_hf(checkpoint), PROMPT, MAX_NEW)
    offline = LLM(model=checkpoint, dtype="float32", kv_cache_memory_gb=0.02)
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))[0]
    assert ref.outputs[0].token_ids == expected
    return ref.outputs[0].text


@pytest.fixture(scope="module")
def started(checkpoint, tmp_path_factory):
    """(server -tp 2, reference text): the server starts while HF and the
    offline engine compute the reference (a start is mostly one process's
    imports: the two overlap on two cores)."""
    log = tmp_path_factory.mktemp("tp-serve-log") / "server.log"
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start_server, log, ["--model", checkpoint, "--tensor-parallel-size", "2",
                                                   "--cpu-threads-per-rank", "1"])
        try:
            text = _reference(checkpoint)
        except BaseException:
            if starting.exception() is None:
                starting.result().stop()
            raise
    srv = starting.result()
    yield srv, text
    assert srv.stop() == 0, srv.log()[-5000:]  # SIGTERM drains: rank 0 stops its workers


@pytest.fixture(scope="module")
def server(started):
    return started[0]


def ranks(srv) -> tuple[int, list[dict]]:
    """The one core's pid and its ranks, from GET /v1/admin/workers."""
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=30)
    assert r.status_code == 200, r.text
    [worker] = r.json()["data"]
    assert worker["tensor_parallel_size"] == len(worker["ranks"]), worker
    return worker["pid"], worker["ranks"]


def assert_live_ranks(srv, name: str) -> list[int]:
    """Two live ranks whose pids are the core's real processes: rank 0 is
    the core itself, rank 1 its child titled "kvferry: NAME rank 1"."""
    core, listed = ranks(srv)
    assert [r["rank"] for r in listed] == [0, 1], listed
    assert all(r["alive"] and r["cpu_threads"] == 1 for r in listed), listed
    assert listed[0]["pid"] == core and _alive(core)
    assert _title(core).startswith(f"kvferry: {name}") and "rank" not in _title(core), _title(core)
    assert _alive(listed[1]["pid"]) and _title(listed[1]["pid"]).startswith(f"kvferry: {name} rank 1")
    assert listed[1]["pid"] in _children(core)
    return [r["pid"] for r in listed]


def complete(srv) -> str:
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_NEW
    return r.choices[0].text


def test_served_greedy_output_equals_hf(server, started):
    assert complete(server) == started[1]


def test_admin_workers_lists_the_ranks(server):
    core, worker = assert_live_ranks(server, "engine-0")
    assert core in _children(server.proc.pid)
    # The heartbeat's answers keep them (and their liveness) fresh: still there a beat later.
    time.sleep(3)
    assert [r["pid"] for r in ranks(server)[1]] == [core, worker]


def test_a_killed_worker_rank_ends_its_core_and_the_server_restarts_it(server, checkpoint):
    complete(server)
    cores = [p for p in _children(server.proc.pid) if "kvferry: engine-0" in _title(p)]
    assert len(cores) == 1, [(p, _title(p)) for p in _children(server.proc.pid)]
    core = cores[0]
    workers = [p for p in _children(core) if "rank 1" in _title(p)]
    assert len(workers) == 1, [(p, _title(p)) for p in _children(core)]
    assert assert_live_ranks(server, "engine-0") == [core, workers[0]]
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
    # The admin view lists the new group's ranks, none of the old pids.
    pids = assert_live_ranks(server, "engine-0")
    assert pids[0] == new[0] and not {core, workers[0]} & set(pids)


def test_a_standalone_tp_core_joined_by_a_server(checkpoint, server, tmp_path, monkeypatch):
    """``kvferry engine-core -tp 2 --cpu-threads-per-rank 1 --tp-all-reduce
    gloo`` on its own; a server joins it by address, lists its two ranks and
    gets the text of the served -tp 2 core (shm sums) above."""
    monkeypatch.delenv(envs.SOCKET_SECRET, raising=False)  # the core and the server agree through the file
    secret = _secret(tmp_path / "secret")
    address = f"tcp://127.0.0.1:{_free_port_pair()}"
    log = tmp_path / "core.log"
    core = subprocess.Popen([sys.executable, "-m", "kvferry.cli", "engine-core", "--address", address,
                             "--name", "engine-tp", "--model", checkpoint, "--dtype", "float32",
                             "--num-kv-blocks", "64", "--max-model-len", "1024", "--no-warm-up",
                             "--check-kv-integrity", "-tp", "2", "--cpu-threads-per-rank", "1",
                             "--tp-all-reduce", "gloo", "--cache-secret-file", secret],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        srv = start_server(tmp_path / "server.log", ["--data-parallel-size", "0", "--worker", address,
                                                     "--model", checkpoint, "--cache-secret-file", secret,
                                                     "--engine-start-timeout", "300"], serve_args=[])
        try:
            pids = assert_live_ranks(srv, "engine-tp")
            assert pids[0] == core.pid
            assert complete(srv) == complete(server)
        finally:
            assert srv.stop() == 0, srv.log()[-3000:]
    finally:
        stop_core(core)
    deadline = time.monotonic() + 30  # a worker exits at its core's word, or once it sees the core gone
    while any(_alive(p) for p in pids[1:]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids[1:]), "a rank outlived its core"
    assert "Traceback" not in log.read_text(errors="replace")


def test_engine_core_refuses_a_bad_tp_size_in_one_line():
    """-tp 0 is a usage error naming the field, before any model loads."""
    r = subprocess.run([sys.executable, "-m", "kvferry.cli", "engine-core", "--address", "tcp://127.0.0.1:9",
                        "-tp", "0"], capture_output=True, text=True, timeout=120)
    line = assert_one_line_error(r.returncode, r.stderr)
    assert "tensor_parallel_size" in line, line
