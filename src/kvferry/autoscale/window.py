"""The measured workload: arrival rate and request lengths over the last
``window_s`` seconds, and the snapshot a decision plans from.

Idle window (no arrival in ``window_s``): with arrivals counted as they
come (``WorkloadWindow.record_arrival``), an idle window is truly idle and
the minimum layout becomes the answer, through the policy's scale-down
hysteresis. Fed with finished requests only, the counts are kept: a server
so overloaded that nothing finishes within the window looks idle too, and
must not be shrunk.
"""
from __future__ import annotations

import argparse
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvferry.autoscale.flags import DEFAULT_WINDOW_S
from kvferry.plan.workload import SimRequest

# Requests one evaluation replays: fewer finished requests than this are
# repeated (their arrival pattern continued), so a short window still shows
# its queueing; of more, the most recent SIM_MAX_REQUESTS (a decision must
# stay well under a second per layout on a busy 2-core host).
SIM_MIN_REQUESTS = 200
SIM_MAX_REQUESTS = 512
# Tokens per block key of the replayed prompts (at least the engine's block):
# the analytic cache and the router's index work per key, and prefix hits
# at this granularity are close enough for a capacity answer.
SIM_KEY_BLOCK = 64
_RATE_BUCKETS = 60  # the window's arrival counts: one bucket per window_s / 60


