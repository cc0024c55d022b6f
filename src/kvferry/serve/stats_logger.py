"""The periodic stats line an operator reads in the server's log, as vLLM's:

    INFO kvferry.serve.stats_logger: engine stats: prompt 412.3 tok/s, generation 96.0 tok/s,
    running 4 reqs, waiting 0 reqs, KV cache 12.5%, prefix cache hit rate 37.5%, KV store hits 64/128 tokens (50.0%)

(one line). Every ``--log-stats-interval-s`` seconds (default 10; 0: off)
while the server is busy: an interval with no tokens and no request
running or waiting logs nothing, so an idle server's log stays still; the
interval in which a burst ends still logs, so the last line shows the
drain. Throughputs and hit rates are over the interval; running, waiting
and KV cache usage are as of its end. The KV store part appears only
where the cores use a store (its tiers report stats, or a lookup went to it).

It reads the same sources as /metrics: the token counts ServerMetrics
observes on the event loop, and the engine client's merged scheduler stats.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvferry.core.scheduler import SchedulerStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StatsSample:
    """The cumulative counters the line is computed from, at one instant."""
    time: float
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    kv_store_queries: int
    kv_store_hits: int


def _sample(now: float, prompt_tokens: int, generation_tokens: int, s: SchedulerStats) -> StatsSample:
    return StatsSample(now, prompt_tokens, generation_tokens, s.prefix_queries, s.prefix_hits,
                       s.kv_store_queries, s.kv_store_hits)


def _percent(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


def stats_line(prev: StatsSample, cur: StatsSample, s: SchedulerStats) -> str | None:
    """The line for the interval (prev, cur], with ``s`` the stats at its
    end; None when the server was idle throughout (nothing to report)."""
    prompt = cur.prompt_tokens - prev.prompt_tokens
    generation = cur.generation_tokens - prev.generation_tokens
    if prompt == 0 and generation == 0 and s.num_running == 0 and s.num_waiting == 0:
        return None
    dt = max(cur.time - prev.time, 1e-9)
    queries = cur.prefix_queries - prev.prefix_queries
    hits = cur.prefix_hits - prev.prefix_hits
    line = (f"engine stats: prompt {prompt / dt:.1f} tok/s, generation {generation / dt:.1f} tok/s, "
            f"running {s.num_running} reqs, waiting {s.num_waiting} reqs, "
            f"KV cache {_percent(s.kv_blocks_used, s.kv_blocks_total):.1f}%, "
            f"prefix cache hit rate {_percent(hits, queries):.1f}%")
    if s.kv_tiers or cur.kv_store_queries:
        store_queries = cur.kv_store_queries - prev.kv_store_queries
        store_hits = cur.kv_store_hits - prev.kv_store_hits
        line += f", KV store hits {store_hits}/{store_queries} tokens ({_percent(store_hits, store_queries):.1f}%)"
    return line


class StatsLogger:
    """Logs ``stats_line`` every ``interval_s`` (see the module docstring).

    ``tokens``: the cumulative (prompt, generation) tokens the front end has
    seen; ``stats``: the engine's merged scheduler stats."""

    def __init__(self, interval_s: float, tokens: Callable[[], tuple[int, int]],
                 stats: Callable[[], SchedulerStats]) -> None:
        if not interval_s > 0:
            raise ValueError(f"log_stats_interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.tokens = tokens
        self.stats = stats
        self._prev = self._take()[0]

    def _take(self) -> tuple[StatsSample, SchedulerStats]:
        s = self.stats()
        return _sample(time.monotonic(), *self.tokens(), s), s

    def log_once(self) -> str | None:
        """Log the line for the interval since the last call; returns it."""
        cur, s = self._take()
        line = stats_line(self._prev, cur, s)
        self._prev = cur
        if line is not None:
            logger.info("%s", line)
        return line

    async def run(self) -> None:
        """Until cancelled. A failure to read the stats (a core restarting)
        is logged and skipped: the stats line must never stop the server."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.log_once()
            except Exception:
                logger.exception("engine stats line failed")
