"""The autoscaling policy of ``kvferry serve --autoscale PROFILE``: how many
cores of each role to run for the load the server measures.

    server ──finished request──▶ WorkloadWindow ──snapshot──▶ Autoscaler.decide ──Decision──▶ apply (scale)
                                  (rate, lengths over         (kvferry plan's own candidate
                                   the last window_s)          evaluation, bounded, with hysteresis)

Every ``interval_s`` the autoscaler replays the window's requests (their
lengths, arrival pattern rescaled to the measured rate) through the
planner's analytic simulator (``kvferry plan --fast``: milliseconds per
layout) on each layout within the bounds, cheapest first, and keeps the
first that keeps ``min_attainment_pct`` of requests within the SLO:

- scale up (or re-split a disagg pool) at once when the current layout
  would miss the SLO and another within bounds would not (or, when none
  would, to the layout with the highest predicted attainment);
- scale down only after a cheaper layout has been the answer for
  ``down_after`` consecutive intervals and ``cooldown_s`` have passed since
  the last change; to the largest of those answers (the most cautious);
- a current layout outside the bounds is brought inside at once.

Idle window and thin windows: see ``window.py``. A window with arrivals
but fewer than ``min_requests`` finished ones is too thin to plan from:
the counts are kept.
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvferry.autoscale.flags import (DEFAULT_COOLDOWN_S, DEFAULT_DOWN_AFTER, DEFAULT_HISTORY, DEFAULT_INTERVAL_S,
                                     DEFAULT_MAX_CORES, DEFAULT_MIN_ATTAINMENT, DEFAULT_MIN_REQUESTS, _positive,
                                     parse_counts)
from kvferry.autoscale.window import SIM_KEY_BLOCK, WindowSnapshot, WorkloadWindow
from kvferry.bench.metrics import parse_slo
from kvferry.bench.step_cost import poor_fits
from kvferry.plan.hardware import Hardware
from kvferry.plan.instance import InstanceConfig
from kvferry.plan.latency import KVTransferModel, PlanError, StepCostModel, profile_handover_s
from kvferry.plan.search import evaluate
from kvferry.plan.simulator import ClusterConfig

logger = logging.getLogger(__name__)

MODE_ROLES: dict[str, tuple[str, ...]] = {"colocated": ("engine",), "disagg": ("prefill", "decode")}
SLO_NAMES = ("ttft", "tpot", "e2e", "itl")


# -- bounds --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ScaleBounds:
    """Per role the fewest and most cores, and the most in all."""

    mode: str
    min_counts: Mapping[str, int]
    max_counts: Mapping[str, int]
    max_cores: int = DEFAULT_MAX_CORES

    def __post_init__(self) -> None:
        if self.mode not in MODE_ROLES:
            raise ValueError(f"--mode: autoscaling needs colocated or disagg, got {self.mode!r}")
        roles = MODE_ROLES[self.mode]
        if not isinstance(self.max_cores, int) or self.max_cores < len(roles):
            raise ValueError(f"--autoscale-max-cores must be an integer >= {len(roles)} in {self.mode} mode, "
                             f"got {self.max_cores!r}")
        for flag, counts in (("--autoscale-min", self.min_counts), ("--autoscale-max", self.max_counts)):
            if set(counts) != set(roles):
                raise ValueError(f"{flag}: {self.mode} mode scales {' and '.join(roles)}, got "
                                 f"{', '.join(sorted(counts)) or 'nothing'}")
            for role, n in counts.items():
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ValueError(f"{flag}: {role} must be an integer >= 1, got {n!r}")
        for role in roles:
            if self.min_counts[role] > self.max_counts[role]:
                raise ValueError(f"--autoscale-min: {role}={self.min_counts[role]} is above --autoscale-max "
                                 f"{role}={self.max_counts[role]}")
        if sum(self.min_counts.values()) > self.max_cores:
            raise ValueError(f"--autoscale-max-cores {self.max_cores} is below the minimum layout "
                             f"({_text(self.min_counts)}: {sum(self.min_counts.values())} cores)")

    @classmethod
    def of(cls, mode: str, min_counts: Mapping[str, int] | None = None, max_counts: Mapping[str, int] | None = None,
           max_cores: int = DEFAULT_MAX_CORES) -> ScaleBounds:
        """Defaults: at least 1 of each role, at most ``max_cores`` (less the
        other roles' minimum) of each."""
        roles = MODE_ROLES.get(mode)
        if roles is None:
            raise ValueError(f"--mode: autoscaling needs colocated or disagg, got {mode!r}")
        low = dict(min_counts) if min_counts is not None else {r: 1 for r in roles}
        if max_counts is None:
            others = {r: sum(low.get(o, 1) for o in roles if o != r) for r in roles}
            max_counts = {r: max(max_cores - others[r], low.get(r, 1)) if isinstance(max_cores, int) else 1
                          for r in roles}
        return cls(mode, low, dict(max_counts), max_cores)

    @property
    def roles(self) -> tuple[str, ...]:
        return MODE_ROLES[self.mode]

    def contains(self, counts: Mapping[str, int]) -> bool:
        return (all(self.min_counts[r] <= counts[r] <= self.max_counts[r] for r in self.roles)
                and sum(counts[r] for r in self.roles) <= self.max_cores)

    def clamp(self, counts: Mapping[str, int]) -> dict[str, int]:
        """The nearest layout within bounds: each role clamped, then roles
        above their minimum trimmed (the largest first) to fit max_cores."""
        out = {r: min(max(counts.get(r, 0), self.min_counts[r]), self.max_counts[r]) for r in self.roles}
        while sum(out.values()) > self.max_cores:
            role = max((r for r in self.roles if out[r] > self.min_counts[r]), key=lambda r: out[r])
            out[role] -= 1
        return out

    def layouts(self) -> list[dict[str, int]]:
        """Every layout within bounds, fewest cores first."""
        if self.mode == "colocated":
            return [{"engine": c} for c in range(self.min_counts["engine"],
                                                 min(self.max_counts["engine"], self.max_cores) + 1)]
        out = [{"prefill": p, "decode": d}
               for p in range(self.min_counts["prefill"], self.max_counts["prefill"] + 1)
               for d in range(self.min_counts["decode"], self.max_counts["decode"] + 1) if p + d <= self.max_cores]
        return sorted(out, key=lambda c: (sum(c.values()), c["prefill"]))

    def to_json(self) -> dict:
        return {"min": dict(self.min_counts), "max": dict(self.max_counts), "max_cores": self.max_cores}


def _cores(counts: Mapping[str, int]) -> int:
    return sum(counts.values())


def _text(counts: Mapping[str, int]) -> str:
    """engine=3, or prefill=1,decode=2 (as the flags write them)."""
    return ",".join(f"{r}={counts[r]}" for r in ("engine", "prefill", "decode") if r in counts)


# -- decisions ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Decision:
    """One change of layout: what, why, and whether it was applied."""

    time: float  # the server's clock (monotonic) when decided
    wall_time: float  # Unix time when decided
    from_counts: dict[str, int]
    to_counts: dict[str, int]
    direction: str  # "up", "down", "rebalance" (as many cores, split otherwise) or "bounds"
    rate: float  # measured arrivals per second
    num_requests: int  # finished requests in the window the plan replayed
    mean_prompt_tokens: float
    mean_output_tokens: float
    reason: str
    predicted_attainment_pct: float | None  # of to_counts (None: not planned, e.g. bounds)
    current_attainment_pct: float | None  # of from_counts
    applied: bool | None = None  # None: not yet applied
    error: str | None = None  # why applying failed

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Decision:
        return cls(**{f: data[f] for f in cls.__dataclass_fields__})

    def log_line(self) -> str:
        pred = "" if self.predicted_attainment_pct is None else f", predicted {self.predicted_attainment_pct:.1f}%"
        return (f"autoscale {self.direction}: {_text(self.from_counts)} -> {_text(self.to_counts)} at "
                f"{self.rate:.3g} req/s (prompt {self.mean_prompt_tokens:.0f}, output {self.mean_output_tokens:.0f} "
                f"tokens, {self.num_requests} requests){pred}: {self.reason}")


@dataclass(slots=True)
class _Evaluation:
    counts: dict[str, int]
    attainment_pct: float
    qualifies: bool
    # the worst SLO metric at the attainment target's percentile over its
    # limit (inf: that share of requests failed): how far a layout that
    # misses is from meeting, when several keep no request within the SLO
    overshoot: float = math.inf


# -- the policy -------------------------------------------------------------------------------
class Autoscaler:
    """Which layout to run for the measured load (see the module's doc).

    ``profile``: a ``kvferry profile`` JSON path; ``slo``: seconds per
    metric (``{"ttft": 0.5, "tpot": 0.05}``, as ``bench.metrics.parse_slo``
    gives); ``bounds``: a ``ScaleBounds`` whose mode is the server's.
    ``instance``: the cores' engine limits (``plan.instance.InstanceConfig``;
    default the planner's). Raises ValueError naming the flag."""

    def __init__(self, profile: str, mode: str, slo: Mapping[str, float], bounds: ScaleBounds,
                 interval_s: float = DEFAULT_INTERVAL_S, *, down_after: int = DEFAULT_DOWN_AFTER,
                 cooldown_s: float = DEFAULT_COOLDOWN_S, min_requests: int = DEFAULT_MIN_REQUESTS,
                 min_attainment_pct: float = DEFAULT_MIN_ATTAINMENT, allow_poor_fit: bool = False,
                 instance=None, router: str | None = None, history: int = DEFAULT_HISTORY) -> None:
        if bounds.mode != mode:
            raise ValueError(f"--mode: the bounds are for {bounds.mode} mode, the server runs {mode}")
        if not slo:
            raise ValueError("--autoscale-slo: autoscaling needs an SLO (e.g. ttft:500,tpot:50, or --ttft-slo-ms / "
                             "--tpot-slo-ms)")
        for name, limit in slo.items():
            if name not in SLO_NAMES or not isinstance(limit, (int, float)) or not (math.isfinite(limit) and limit > 0):
                raise ValueError(f"--autoscale-slo: expected {'/'.join(SLO_NAMES)} limits > 0, got {name}={limit!r}")
        _positive(interval_s, "--autoscale-interval-s")
        _positive(cooldown_s, "--autoscale-cooldown-s", allow_zero=True)
        for value, flag in ((down_after, "--autoscale-down-after"), (min_requests, "--autoscale-min-requests"),
                            (history, "history")):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
        if not (isinstance(min_attainment_pct, (int, float)) and 0 < min_attainment_pct <= 100):
            raise ValueError(f"--autoscale-min-attainment must be in (0, 100], got {min_attainment_pct!r}")
        self.profile = str(profile)
        cost, handover_s = load_profile(self.profile, allow_poor_fit)  # once: every decision reuses it
        self.mode, self.slo, self.bounds = mode, dict(slo), bounds
        self.interval_s, self.down_after, self.cooldown_s = float(interval_s), down_after, float(cooldown_s)
        self.min_requests, self.min_attainment_pct = min_requests, float(min_attainment_pct)
        self.instance = instance if instance is not None else InstanceConfig()
        self.router = router
        self._hardware = Hardware("profile", self.profile, None, cost)
        self._transfer = KVTransferModel(latency_s=handover_s)
        self._history: deque[Decision] = deque(maxlen=history)
        self._streak: list[dict[str, int]] = []  # cheaper answers of consecutive intervals
        self._last_change: float | None = None  # when the last decision was taken
        self.last_evaluation: dict | None = None  # what the latest decide() saw and answered

    # -- the answer -----------------------------------------------------------------------
    @property
    def history(self) -> list[Decision]:
        """The last decisions, oldest first (with whether each was applied)."""
        return list(self._history)

    def decide(self, window: WorkloadWindow | WindowSnapshot, current: Mapping[str, int],
               now: float) -> Decision | None:
        """The change to make now, or None. ``current``: the counts running
        (roles of the mode; a missing role is 0). Runs the planner: keep it
        off the event loop (``run`` does), with a snapshot taken on it."""
        start = time.perf_counter()
        roles = self.bounds.roles
        extra = set(current) - set(roles)
        if extra:
            raise ValueError(f"current counts: {self.mode} mode has roles {', '.join(roles)}, got "
                             f"{', '.join(sorted(extra))}")
        current = {r: int(current.get(r, 0)) for r in roles}
        snap = window.snapshot(now) if isinstance(window, WorkloadWindow) else window
        note = dict(time=now, current=current, rate=snap.rate, num_arrivals=snap.num_arrivals,
                    num_requests=snap.num_requests)

        def hold(reason: str, **more) -> None:
            self.last_evaluation = {**note, "outcome": "hold", "reason": reason, **more,
                                    "streak": len(self._streak), "wall_s": time.perf_counter() - start}

        if not self.bounds.contains(current):
            target = self.bounds.clamp(current)
            self._streak.clear()
            return self._decide(now, snap, current, target, "bounds",
                                f"{_text(current)} is outside the bounds (min {_text(self.bounds.min_counts)}, "
                                f"max {_text(self.bounds.max_counts)}, at most {self.bounds.max_cores} cores)",
                                None, None, note, start)
        if snap.num_arrivals == 0 and snap.num_requests == 0:
            if not snap.counts_arrivals:
                self._streak.clear()
                hold(f"no request finished in the last {snap.window_s:g} s: keeping {_text(current)} (arrivals "
                     "are not counted as they come, so this may be an overload where nothing finishes)")
                return None
            minimum = {r: self.bounds.min_counts[r] for r in roles}
            if minimum == current:
                self._streak.clear()
                hold(f"idle: already at the minimum {_text(current)}")
                return None
            return self._toward_cheaper(now, snap, current, minimum, None, None, note, start,
                                        f"no request arrived in the last {snap.window_s:g} s")
        if snap.num_requests < self.min_requests or not snap.rate > 0:
            self._streak.clear()
            hold(f"{snap.num_requests} finished requests in the last {snap.window_s:g} s, fewer than "
                 f"{self.min_requests}: too few to plan from; keeping {_text(current)}")
            return None

        requests = snap.to_requests(max(self.instance.block_size, SIM_KEY_BLOCK))
        # The served router places by cached prefix; without measured hits that is
        # least-loaded placement, which the planner runs without a prefix index.
        router = self.router or ("prefix-aware" if snap.cached_fraction > 0 else "least-loaded")
        evaluated: dict[tuple, _Evaluation] = {}

        def evaluate(counts: dict[str, int]) -> _Evaluation:
            key = tuple(counts[r] for r in roles)
            if key not in evaluated:
                evaluated[key] = self._evaluate(requests, counts, snap.rate, router)
            return evaluated[key]

        now_eval = evaluate(current)
        answer = None
        layouts = self.bounds.layouts()
        for cores in sorted({_cores(c) for c in layouts}):
            if now_eval.qualifies and cores > _cores(current):
                break  # the current layout is an answer; nothing dearer is needed
            level = [evaluate(c) for c in layouts if _cores(c) == cores]
            good = [e for e in level if e.qualifies]
            if good:  # the cheapest level that meets the SLO; its best split (the current one on a tie)
                answer = max(good, key=lambda e: (e.attainment_pct, e.counts == current))
                break
        if now_eval.qualifies:
            answer = answer or now_eval
            if _cores(answer.counts) < _cores(current):
                return self._toward_cheaper(now, snap, current, answer.counts, answer.attainment_pct,
                                            now_eval.attainment_pct, note, start, "a cheaper layout meets the SLO",
                                            lambda counts: evaluate(counts).attainment_pct)
            self._streak.clear()
            hold(f"{_text(current)} meets the SLO (predicted {now_eval.attainment_pct:.1f}%) and nothing cheaper does",
                 attainment_pct=now_eval.attainment_pct)
            return None
        self._streak.clear()
        target_pct = f"{self.min_attainment_pct:g}%"
        if answer is None:  # nothing within bounds meets the SLO: the nearest, the largest on a tie (overload)
            answer = max((evaluate(c) for c in layouts),
                         key=lambda e: (round(e.attainment_pct, 1), -round(e.overshoot, 3), _cores(e.counts),
                                        e.counts == current))
            if answer.counts == current:
                hold(f"no layout within bounds meets the SLO; {_text(current)} has the highest predicted attainment "
                     f"({now_eval.attainment_pct:.1f}% < {target_pct})", attainment_pct=now_eval.attainment_pct)
                return None
            why = (f"{_text(current)} would keep {now_eval.attainment_pct:.1f}% of requests within the SLO "
                   f"(< {target_pct}); no layout within bounds meets it, {_text(answer.counts)} comes nearest")
        else:
            why = (f"{_text(current)} would keep {now_eval.attainment_pct:.1f}% of requests within the SLO "
                   f"(< {target_pct}); {_text(answer.counts)} is the cheapest that meets it")
        direction = "up" if _cores(answer.counts) > _cores(current) else "rebalance"
        return self._decide(now, snap, current, answer.counts, direction, why, answer.attainment_pct,
                            now_eval.attainment_pct, note, start)

    def _toward_cheaper(self, now: float, snap: WindowSnapshot, current: dict[str, int], answer: dict[str, int],
                        answer_pct: float | None, current_pct: float | None, note: dict, start: float,
                        why: str, score: Callable[[dict[str, int]], float] | None = None) -> Decision | None:
        """Scale down only after ``down_after`` consecutive cheaper answers
        and the cool-down; then to the dearest of those answers (``score``:
        a layout's predicted attainment now, when there is a workload)."""
        self._streak.append(dict(answer))
        del self._streak[:-self.down_after]
        cooling = self._last_change is not None and now - self._last_change < self.cooldown_s
        if len(self._streak) < self.down_after or cooling:
            wait = (f"{len(self._streak)} of {self.down_after} intervals" if len(self._streak) < self.down_after
                    else f"cool-down: {self.cooldown_s - (now - self._last_change):.0f} s left")
            self.last_evaluation = {**note, "outcome": "hold", "answer": dict(answer), "attainment_pct": answer_pct,
                                    "reason": f"{why} ({_text(answer)}); scale-down pending: {wait}",
                                    "streak": len(self._streak), "wall_s": time.perf_counter() - start}
            return None
        target = max(reversed(self._streak), key=_cores)  # the most cautious of the cheaper answers, latest first
        self._streak.clear()
        pct = answer_pct if target == answer else score(target) if score is not None else None
        reason = (f"{why} ({_text(target)}" + (f", predicted {pct:.1f}%" if pct is not None else "")
                  + f") for {self.down_after} consecutive intervals")
        return self._decide(now, snap, current, target, "down", reason, pct, current_pct, note, start)

    def _decide(self, now: float, snap: WindowSnapshot, current: dict[str, int], target: dict[str, int],
                direction: str, reason: str, target_pct: float | None, current_pct: float | None, note: dict,
                start: float) -> Decision:
        decision = Decision(now, time.time(), dict(current), dict(target), direction, snap.rate, snap.num_requests,
                            snap.mean_prompt_tokens, snap.mean_output_tokens, reason, target_pct, current_pct)
        self._history.append(decision)
        self._last_change = now
        self.last_evaluation = {**note, "outcome": direction, "answer": dict(target), "attainment_pct": target_pct,
                                "reason": reason, "streak": 0, "wall_s": time.perf_counter() - start}
        return decision

    def _evaluate(self, requests: list, counts: dict[str, int], rate: float,
                  router: str = "least-loaded") -> _Evaluation:
        """One layout through ``kvferry plan``'s own candidate evaluation
        (``plan.search.evaluate``), analytic mode."""
        if self.mode == "colocated":
            cluster = ClusterConfig(num_colocated=counts["engine"], instance=self.instance, router=router,
                                    fast=True)
        else:
            cluster = ClusterConfig(num_colocated=0, num_prefill=counts["prefill"], num_decode=counts["decode"],
                                    instance=self.instance, router=router, transfer=self._transfer, fast=True)
        result = evaluate(requests, self.slo, cluster, self._hardware, None, rate, self.min_attainment_pct)
        pct = result["slo_attainment_pct"]
        at = result["at_target_ms"]
        over = max(math.inf if at.get(k) is None else at[k] / (1000.0 * limit) for k, limit in self.slo.items())
        return _Evaluation(dict(counts), pct, pct >= self.min_attainment_pct, over)

    def _mark(self, decision: Decision, applied: bool, error: str | None) -> Decision:
        done = replace(decision, applied=applied, error=error)
        for i in range(len(self._history) - 1, -1, -1):
            if self._history[i] is decision:
                self._history[i] = done
                break
        return done

    # -- the loop --------------------------------------------------------------------------
    async def run(self, window: WorkloadWindow,
                  current_fn: Callable[[], Mapping[str, int] | Awaitable[Mapping[str, int]]],
                  apply_fn: Callable[[dict[str, int]], Awaitable[Any]],
                  clock: Callable[[], float] | None = None) -> None:
        """Every ``interval_s``: the current counts, a decision, and when
        there is one an INFO line and ``await apply_fn(to_counts)`` (it
        should return once the cores are added or drained: the next
        interval starts after it). The planner runs in a worker thread off
        the event loop. An exception (from current_fn, the planner or
        apply_fn) is logged and the loop goes on; cancel the task to stop."""
        clock = clock or window.clock
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                current = current_fn()
                if inspect.isawaitable(current):
                    current = await current
                now = clock()
                snap = window.snapshot(now)  # here, on the loop that feeds the window
                decision = await asyncio.to_thread(self.decide, snap, current, now)
            except Exception:
                logger.exception("autoscale: the decision failed; trying again in %g s", self.interval_s)
                continue
            if decision is None:
                continue
            logger.info(decision.log_line())
            try:
                await apply_fn(dict(decision.to_counts))
            except Exception as exc:
                # One line: a full cluster fails every interval, and its
                # error already says what is missing (the trace at debug).
                logger.error("autoscale: applying %s failed: %s: %s", _text(decision.to_counts),
                             type(exc).__name__, exc)
                logger.debug("autoscale: the failed apply", exc_info=True)
                self._mark(decision, False, f"{type(exc).__name__}: {exc}")
            else:
                self._mark(decision, True, None)

    def status(self) -> dict:
        """What ``GET /v1/admin/scale`` shows of the autoscaler."""
        return {"profile": self.profile, "mode": self.mode, "slo_ms": {k: v * 1000.0 for k, v in self.slo.items()},
                "bounds": self.bounds.to_json(), "interval_s": self.interval_s, "down_after": self.down_after,
                "cooldown_s": self.cooldown_s, "min_requests": self.min_requests,
                "min_attainment_pct": self.min_attainment_pct, "last_evaluation": self.last_evaluation,
                "decisions": [d.to_json() for d in self.history]}


def load_profile(path: str, allow_poor_fit: bool):
    """(step cost model, measured hand-over s) of a ``kvferry profile`` JSON,
    refused as ``kvferry plan`` refuses it (unreadable, not a profile, or
    poor fits unless ``allow_poor_fit``: then a WARNING is logged).
    Raises ValueError naming ``--autoscale``."""
    try:
        cost, handover_s = StepCostModel.from_profile(path), profile_handover_s(path)
        data = json.loads(Path(path).read_text())
    except PlanError as e:  # "--profile: cannot read ..." / "... is not a kvferry profile JSON"
        raise ValueError(f"--autoscale: {str(e).removeprefix('--profile: ')}") from None
    try:
        problems = poor_fits(data)
    except (AttributeError, TypeError):  # from_profile read it: a shape poor_fits does not know
        problems = []
    if problems:
        what = "; ".join(problems)
        if not allow_poor_fit:
            raise ValueError(f"--autoscale: {path}: {what} (or pass --autoscale-allow-poor-fit to use it anyway)")
        logger.warning("--autoscale %s: %s; --autoscale-allow-poor-fit: using it anyway, so expect the "
                       "predictions to be off", path, what)
    return cost, handover_s


def autoscaler_from_args(args: argparse.Namespace, mode: str, slo: Mapping[str, float] | None = None,
                         engine_args=None) -> Autoscaler | None:
    """The Autoscaler the flags ask for (None without --autoscale).
    ``slo``: the server's own SLO in seconds (e.g. {"ttft": 0.5} from
    --ttft-slo-ms), used unless --autoscale-slo is given. ``engine_args``
    (``EngineArgs``): the cores' limits the plan simulates (block size, KV
    blocks, batch limits, prefix caching); default the planner's. Raises
    ValueError naming the flag."""
    if args.autoscale is None:
        return None
    if args.autoscale_slo is not None:
        try:
            slo = parse_slo(args.autoscale_slo)
        except ValueError as e:
            raise ValueError(f"--autoscale-slo: {str(e).removeprefix('--slo: ')}") from None
    counts = [parse_counts(text, flag) if text is not None else None
              for text, flag in ((args.autoscale_min, "--autoscale-min"), (args.autoscale_max, "--autoscale-max"))]
    bounds = ScaleBounds.of(mode, counts[0], counts[1], args.autoscale_max_cores)
    instance = None
    if engine_args is not None:
        instance = InstanceConfig(engine_args.num_kv_blocks or InstanceConfig().num_kv_blocks, engine_args.block_size,
                                  engine_args.max_num_seqs, engine_args.max_num_batched_tokens,
                                  engine_args.enable_prefix_caching)
    return Autoscaler(args.autoscale, mode, slo or {}, bounds, args.autoscale_interval_s,
                      down_after=args.autoscale_down_after, cooldown_s=args.autoscale_cooldown_s,
                      min_requests=args.autoscale_min_requests, min_attainment_pct=args.autoscale_min_attainment,
                      allow_poor_fit=args.autoscale_allow_poor_fit, instance=instance)