@dataclass(frozen=True, slots=True)
class RequestSample:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(frozen=True, slots=True)
class WindowSnapshot:
    """The window at one instant: what an evaluation plans from."""

    now: float
    window_s: float
    rate: float  # arrivals per second over the window (or the time since the window started, if shorter)
    num_arrivals: int
    samples: tuple[RequestSample, ...]  # finished requests that arrived within the window (most recent last)
    counts_arrivals: bool  # arrivals noted as they came (record_arrival), not only as they finished

    @property
    def num_requests(self) -> int:
        return len(self.samples)

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(s.prompt_tokens for s in self.samples) / len(self.samples) if self.samples else 0.0

    @property
    def mean_output_tokens(self) -> float:
        return sum(s.output_tokens for s in self.samples) / len(self.samples) if self.samples else 0.0

    @property
    def cached_fraction(self) -> float:
        prompt = sum(s.prompt_tokens for s in self.samples)
        return sum(s.cached_tokens for s in self.samples) / prompt if prompt else 0.0

    def to_requests(self, block_size: int = 16, num_requests: int = SIM_MIN_REQUESTS,
                    max_requests: int = SIM_MAX_REQUESTS) -> list:
        """The samples as the planner's workload (``plan.workload.SimRequest``),
        as ``kvferry plan --trace T --rate R`` makes one: the measured
        arrival pattern (the gaps between arrivals, in order) rescaled to
        the measured rate, continued cyclically to at least ``num_requests``
        requests (of more than ``max_requests`` samples, the most recent).
        ``block_size``: tokens per block key. A sample's cached tokens become blocks of one prefix that
        every request shares (the served cache's hits, whatever prefixes
        they came from); the rest of its prompt is its own."""
        if not self.samples or not self.rate > 0:
            return []
        ordered = sorted(self.samples, key=lambda s: s.arrival_s)[-max_requests:]
        gaps = [b.arrival_s - a.arrival_s for a, b in zip(ordered, ordered[1:])]
        gaps.append(sum(gaps) / len(gaps) if gaps else 0.0)  # the gap closing the cycle
        scale = len(gaps) / self.rate / sum(gaps) if sum(gaps) > 0 else None
        shared = [-(k + 1) for k in range(max(s.cached_tokens for s in ordered) // block_size + 1)]
        out, t = [], 0.0
        for i in range(max(num_requests, len(ordered))):
            s = ordered[i % len(ordered)]
            num_blocks = -(-s.prompt_tokens // block_size)
            num_shared = min(s.cached_tokens // block_size, num_blocks)
            ids = shared[:num_shared] + [(i + 1) * 1_000_000 + k for k in range(num_blocks - num_shared)]
            out.append(SimRequest(i, t, s.prompt_tokens, max(s.output_tokens, 1), tuple(_chain(ids)), block_size))
            t += gaps[i % len(gaps)] * scale if scale is not None else 1.0 / self.rate
        return out


def _chain(ids: list[int]) -> list[int]:
    """Prefix-chained block keys (as ``plan.workload`` chains a trace's ids)."""
    out, parent = [], 0
    for h in ids:
        parent = hash((parent, h)) & 0x7FFFFFFFFFFFFFFF
        out.append(parent)
    return out


class WorkloadWindow:
    """The arrival rate and request lengths of the last ``window_s`` seconds.

    Fed on the server's event loop: ``record`` with each finished request
    (O(1) amortized), ``record_arrival`` optionally with each arriving one
    (O(1)). Memory is bounded: at most ``max_samples`` finished requests
    (the most recent) and ``_RATE_BUCKETS`` arrival counters. Times are the
    caller's clock (``time.monotonic()`` in the server); ``now`` (default:
    that clock) is when the window starts, so the first minute's rate is
    over the time since then, not the whole window.

    The rate counts arrivals by their arrival time: with ``record_arrival``
    as they come; otherwise from the finished requests, which misses those
    still running (a small undercount at normal latencies, and all of them
    when nothing finishes within the window)."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_samples: int = 1024, now: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(window_s, (int, float)) and math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"--autoscale-window-s must be a number > 0, got {window_s!r}")
        if not isinstance(max_samples, int) or max_samples < 1:
            raise ValueError(f"max_samples must be an integer >= 1, got {max_samples!r}")
        self.window_s = float(window_s)
        self.max_samples = max_samples
        self.clock = clock
        self.started_s = clock() if now is None else now
        self._samples: deque[RequestSample] = deque(maxlen=max_samples)
        self._bucket_s = self.window_s / _RATE_BUCKETS
        self._bucket_ids = [-1] * _RATE_BUCKETS
        self._bucket_counts = [0] * _RATE_BUCKETS
        self._counts_arrivals = False

    @property
    def counts_arrivals(self) -> bool:
        return self._counts_arrivals

    def record_arrival(self, arrival_s: float) -> None:
        """A request arrived. Once called, the rate counts these arrivals
        (finished requests then only give lengths): overload, when requests
        take longer than the window to finish, is measured too."""
        self._counts_arrivals = True  # call it from the start: a request running at the switch is not counted
        self._count(arrival_s)

    def record(self, arrival_s: float, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> None:
        """A request finished (or failed: its tokens so far). Values that
        cannot describe a request (no prompt, a non-finite time) are
        ignored rather than raised: the server's loop must not fail here."""
        if not (isinstance(arrival_s, (int, float)) and math.isfinite(arrival_s)):
            return
        if not isinstance(prompt_tokens, int) or prompt_tokens < 1 or not isinstance(output_tokens, int):
            return
        cached = min(max(cached_tokens if isinstance(cached_tokens, int) else 0, 0), prompt_tokens)
        sample = RequestSample(float(arrival_s), prompt_tokens, max(output_tokens, 0), cached)
        self._samples.append(sample)
        horizon = arrival_s - self.window_s
        while self._samples and self._samples[0].arrival_s < horizon:
            self._samples.popleft()  # finish order is about arrival order: what is left over goes at snapshot
        if not self._counts_arrivals:
            self._count(arrival_s)

    def _count(self, arrival_s: float) -> None:
        if not (isinstance(arrival_s, (int, float)) and math.isfinite(arrival_s)):
            return
        idx = math.floor(arrival_s / self._bucket_s)
        slot = idx % _RATE_BUCKETS
        if self._bucket_ids[slot] != idx:
            if self._bucket_ids[slot] > idx:
                return  # older than the window the slot now holds
            self._bucket_ids[slot], self._bucket_counts[slot] = idx, 0
        self._bucket_counts[slot] += 1

    def snapshot(self, now: float | None = None) -> WindowSnapshot:
        """O(max_samples); take it on the thread that feeds the window."""
        now = self.clock() if now is None else now
        now_idx = math.floor(now / self._bucket_s)
        first_idx = now_idx - _RATE_BUCKETS + 1
        arrivals = sum(c for i, c in zip(self._bucket_ids, self._bucket_counts) if first_idx <= i <= now_idx)
        covered = now - max(self.started_s, first_idx * self._bucket_s)
        rate = arrivals / covered if covered > 0 else 0.0
        horizon = now - self.window_s
        samples = tuple(s for s in self._samples if horizon <= s.arrival_s <= now)
        return WindowSnapshot(now, self.window_s, rate, arrivals, samples, self._counts_arrivals)


def window_from_args(args: argparse.Namespace, now: float | None = None) -> WorkloadWindow:
    """The WorkloadWindow of --autoscale-window-s (start it when serving starts)."""
    return WorkloadWindow(args.autoscale_window_s, now=now)
