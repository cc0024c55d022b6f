"""Scaling each pool of engine cores on its own, while requests run.

    scaler.counts()                                   {"prefill": 1, "decode": 2}: the cores each role has now
    event = await scaler.scale({"decode": 3})         start one more decode core, route to it once it is ready
    event = await scaler.scale({"decode": 1})         drain two decode cores, then stop them

Adding a core starts it as the server started its first ones (a local
process, or with ``--ray`` a new actor placed by its role's resources),
waits for its handshake, and only then routes to it. Removing one stops
routing to it, lets its requests finish (up to ``drain_timeout_s``: a
request still running then ends with an error, as when a worker leaves),
and stops it: scaling down drops and fails nothing that finishes within the
drain. A restarting core counts as one of its role's (it is coming back)
and is the first to go when the role shrinks.

One scale runs at a time: ``scale`` raises ScaleInProgressError while
another runs (the admin route answers 409), unless ``wait`` is set (the
autoscaler queues behind an operator's scale). Every scale is recorded in
``history``: what it was asked, what it did, and how long each step took.

Room first: before any core starts or drains, the supervisor reserves room
for every core to add (with ``--ray``, a placement group each, within
``--scale-timeout-s``). When the cluster cannot place them all, the scale
does nothing else: its event has every new core "failed" with the
CorePlacementError naming what is missing, and the pools stay as they were.
``stop(reason)`` (the server begins to shut down) ends the running scale at
once, its half-started cores and reserved room removed, and refuses every
later one with ScaleStoppedError.

The scaler reaches the client through two hooks, as the restart supervisor
does: ``adopt(worker)`` starts reading a new member (and prefills the
server's public prefixes there), ``leave(name, drain_timeout_s)`` drains
and removes one.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from kvferry.engine.core_client import EngineCoreStartError
from kvferry.router.membership import Membership
from kvferry.router.supervisor import RestartSupervisor
from kvferry.router.worker import Worker

logger = logging.getLogger(__name__)

# The most cores of one role a scale may ask for: a typo such as 1000 is an
# error, not a thousand model loads.
MAX_CORES_PER_ROLE = 64
DEFAULT_DRAIN_TIMEOUT_S = 300.0
HISTORY = 50  # scale events kept for GET /v1/admin/scale

# The request body's names for each role's count: the role itself, as GET
# /v1/admin/scale's counts name it ("engines" is accepted too: the CLI's flag).
ROLE_FIELDS = {"engine": "engine", "prefill": "prefill", "decode": "decode"}


class ScaleInProgressError(RuntimeError):
    """Another scale is running."""


class ScaleStoppedError(RuntimeError):
    """The server is shutting down: no scale runs any more."""


class CorePlacementError(EngineCoreStartError):
    """The cluster could not place every core a scale adds within the scale
    timeout; the message names the core and the resources missing."""


def roles_of(mode: str) -> tuple[str, ...]:
    return ("engine",) if mode == "colocated" else ("prefill", "decode")


def check_target(target: dict[str, int], mode: str, fields: dict[str, str] | None = None) -> dict[str, int]:
    """The counts asked for, by role, validated against the server's mode.
    ``target`` is keyed by role ("engine", "prefill", "decode"); a role not
    named keeps its count. Raises ValueError naming the field (as
    ``fields`` spells each role, when the caller's spelling differs)."""
    roles = roles_of(mode)
    if not target:
        names = " and ".join(ROLE_FIELDS[r] for r in roles)
        raise ValueError(f"give the count to scale to: {names}")
    for role, count in target.items():
        field = (fields or {}).get(role) or ROLE_FIELDS.get(role, role)
        if role not in roles:
            allowed = ", ".join(ROLE_FIELDS[r] for r in roles)
            raise ValueError(f"{field}: this server runs in {mode} mode, whose pools are {allowed}")
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_CORES_PER_ROLE:
            raise ValueError(f"{field}: must be an integer in [1, {MAX_CORES_PER_ROLE}], got {count!r}")
    return dict(target)


@dataclass(frozen=True, slots=True)
class ScaleStep:
    """One core added or removed (or that failed to start)."""

    role: str
    name: str
    action: str  # "added", "removed" or "failed"
    seconds: float  # from the scale's start to this core serving (added) or gone (removed)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    """One scale: who asked, the counts before, asked for and after, and its steps."""

    started_at: float  # Unix time
    source: str  # "admin" or "autoscale"
    before: dict[str, int]
    target: dict[str, int]
    after: dict[str, int]
    seconds: float
    steps: tuple[ScaleStep, ...]
    # Why nothing was done: no room for the new cores (CorePlacementError's message).
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(step.action != "failed" for step in self.steps)

    def to_json(self) -> dict:
        return asdict(self) | {"ok": self.ok}


class PoolScaler:
    def __init__(self, mode: str, members: Membership, supervisor: RestartSupervisor, *,
                 adopt: Callable[[Worker], None], leave: Callable[[str, float], Awaitable[Worker]],
                 cpus_of: Callable[[str], str | None]) -> None:
        self.mode = mode
        self.members = members
        self.supervisor = supervisor
        self.adopt = adopt
        self.leave = leave
        self.cpus_of = cpus_of  # the CPUs a new core of a role is bound to (its role's --*-cpus)
        self.history: deque[ScaleEvent] = deque(maxlen=HISTORY)
        self._lock = asyncio.Lock()
        self.target: dict[str, int] | None = None  # what the running scale asked for
        self._job: asyncio.Task | None = None  # the running scale's work
        self._stopped: str | None = None  # why no scale runs any more (the server stops)

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def counts(self) -> dict[str, int]:
        """The cores of each role that serve or are coming back (restarting)."""
        return {role: len(self._members_of(role)) for role in roles_of(self.mode)}

    def _members_of(self, role: str) -> list[Worker]:
        return [w for w in self.members.workers.values()
                if w.role == role and w.accepting and (w.alive or w.restarting)]

    async def scale(self, target: dict[str, int], *, source: str = "admin",
                    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, wait: bool = False,
                    fields: dict[str, str] | None = None) -> ScaleEvent:
        """Bring each role named in ``target`` to its count: reserve room for
        the missing cores, start them (in parallel) and drain the surplus
        (in parallel). Returns once every new core serves and every removed
        one is gone, or with nothing changed when there is no room for them.
        Raises ValueError (a bad target), ScaleInProgressError,
        ScaleStoppedError (the server stops, before or during the scale)."""
        target = check_target(target, self.mode, fields)
        if not drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
        if self._stopped is not None:
            raise ScaleStoppedError(self._stopped)
        if self._lock.locked() and not wait:
            raise ScaleInProgressError(f"a scale to {self.target} is in progress; try again when it ends")
        async with self._lock:
            if self._stopped is not None:  # stopped while this one queued
                raise ScaleStoppedError(self._stopped)
            self.target = target
            # A task of its own, so that ``stop`` can end it without ending
            # the caller (the admin's request answers 503 then).
            self._job = asyncio.ensure_future(self._scale(target, source, drain_timeout_s))
            try:
                return await self._job
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if self._stopped is not None and (current is None or not current.cancelling()):
                    raise ScaleStoppedError(f"{self._stopped}: the scale to {target} was ended") from None
                raise
            finally:
                self.target = None
                self._job = None

    def stop(self, reason: str) -> None:
        """No more scales: end the running one (its new cores and reserved
        room are removed) and refuse the rest. Called as the server begins
        to shut down, so that a scale waiting for room does not hold it."""
        if self._stopped is None:
            self._stopped = reason
        if self._job is not None and not self._job.done():
            logger.warning("%s: ending the scale to %s", reason, self.target)
            self._job.cancel()

    def _plan(self, target: dict[str, int]) -> tuple[list[tuple[str, str]], list[Worker]]:
        """The (role, name) of each core to add, and the workers to remove."""
        adds: list[tuple[str, str]] = []
        removes: list[Worker] = []
        taken: set[str] = set()
        for role, count in target.items():
            have = self._members_of(role)
            for _ in range(count - len(have)):
                name = self._free_name(role, taken)
                taken.add(name)
                adds.append((role, name))
            removes.extend(self._surplus(have, len(have) - count))
        return adds, removes

    async def _scale(self, target: dict[str, int], source: str, drain_timeout_s: float) -> ScaleEvent:
        start, wall = time.monotonic(), time.time()
        before = self.counts()
        adds, removes = self._plan(target)
        if adds or removes:
            logger.warning("scaling %s -> %s (%s)", before, {**before, **target}, source)
        try:
            await self.supervisor.reserve([(name, role) for role, name in adds])
        except CorePlacementError as exc:
            # Nothing started, nothing drained: the pools are as they were.
            logger.error("could not scale to %s: %s", {**before, **target}, exc)
            steps = tuple(ScaleStep(role, name, "failed", time.monotonic() - start, str(exc)) for role, name in adds)
            event = ScaleEvent(wall, source, before, target, self.counts(), time.monotonic() - start, steps,
                               str(exc))
            self.history.append(event)
            return event
        jobs = [self._add(role, name, start) for role, name in adds]
        jobs += [self._remove(worker, drain_timeout_s, start) for worker in removes]
        steps = tuple(await asyncio.gather(*jobs))
        event = ScaleEvent(wall, source, before, target, self.counts(), time.monotonic() - start, steps)
        if jobs:
            logger.warning("scaled to %s in %.1f s%s", event.after, event.seconds,
                           "" if event.ok else ": " + "; ".join(s.error or "" for s in steps if s.error))
        self.history.append(event)
        return event

    def _free_name(self, role: str, taken: set[str]) -> str:
        index = 0
        while f"{role}-{index}" in self.members.workers or f"{role}-{index}" in taken:
            index += 1
        return f"{role}-{index}"

    @staticmethod
    def _surplus(workers: list[Worker], n: int) -> list[Worker]:
        """The ``n`` cores to remove: restarting ones first, then the ones
        this server started before joined ones, the least busy, the newest."""
        if n <= 0:
            return []

        def cost(w: Worker) -> tuple:
            busy = len(w.requests) + len(w.queued_prefill)
            return (not w.restarting, not w.owned, busy, -int(w.name.rpartition("-")[2] or 0))

        return sorted(workers, key=cost)[:n]

    async def _add(self, role: str, name: str, start: float) -> ScaleStep:
        try:
            worker = await self.supervisor.start_new_core(name, role, self.cpus_of(role))
        except asyncio.CancelledError:
            self.supervisor.forget_core(name)  # stopped: its actor and reserved room go too
            raise
        except (EngineCoreStartError, ValueError, RuntimeError, OSError) as exc:
            logger.error("could not add %s: %s", name, exc)
            self.supervisor.forget_core(name)
            return ScaleStep(role, name, "failed", time.monotonic() - start, str(exc))
        if self.supervisor.stopping() or self.members.dead_error is not None:
            await self.supervisor.stop_new_core(worker)
            self.supervisor.forget_core(name)
            return ScaleStep(role, name, "failed", time.monotonic() - start, "the server is stopping")
        self.members.add(worker)
        self.adopt(worker)
        logger.warning("engine core %s added (pid %s)", name, worker.ready.pid)
        return ScaleStep(role, name, "added", time.monotonic() - start)

    async def _remove(self, worker: Worker, drain_timeout_s: float, start: float) -> ScaleStep:
        try:
            await self.leave(worker.name, drain_timeout_s)
        except (KeyError, ValueError) as exc:  # gone meanwhile, or the role's last
            return ScaleStep(worker.role, worker.name, "failed", time.monotonic() - start, str(exc))
        self.supervisor.forget_core(worker.name)
        return ScaleStep(worker.role, worker.name, "removed", time.monotonic() - start)
