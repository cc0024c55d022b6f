"""Start N rank processes that form one ProcessGroup, and join them.

``launch(fn, world_size)`` runs ``fn(group, *args)`` in each of N fresh
processes (the ``spawn`` start method: no fork-inherited state, as
everywhere in kvferry) and returns their results in rank order. A group
lives and dies whole: when one rank fails (raises, or exits without a
result) the launcher stops the others and raises ``RankFailed`` naming the
first rank that failed, rather than leaving them blocked in a collective
until its timeout. mini-sglang's launcher likewise waits for each process's
acknowledgement.
"""
from __future__ import annotations

import multiprocessing as mp
import shutil
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from kvferry import private_dirs
from kvferry.parallel.group import GroupAddress, ProcessGroup

_STOP_GRACE_S = 5.0  # how long a stopped rank gets to exit after SIGTERM before SIGKILL


class RankFailed(RuntimeError):
    """A rank of a launched group failed; the other ranks were stopped."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank} failed: {reason}")
        self.rank = rank


def launch(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *, timeout_s: float = 60.0,
           deadline_s: float | None = None, name: str = "kvferry") -> list[Any]:
    """Run ``fn(group, *args)`` on ranks 0..world_size-1, each in its own process.

    ``fn`` and ``args`` must pickle (a module-level function); so must its
    result. ``timeout_s`` bounds each collective and the group's forming;
    ``deadline_s`` (None: no bound) the whole run. Processes are named
    ``"{name} rank {i}"``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    folder = private_dirs.make("kvferry-group-")  # 0700: the rendezvous is ours alone
    address = GroupAddress.in_folder(folder)
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, name=f"{name} rank {rank}", daemon=True,
                        args=(fn, rank, world_size, address, timeout_s, tuple(args), child))
        p.start()
        child.close()  # the parent keeps only its end: EOF once the rank is gone
        procs.append(p)
        conns.append(parent)
    try:
        return _join(procs, conns, None if deadline_s is None else time.monotonic() + deadline_s)
    finally:
        _stop(procs)
        for c in conns:
            c.close()
        shutil.rmtree(folder, ignore_errors=True)


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, address: GroupAddress, timeout_s: float,
               args: tuple, conn: Connection) -> None:
    try:
        group = ProcessGroup(rank, world_size, address, timeout_s)
        result = ("ok", fn(group, *args))
    except BaseException as e:  # reported to the launcher, which ends the group
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    conn.send(result)
    conn.close()


def _join(procs: list, conns: list[Connection], deadline: float | None) -> list[Any]:
    results: dict[int, Any] = {}
    pending = dict(enumerate(conns))
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise RankFailed(min(pending), "the launch deadline passed before it finished")
        for conn in wait(list(pending.values()), timeout=left):
            rank = next(r for r, c in pending.items() if c is conn)
            del pending[rank]
            try:
                status, value = conn.recv()
            except EOFError:  # died without a word: a signal, os._exit, the OOM killer
                procs[rank].join(_STOP_GRACE_S)
                raise RankFailed(rank, f"exited with code {procs[rank].exitcode} without a result") from None
            if status != "ok":
                raise RankFailed(rank, value)
            results[rank] = value
    return [results[r] for r in range(len(conns))]


def _stop(procs: list) -> None:
    """End every rank still running: SIGTERM, then SIGKILL after a grace."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + _STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
