"""The load loop: sessions go out at their arrival times (or through a fixed
number of concurrent slots), each request is streamed and recorded, and the
whole run stays within its request and time bounds.

Bounds: at most ``num_requests`` requests are sent; none is sent after
``duration_s``; and at ``hard_deadline_s`` whatever is still running is
cancelled and counted as failed, so a run always ends.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

from kvferry.bench.arrivals import intervals
from kvferry.bench.client import request_body, send
from kvferry.bench.metrics import RequestRecord
from kvferry.bench.workloads import Message, Session


@dataclass(slots=True)
class RunConfig:
    base_url: str                   # http://host:port (no /v1)
    endpoint: str                   # "chat" | "completions"
    model: str
    api_key: str | None
    num_requests: int
    duration_s: float | None = None
    rate: float = math.inf          # sessions per second; inf: all at once
    burstiness: float = 1.0
    concurrency: int | None = None  # a fixed number of sessions in flight instead of a rate
    use_timestamps: bool = False    # trace replay at the trace's own arrival times
    ignore_eos: bool = False
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    hard_deadline_s: float = 3600.0
    seed: int = 0

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"


class _Budget:
    """Requests left to send, and the time after which none is sent."""

    def __init__(self, num_requests: int, duration_s: float | None, t0: float) -> None:
        self.left = num_requests
        self.stop_at = t0 + duration_s if duration_s is not None else math.inf

    @property
    def exhausted(self) -> bool:
        return self.left <= 0 or time.perf_counter() >= self.stop_at

    def take(self) -> bool:
        if self.exhausted:
            return False
        self.left -= 1
        return True


class _Run:
    def __init__(self, cfg: RunConfig, on_done: Callable[[RequestRecord], None]) -> None:
        self.cfg = cfg
        self.on_done = on_done
        self.records: list[RequestRecord] = []
        self.ids = itertools.count()
        self.t0 = time.perf_counter()
        self.budget = _Budget(cfg.num_requests, cfg.duration_s, self.t0)

    def headers(self, api_key: str | None) -> dict[str, str]:
        key = api_key or self.cfg.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def session(self, client: httpx.AsyncClient, s: Session, first_reserved: bool = False) -> None:
        """Send the session's requests in turn; ``first_reserved``: the caller
        already took the first request from the budget."""
        history: list[Message] = []
        for i, spec in enumerate(s.requests):
            if i and s.think_time_s:
                await asyncio.sleep(s.think_time_s)
            if not (i == 0 and first_reserved) and not self.budget.take():
                return
            messages = history + spec.messages if s.chained else spec.messages
            record = RequestRecord(next(self.ids), spec.tenant, 0.0, spec.input_len, spec.max_tokens)
            self.records.append(record)
            body = request_body(self.cfg.endpoint, self.cfg.model, messages, spec.max_tokens,
                                self.cfg.ignore_eos, self.cfg.temperature)
            try:
                reply = await send(client, self.cfg.url, self.headers(spec.api_key), body, self.cfg.endpoint,
                                   record, self.t0)
            finally:
                self.on_done(record)
            if not record.ok:
                return  # a broken conversation is not continued
            history = messages + [{"role": "assistant", "content": reply}]

    async def by_rate(self, client: httpx.AsyncClient, sessions: Iterator[Session], tasks: set) -> None:
        gaps = intervals(self.cfg.rate, self.cfg.burstiness, self.cfg.seed)
        next_at = self.t0
        for s in sessions:
            if self.cfg.use_timestamps and s.arrival_s is not None:
                next_at = self.t0 + s.arrival_s
            else:
                next_at += next(gaps)
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(min(delay, max(0.0, self.budget.stop_at - time.perf_counter())))
            if not self.budget.take():
                return
            task = asyncio.create_task(self.session(client, s, first_reserved=True))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def by_concurrency(self, client: httpx.AsyncClient, sessions: Iterator[Session]) -> None:
        async def worker() -> None:
            for s in sessions:  # one shared iterator: each session goes to one worker
                if self.budget.exhausted:
                    return
                await self.session(client, s)

        await asyncio.gather(*(worker() for _ in range(self.cfg.concurrency or 1)))


async def _run(cfg: RunConfig, sessions: Iterator[Session], on_done) -> tuple[list[RequestRecord], float]:
    run = _Run(cfg, on_done)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits, trust_env=False) as client:
        tasks: set[asyncio.Task] = set()
        if cfg.concurrency:
            main = asyncio.create_task(run.by_concurrency(client, sessions))
        else:
            main = asyncio.create_task(run.by_rate(client, sessions, tasks))
        deadline = run.t0 + cfg.hard_deadline_s
        await asyncio.wait([main], timeout=max(0.0, deadline - time.perf_counter()))
        while tasks and time.perf_counter() < deadline:
            await asyncio.wait(set(tasks), timeout=max(0.0, deadline - time.perf_counter()))
        pending = [t for t in (main, *tasks) if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if main.done() and not main.cancelled() and main.exception():
            raise main.exception()
    return run.records, time.perf_counter() - run.t0


def run_load(cfg: RunConfig, sessions: Iterator[Session], show_progress: bool,
             progress_total: int | None) -> tuple[list[RequestRecord], float]:
    """Run the load; returns the records (in send order) and the run's wall time."""
    with _progress(progress_total, show_progress) as on_done:
        return asyncio.run(_run(cfg, sessions, on_done))


class _progress:
    """A rich progress bar on stderr counting finished requests (no-op when off)."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.failed = 0

    def __enter__(self) -> Callable[[RequestRecord], None]:
        if not self.enabled:
            return lambda record: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(),
                            console=Console(stderr=True))
        self.task = self.bar.add_task("requests", total=self.total, failed=0)
        self.bar.start()
        return self.update

    def update(self, record: RequestRecord) -> None:
        self.failed += not record.ok
        self.bar.update(self.task, advance=1, failed=self.failed)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.stop()
