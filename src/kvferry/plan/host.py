"""Instances that share a host slow each other while both step.

Two engine cores pinned to different CPUs of one small host still compete:
for the memory bus and the last-level cache, and with the front end's
threads, which run on whichever CPU is free. A served disaggregated
profile (``kvferry profile --url``) measures what that costs: a prefill
step while the decode core runs a batch, and a decode step while the
prefill core runs a prompt, each over the same step alone
(``host_sharing`` in its JSON).

The simulator places instances on hosts (``--instances-per-host``; 1, the
default, gives each its own host and this module no effect). A running
step holds ``work``: the seconds it takes alone. It progresses at rate 1
while no other instance of its host steps and at ``1 / factor`` while one
does; every step start or end on a host re-times the steps running there::

    A alone: rate 1 │ A and B: rate 1/f each │ B alone: rate 1
    ────────────────┼────────────────────────┼─────────────────▶ t
                 B starts                 A ends

No torch, no I/O: pure bookkeeping the simulator calls.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostSharing:
    """Slowdowns of a step while another instance of its host steps (>= 1)."""

    prefill: float = 1.0  # a step that carries prefill tokens
    decode: float = 1.0  # a decode-only step

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            if not getattr(self, name) >= 1.0:
                raise ValueError(f"host_sharing.{name} must be >= 1 (sharing never speeds a step up), "
                                 f"got {getattr(self, name)}")

    @classmethod
    def from_json(cls, data: dict | None) -> HostSharing | None:
        """A profile's ``host_sharing`` (None when it measured none: an
        in-process profile, or a server whose cores never overlap)."""
        if not data:
            return None
        return cls(float(data.get("prefill") or 1.0), float(data.get("decode") or 1.0))

    def factor(self, has_prefill: bool) -> float:
        return self.prefill if has_prefill else self.decode


@dataclass(slots=True)
class _Running:
    work_left: float  # seconds of the step still to run alone
    factor: float  # its slowdown while another instance of the host steps
    rate: float  # its progress now (1 or 1 / factor)
    since: float  # when work_left was last brought up to date
    work: float  # the step's seconds alone, as started
    started: float
    version: int  # bumped on each re-timing: older step-end events are stale


class HostClock:
    """The end times of steps on shared hosts.

    ``start``/``finish`` return the (instance, end, version) of every step
    whose end moved (the started one included); the simulator schedules
    those and drops step-end events whose version is no longer current."""

    def __init__(self, hosts: list[list[object]], sharing: HostSharing | None) -> None:
        self.sharing = sharing
        self.host_of = {inst: i for i, members in enumerate(hosts) for inst in members}
        self.members = hosts
        self.running: dict[object, _Running] = {}
        self._versions: dict[object, int] = {}

    def start(self, inst, now: float, work: float, has_prefill: bool) -> list[tuple[object, float, int]]:
        factor = self.sharing.factor(has_prefill) if self.sharing is not None else 1.0
        version = self._versions.get(inst, 0) + 1
        self._versions[inst] = version
        self._advance(inst, now)
        self.running[inst] = _Running(work, factor, 1.0, now, work, now, version)
        return self._retime(inst, now, force=inst)

    def finish(self, inst, now: float) -> tuple[float, list[tuple[object, float, int]]]:
        """How much longer the finished step took than alone, and the
        re-timed steps of its host."""
        self._advance(inst, now)
        step = self.running.pop(inst)
        return now - step.started - step.work, self._retime(inst, now)

    def is_current(self, inst, version: int) -> bool:
        step = self.running.get(inst)
        return step is not None and step.version == version

    def _neighbours(self, inst) -> list:
        return [o for o in self.members[self.host_of[inst]] if o is not inst and o in self.running]

    def _advance(self, inst, now: float) -> None:
        """Bring every running step of ``inst``'s host up to ``now``."""
        for other in self._neighbours(inst) + ([inst] if inst in self.running else []):
            step = self.running[other]
            step.work_left = max(step.work_left - (now - step.since) * step.rate, 0.0)
            step.since = now

    def _retime(self, inst, now: float, force=None) -> list[tuple[object, float, int]]:
        moved = []
        host = [o for o in self.members[self.host_of[inst]] if o in self.running]
        for member in host:
            step = self.running[member]
            rate = 1.0 / step.factor if len(host) > 1 else 1.0
            if rate == step.rate and member is not force:
                continue
            step.rate = rate
            step.version = self._versions[member] = self._versions[member] + 1
            moved.append((member, now + step.work_left / rate, step.version))
        return moved


def place(front: list, back: list, per_host: int) -> list[list]:
    """Hosts of ``per_host`` instances each, filled in the order prefill-0,
    decode-0, prefill-1, decode-1, ... (the unpaired rest last): each host
    then holds a mix of the two pools, as a 1+1 pair on one box does."""
    if per_host < 1:
        raise ValueError(f"instances_per_host must be >= 1, got {per_host}")
    order = [inst for pair in zip(front, back) for inst in pair]
    n = min(len(front), len(back))
    order += front[n:] + back[n:]
    return [order[i:i + per_host] for i in range(0, len(order), per_host)]
