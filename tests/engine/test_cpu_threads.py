"""With ``KVFERRY_CPU_BIND=1`` (or a CPU list) the stepping thread and its
OpenMP team are pinned one per CPU: in a fresh thread, in the offline LLM's
stepping thread, and in a real engine-core process (read back from /proc);
unset or ``0`` leaves them alone."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.config import EngineArgs
from kvferry.engine.core_client import CoreConnection, CoreProcess
from kvferry.engine.cpu_threads import bind_step_thread, default_cpus, step_executor
from kvferry.messages import EngineCoreShutdown
from tests.tiny_models import make_tiny_checkpoint

ALLOWED = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="pinning is only visible with 2+ CPUs")


def affinity_by_thread(pid: int | str = "self") -> dict[int, set[int]]:
    """tid -> the CPUs it may run on, for every thread of process ``pid``."""
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.fixture(autouse=True)
def keep_thread_count():
    count = torch.get_num_threads()  # binding sets it process-wide
    yield
    torch.set_num_threads(count)


def in_fresh_thread(fn):
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join(60)
    return result[0]


@needs_two_cpus
def test_bind_step_thread_pins_the_thread_and_one_worker_per_cpu():
    cpus = ALLOWED[:2]

    def bind():
        binding = bind_step_thread(cpus)
        # While this thread lives, its team's workers live too.
        return binding, threading.get_native_id(), os.sched_getaffinity(0), affinity_by_thread()

    binding, tid, own, threads = in_fresh_thread(bind)
    assert binding is not None
    assert binding.master == (tid, cpus[0]) and own == {cpus[0]}
    [(worker, cpu)] = binding.workers
    assert cpu == cpus[1] and threads[worker] == {cpus[1]}
    # Every other thread keeps the process's CPU set.
    assert threads[threading.main_thread().native_id] == set(ALLOWED)


def test_bind_off_sizes_the_team_but_pins_nothing(monkeypatch):
    monkeypatch.setenv("KVFERRY_CPU_BIND", "0")
    binding, own = in_fresh_thread(lambda: (bind_step_thread(ALLOWED[:1]), os.sched_getaffinity(0)))
    assert binding is None and own == set(ALLOWED)


def test_default_cpus_pins_only_when_asked(monkeypatch):
    monkeypatch.delenv("KVFERRY_CPU_BIND", raising=False)
    assert default_cpus(1) == (ALLOWED[:1], False)
    monkeypatch.setenv("KVFERRY_CPU_BIND", "3,5-6")
    assert default_cpus() == ([3, 5, 6], True)
    monkeypatch.setenv("KVFERRY_CPU_BIND", "1")
    assert default_cpus(len(ALLOWED)) == (ALLOWED, True)
    assert default_cpus(1) == (ALLOWED[:1], True)
    monkeypatch.setenv("KVFERRY_CPU_BIND", "3-x")
    with pytest.raises(ValueError, match="cpus"):
        default_cpus()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("cpu-threads")))


_OFFLINE = """
import os, sys, threading, torch
torch.set_num_threads(len(os.sched_getaffinity(0)))  # a team over every CPU: pinned by default
from kvferry import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", num_kv_blocks=32)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
assert len(out[0].token_ids) == 4
steps = [t for t in threading.enumerate() if t.name.startswith("kvferry-steps")]
pinned = sorted(c for t in os.listdir("/proc/self/task") for c in [os.sched_getaffinity(int(t))] if len(c) == 1)
where = sorted(os.sched_getaffinity(steps[0].native_id)) if steps else "caller"
print("steps", where, "pinned", [sorted(c) for c in pinned])
"""


@needs_two_cpus
@pytest.mark.parametrize("bind", ["1", "0", None])
def test_offline_llm_steps_on_a_pinned_thread(checkpoint, bind):
    # A fresh process: this one's stepping thread may be bound already.
    env = {k: v for k, v in os.environ.items() if k != "KVFERRY_CPU_BIND"}
    if bind is not None:
        env["KVFERRY_CPU_BIND"] = bind
    done = subprocess.run([sys.executable, "-c", _OFFLINE, checkpoint], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    if bind == "1":
        assert f"steps [{ALLOWED[0]}] pinned {[[c] for c in ALLOWED]}" in done.stdout
    else:  # no stepping thread: steps run on the caller's, nothing is pinned
        assert "steps caller pinned []" in done.stdout


@needs_two_cpus
def test_engine_core_process_pins_its_team(checkpoint, monkeypatch):
    monkeypatch.setenv("KVFERRY_CPU_BIND", "1")  # the spawned core inherits it
    # --cpus 2 CPUs: the core runs 2 threads there, a team over its whole set.
    cpus = ALLOWED[:2]
    core = CoreProcess.start(EngineArgs(model=checkpoint, dtype="float32", num_kv_blocks=32).create_engine_config(),
                             cpus=",".join(map(str, cpus)))
    conn = CoreConnection(core.addresses)
    try:
        conn.wait_ready(timeout_s=120, process=core)  # sent by the step thread, after it pinned itself
        threads = affinity_by_thread(core.pid)
        single = sorted(next(iter(c)) for c in threads.values() if len(c) == 1)
        assert single == cpus  # one thread per CPU, in order
        assert threads[core.pid] == set(cpus)  # the main thread (and the I/O threads) keep the process's set
    finally:
        conn.send(EngineCoreShutdown())
        core.stop(10)
        conn.close()


def test_llm_steps_follow_the_callers_thread_count(checkpoint, monkeypatch):
    monkeypatch.setenv("KVFERRY_CPU_BIND", "1")  # steps on the stepping thread
    # generate calls share the stepping thread until the caller changes its
    # torch thread count; then a new one has a team of the new size.
    llm = LLM(model=checkpoint, dtype="float32", num_kv_blocks=32)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    first = [o.token_ids for o in llm.generate(prompts, params)]
    torch.set_num_threads(1)
    assert [o.token_ids for o in llm.generate(prompts, params)] == first
    assert step_executor().submit(torch.get_num_threads).result() == 1
    torch.set_num_threads(2)
    assert [o.token_ids for o in llm.generate(prompts, params)] == first
    assert step_executor().submit(torch.get_num_threads).result() == 2
