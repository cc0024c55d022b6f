"""One OpenMP thread per CPU core: pin the stepping thread and its team.

torch runs every CPU op on an OpenMP team: the thread that calls the op is
the team's master, libgomp adds ``num_threads - 1`` workers on the first
parallel region that thread enters (a pool per master thread) and keeps
them. Left alone, the kernel scheduler moves these threads between cores;
when it puts two of them on one core for a moment (the master's Python work
between ops, another process waking), every parallel region's barrier waits
for the thread that is not running, and a step's time jumps. vLLM-CPU pins
each OpenMP thread to one core (``VLLM_CPU_OMP_THREADS_BIND``); this does the
same with no compiled code, from the stepping thread itself, when asked:

* ``bind_step_thread(cpus)`` sizes torch's team to ``len(cpus)``, pins the
  calling thread to ``cpus[0]``, runs one parallel op, and pins the workers
  that op created (the threads of this process that appeared during it) to
  ``cpus[1:]``, one each.
* It must run on a thread that has not yet run a parallel op (its team must
  be new, so that its workers can be told apart): the engine core's step
  thread, right after it starts, and ``step_executor()``'s one thread, on
  which the offline ``LLM`` runs its steps (every engine in the process
  shares it: two engines stepping at once would only fight for the cores).
  Without ``KVFERRY_CPU_BIND`` the offline ``LLM`` steps on the caller's
  thread.

Threads that are not the team (socket I/O, the parent watchdog, the HTTP
front end in its own process) keep the process's whole CPU set.

The team is the first ``torch.get_num_threads()`` CPUs this process may
run on. Pinning is opt-in (see ``default_cpus`` for why):
``KVFERRY_CPU_BIND=1`` pins the team there, ``KVFERRY_CPU_BIND=2-3`` (a
CPU list) pins it to those CPUs (CPU 1 alone is ``1-1``: a bare ``0``/``1``
means off/on), and unset or ``0`` leaves the threads where the kernel puts
them. Several servers on one host each want their own CPUs (``--cpus``).
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvferry import envs
from kvferry.engine.core_addresses import parse_cpus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ThreadBinding:
    """Which thread went to which CPU (native thread ids)."""

    master: tuple[int, int]  # (tid, cpu) of the stepping thread
    workers: tuple[tuple[int, int], ...]  # (tid, cpu) per OpenMP worker

    def describe(self) -> str:
        pairs = [self.master, *self.workers]
        return ", ".join(f"thread {tid} -> cpu {cpu}" for tid, cpu in pairs)


def binding_enabled() -> bool:
    """False only where pinning is switched off outright (``KVFERRY_CPU_BIND=0``)."""
    return envs.cpu_bind() not in ("0", "false", "off", "no")


def pinning_requested() -> bool:
    """``KVFERRY_CPU_BIND`` is 1 or a CPU list."""
    value = envs.cpu_bind()
    return value in ("1", "on", "true", "yes") or (bool(value) and value[0].isdigit() and value != "0")


def process_cpus() -> list[int]:
    """The CPUs this process may run on: its main thread's set (the pid is
    the main thread's id). Not ``sched_getaffinity(0)``: on a pinned
    stepping thread that is the thread's own one or two CPUs, and the rank
    processes it spawns would split (and inherit) only those."""
    return sorted(os.sched_getaffinity(os.getpid()))


def default_cpus(num_threads: int | None = None) -> tuple[list[int], bool]:
    """(the CPUs of the team, whether to pin to them).

    ``KVFERRY_CPU_BIND=<list>``: those CPUs, pinned. Otherwise the first
    ``num_threads`` (default: torch's thread count) CPUs this process may
    run on, pinned only with ``KVFERRY_CPU_BIND=1``. Off by default: on a
    machine shared with other busy processes a pinned team cannot move to
    the core that is free, and every parallel region waits for its slowest
    thread (measured: a pinned run got 0.35-0.42 CPU-s per second where the
    unpinned one next to it got 0.75-1.07)."""
    value = envs.cpu_bind()
    if value and value[0].isdigit() and value not in ("0", "1"):
        return sorted(parse_cpus(value)), True
    allowed = process_cpus()
    cpus = allowed[: max(1, min(num_threads or torch.get_num_threads(), len(allowed)))]
    return cpus, value in ("1", "on", "true", "yes")


def bind_step_thread(cpus: list[int] | None = None, num_threads: int | None = None) -> ThreadBinding | None:
    """Pin the calling thread to ``cpus[0]`` and its new OpenMP workers to
    ``cpus[1:]`` (default: ``default_cpus(num_threads)``, where it says so).
    Returns the binding, or None where it is off or cannot be done (no
    ``sched_setaffinity``, a team that already existed); the thread count
    is set in every case."""
    pin = True
    if cpus is None:
        cpus, pin = default_cpus(num_threads)
    torch.set_num_threads(len(cpus))
    if not pin or not binding_enabled() or not hasattr(os, "sched_setaffinity"):
        return None
    before = _thread_ids()
    _run_parallel_op()
    workers = sorted(_thread_ids() - before)
    if len(workers) != len(cpus) - 1:
        # The team existed before (or other threads started meanwhile): we
        # cannot tell which threads are its workers, so pin none of them.
        logger.info("CPU binding skipped: expected %d new OpenMP workers, saw %d", len(cpus) - 1, len(workers))
        return None
    try:
        os.sched_setaffinity(0, {cpus[0]})  # pid 0: the calling thread only
        for tid, cpu in zip(workers, cpus[1:]):
            os.sched_setaffinity(tid, {cpu})
    except OSError as exc:  # a CPU outside a container's cpuset, a thread that ended
        logger.info("CPU binding failed (%s); threads left unpinned", exc)
        os.sched_setaffinity(0, os.sched_getaffinity(os.getpid()))
        return None
    binding = ThreadBinding((_native_id(), cpus[0]), tuple(zip(workers, cpus[1:])))
    logger.debug("CPU binding: %s", binding.describe())
    return binding


_executor: ThreadPoolExecutor | None = None
_executor_threads = 0
_executor_lock = threading.Lock()


def step_executor() -> ThreadPoolExecutor:
    """The process's stepping thread for in-process engines, with as many
    OpenMP threads as the caller's torch uses, pinned when it starts if
    ``KVFERRY_CPU_BIND`` asks. A
    thread's team size is fixed once it ran an op, so a caller that changed
    ``torch.set_num_threads`` since gets a new stepping thread."""
    global _executor, _executor_threads
    num_threads = torch.get_num_threads()
    with _executor_lock:
        if _executor is None or _executor_threads != num_threads:
            if _executor is not None:
                _executor.shutdown(wait=False)  # its thread ends after any step in flight
            _executor = ThreadPoolExecutor(1, thread_name_prefix="kvferry-steps", initializer=_bind_quietly,
                                           initargs=(num_threads,))
            _executor_threads = num_threads
        return _executor


def _bind_quietly(num_threads: int) -> None:
    try:
        bind_step_thread(num_threads=num_threads)
    except Exception:  # pinning is only a speed-up: never break the engine over it
        logger.exception("CPU binding failed; threads left unpinned")


def _thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # no procfs: no way to find the workers
        return set()


def _run_parallel_op() -> None:
    """An op large enough that at::parallel_for uses every thread (its grain
    is 32768 elements), so libgomp starts the whole team now."""
    x = torch.ones(1 << 20, dtype=torch.float32)
    x.mul_(2.0)


def _native_id() -> int:
    return threading.get_native_id()
