"""``kvferry profile --url URL``: the step-time fits measured through a live
server, as a client sees them.

The in-process profile (``profile.py``) times ``engine.step()`` alone. A
served request also pays what that leaves out: HTTP and tokenization on the
way in, the front end <-> engine process hop, detokenization and SSE on the
way out, the front end's threads competing with the engine's for the same
CPUs, and in disagg mode the prefill -> decode hand-over. Measured at the
client, these land where the simulator charges them:

- prefill: TTFT of a lone chat request (``max_tokens`` 1) of ``new`` words
  after a ``cached``-word system prompt warmed by an earlier request; the fit's intercept then
  holds the per-request overhead. Token counts are the server's usage
  (``prompt_tokens``, ``cached_tokens``), not the asked ones.
- decode: ``batch`` concurrent streams (``ignore_eos``); once every stream
  has its second token, the median gap between chunks is the step time at
  that batch, detokenization and IPC included. Like the prefill points,
  ``grid.repeats`` rounds over the whole grid, a point's time the median of
  its rounds (a slow spell falls on one round of a point, not on a point).
- fits: robust (Huber IRLS, non-negative, relative residuals: ``fit``), so
  that a point a slow spell still moved weighs little; ``quality``
  (``fit_quality``) says how far the points sit from their fits, whether
  the decode rounds drifted and the step noise's mean, and warns (stderr)
  past its thresholds.
- hand-over (disagg): a lone stream's gap between its first token (from the
  prefill core) and its second (from the decode core) less a decode step:
  the KV transfer and the decode core's first step.

- request overhead: what a TTFT spends outside engine steps. A kvferry
  server exports its own step time (``kvferry:engine_step_seconds`` in
  /metrics): each prefill sample reads it before and after, the prefill fit
  is fitted to those step times, and the overhead is the median over every
  prefill sample of its TTFT less its step (``request_overhead_from``
  "engine_step_seconds"). Another server: a one-word request's TTFT less its
  engine step as the fits put it (the decode fit's intercept plus the
  prefill fit's per-token terms), taken out of the prefill points before
  the fit. Either way a prefill point keeps its client TTFT as ``ttft_s``,
  the fits stay engine step times and the simulator adds the overhead to
  each request's arrival.

- mixed steps: ``batch`` streams decode; once each has a few tokens, a
  newcomer's prompt of ``new`` words arrives, and the step that prefills it
  also decodes the streams. Its length is the gap each stream sees ending
  at the newcomer's first token (median over the streams). What it costs
  beyond the prefill and decode fits' sum is the ``mixed`` fit
  (``fit_mixed``).
- host sharing: a disaggregated server never mixes (its workers' roles,
  ``GET /v1/admin/workers``; a server without that view mixes unless its
  "mixed" steps are far shorter than their newcomers' prefills,
  ``server_mixes``): its "mixed" samples saw decode steps alone. They measure instead how the two cores of one host
  slow each other (``host_sharing``): the newcomer's prefill while the
  decode core runs the streams (its TTFT less the request overhead and the
  routing hop: the decode core admits it at its next step and answers at
  that step's end, 1.5 decode steps on average) over the same prompt
  length's prefill with the decode core idle, sent just before the streams
  (a pair a few seconds apart: a shared machine's load drifts less within
  it than over the whole profile), and the streams' steps during that
  prefill over their steps before it.
  Such samples join neither the mixed fit nor the step noise.
- step noise: every sample's step time over its fit's prediction (each
  prefill repeat, each steady decode gap), kept whole as ``step_noise``:
  the simulator draws each step's time from it, so that queueing and the
  p99s see the spread a single fitted time hides.

- first-token delay: a prefill sample asks for one token, so the engine
  idles once it is out. A served request asks for more, and its first token
  leaves while the engine already runs the next step on the same CPUs: the
  median TTFT of such requests (``LONG_MAX_TOKENS``) less that of one-token
  requests of the same (the grid's shortest) length, interleaved over many
  pairs, each sent to a server idle for ``idle_gap_s`` (``--idle-gap``), is
  ``first_token_delay_s``; the
  simulator adds it to a token that ends a request's phase (first, last)
  when its instance steps on.

Same fits and JSON as the in-process profile, plus ``served`` (the URL),
``request_overhead_s``, ``first_token_delay_s``, ``handover_s``, ``mixed``,
``step_noise`` and ``host_sharing``. Time: about (prefill cells + mixed
cells + decode points) x ``repeats`` samples of a second or less each; the
validation grid (10 + 4 + 8 cells, 3 repeats) takes roughly a minute on 2
CPUs (an estimate; the decode rounds add about 20 s over a single pass).
The largest decode batches cost most: each stream outlives the others'
prefills, so a batch of 16 at a long context runs hundreds of steps.
``Progress`` prints a line per sample with the elapsed time and an
estimate of what is left, so a long profile is never silent.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import sys
import time

import httpx

from kvferry.bench.profile import (DECODE_TERMS, PREFILL_TERMS, ProfileGrid, fit, fit_mixed, fit_quality,
                                   predict, warn_quality)
from kvferry.bench.prom import parse_counters
from kvferry.bench.text import random_words

# Tokens the first-token delay's requests ask for: enough that the engine
# keeps stepping while the first token travels out.
LONG_MAX_TOKENS = 4
# What a decode stream of a mixed point asks for: more than it lives (it is
# cancelled at the newcomer's first token), within any context length served.
MIXED_STREAM_TOKENS = 256
# How far apart the chunks of one step's outputs may reach the client.
_DELIVERY_JITTER_S = 0.005


def _clock(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """One line per sample of a served profile: which phase and point, how
    long it took, the time elapsed and an estimate of the time left (ETA).

    ``phases``: samples planned per phase, in order. The estimate takes each
    phase's mean sample so far for its remaining samples; a phase not yet
    started borrows the mean of all samples so far, plus ``prior_s`` (a
    sample's known fixed wait, such as the first-token delay's idle gaps).
    It is rough until each phase has begun (a decode burst lasts longer than
    a prefill sample), hence the "~"."""

    def __init__(self, phases: dict[str, int], prior_s: dict[str, float] | None = None, out=None,
                 clock=time.monotonic) -> None:
        self.planned = dict(phases)
        self.done = dict.fromkeys(phases, 0)
        self.spent = dict.fromkeys(phases, 0.0)
        self.prior_s = prior_s or {}
        self.out, self.clock = out, clock
        self.start = self.last = clock()

    @property
    def total(self) -> int:
        return sum(self.planned.values())

    def remaining_s(self) -> float:
        done = sum(self.done.values())
        mean = sum(self.spent.values()) / done if done else 0.0
        left = 0.0
        for phase, planned in self.planned.items():
            if (n := planned - self.done[phase]) > 0:
                per = self.spent[phase] / self.done[phase] if self.done[phase] else mean + self.prior_s.get(phase, 0)
                left += n * per
        return left

    def tick(self, phase: str, what: str = "") -> str:
        now = self.clock()
        took, self.last = now - self.last, now
        self.done[phase] += 1
        self.spent[phase] += took
        line = (f"profile [{sum(self.done.values()):>3}/{self.total}] {phase}{' ' + what if what else ''}: "
                f"{took:.1f} s | elapsed {_clock(now - self.start)} | ETA ~{_clock(self.remaining_s())}")
        print(line, file=self.out or sys.stdout, flush=True)
        return line

    def skip(self, phase: str) -> None:
        """A planned phase that will not run."""
        self.planned[phase] = self.done[phase]


class _Quiet(Progress):
    def __init__(self) -> None:
        super().__init__({})

    def tick(self, phase: str, what: str = "") -> str:
        return ""

    def skip(self, phase: str) -> None:
        pass


def plan_progress(grid: ProfileGrid, out=None) -> Progress:
    """The served profile's phases and their sample counts (as ``_run`` takes them)."""
    r = grid.repeats
    phases = {"warm-up": 2,
              "prefill": len(grid.new_tokens) * len(grid.cached_tokens) * r,
              "decode": len(grid.batch_sizes) * len(grid.context_lens) * r,
              "request overhead": r + 2,  # skipped on a server that times its own steps
              "mixed": len(_mixed_cells(grid)) * r,
              "first-token delay": 3 * (r + 2),
              "hand-over": r}
    return Progress(phases, {"first-token delay": 2 * grid.idle_gap_s}, out)


class _Stream:
    """One streaming completion: chunk arrival times and the server's usage."""

    def __init__(self) -> None:
        self.start = 0.0
        self.times: list[float] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0

    async def run(self, client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int) -> _Stream:
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        self.start = time.perf_counter()
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("choices") and (chunk["choices"][0].get("delta") or {}).get("content"):
                    self.times.append(time.perf_counter())
                if usage := chunk.get("usage"):
                    self.prompt_tokens = usage.get("prompt_tokens") or 0
                    self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return self


async def _prefill_sample(client, model, rng, new: int, cached: int,
                          max_tokens: int = 1) -> tuple[float, int, int, float | None]:
    """(TTFT, new tokens, cached tokens, the engine's step seconds) of one
    request. The step seconds are what the server's
    ``kvferry:engine_step_seconds`` counter moved by over the request (its
    prefill step alone when ``max_tokens`` is 1); None from a server without
    that counter."""
    # the cached part: a system prompt an earlier request warmed (the chat template's header included)
    system = [{"role": "system", "content": random_words(rng, cached)}] if cached else []
    if cached:
        await _Stream().run(client, model, system, 1)
    before = await engine_step_seconds(client)
    s = await _Stream().run(client, model, system + _user(random_words(rng, new)), max_tokens)
    ttft = (s.times[0] if s.times else time.perf_counter()) - s.start
    after = await engine_step_seconds(client) if before is not None else None
    step = after - before if after is not None and after > before else None
    return ttft, s.prompt_tokens - s.cached_tokens, s.cached_tokens, step


async def engine_step_seconds(client) -> float | None:
    """The server's cumulative engine step time (``kvferry:engine_step_seconds``
    in its /metrics, summed over series); None when it exports none."""
    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    counters = parse_counters(resp.text) if resp.status_code == 200 else None
    return counters.totals.get("engine_step_seconds") if counters is not None else None


async def _prefill_points(client, model, rng, grid: ProfileGrid, on_point, progress: Progress) -> list[dict]:
    """One round over the whole grid per repeat, medians per point: a slow
    spell of a shared machine then touches every point a little rather than
    bending the fit at the few points it fell on."""
    cells = [(new, cached) for cached in grid.cached_tokens for new in grid.new_tokens]
    samples: dict[tuple[int, int], list[tuple[float, int, int]]] = {c: [] for c in cells}
    for i in range(grid.repeats):
        for cell in cells:
            samples[cell].append(await _prefill_sample(client, model, rng, *cell))
            progress.tick("prefill", f"round {i + 1}/{grid.repeats} new {cell[0]} cached {cell[1]}")
    points = []
    for cell in cells:
        times, news, hits, steps = zip(*samples[cell])
        points.append({"new": round(statistics.median(news)), "cached": round(statistics.median(hits)),
                       "time_s": statistics.median(times), "samples_s": list(times)})
        if all(t is not None for t in steps):
            points[-1]["engine_steps_s"] = list(steps)
        on_point("prefill", points[-1])
    return points


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _steady_gaps(streams: list[_Stream]) -> list[float]:
    """Chunk gaps once every stream decodes (has its second token) and
    before any stream ends: the steps of a full batch."""
    begin = max(s.times[1] for s in streams)
    end = min(s.times[-1] for s in streams)
    return [b - a for s in streams for a, b in zip(s.times, s.times[1:]) if a >= begin and b <= end]


async def _decode_point(client, model, rng, batch: int, context: int, steps: int,
                        lone: _Stream | None) -> tuple[dict, _Stream]:
    """``lone``: a batch-1 stream at this context, whose TTFT and step say how
    long the later streams' prefills keep the earlier ones decoding alone:
    each stream asks for enough tokens that all overlap for ``steps`` steps."""
    max_tokens = steps + 8
    if lone is not None and len(lone.times) > 2:
        ttft = lone.times[0] - lone.start
        step = statistics.median(b - a for a, b in zip(lone.times[1:], lone.times[2:]))
        max_tokens += math.ceil(1.5 * batch * ttft / max(step, 1e-3))
    streams = await asyncio.gather(*(_Stream().run(client, model, _user(random_words(rng, context)), max_tokens)
                                     for _ in range(batch)))
    gaps = _steady_gaps(streams)
    mean_context = statistics.mean(s.prompt_tokens for s in streams) + max_tokens / 2
    point = {"batch": batch, "context": round(mean_context), "time_s": statistics.median(gaps) if gaps else None,
             "samples_s": gaps}
    return point, streams[0]


async def _decode_points(client, model, rng, grid: ProfileGrid, on_point, progress: Progress) -> list[dict]:
    """``grid.repeats`` rounds over the whole decode grid, as for the
    prefill: a point's ``time_s`` is the median of its rounds' median gaps
    (``rounds_s``), its ``samples_s`` every steady gap of every round. One
    point is one burst of a second or two, so a slow spell of the machine
    used to fall on a whole point (batch-1 steps of 37 and 51 ms at two
    contexts in one profile); now it falls on one round of a point, and the
    median drops it."""
    cells = [(batch, context) for context in grid.context_lens for batch in grid.batch_sizes]
    rounds: dict[tuple[int, int], list[dict]] = {c: [] for c in cells}
    lone: dict[int, _Stream] = {}  # context -> the latest batch-1 stream there
    for i in range(grid.repeats):
        for batch, context in cells:
            p, first = await _decode_point(client, model, rng, batch, context, grid.decode_steps, lone.get(context))
            progress.tick("decode", f"round {i + 1}/{grid.repeats} batch {batch} context {context}")
            if batch == 1:
                lone[context] = first
            if p["time_s"] is not None:
                rounds[(batch, context)].append(p)
    points = []
    for (batch, context), group in rounds.items():
        if not group:
            continue
        points.append({"batch": batch, "context": round(statistics.median(p["context"] for p in group)),
                       "time_s": statistics.median(p["time_s"] for p in group),
                       "rounds_s": [p["time_s"] for p in group],
                       "samples_s": [g for p in group for g in p["samples_s"]]})
        on_point("decode", points[-1])
    return points


def _mixed_cells(grid: ProfileGrid) -> list[tuple[int, int, int]]:
    """(batch, context, new) of the mixed points: the smallest and a middle
    batch, a middle and the largest prompt, at the shortest context."""
    batches = sorted({min(grid.batch_sizes), max([b for b in grid.batch_sizes if b <= 4] or grid.batch_sizes)})
    news = sorted({sorted(grid.new_tokens)[len(grid.new_tokens) // 2], max(grid.new_tokens)})
    return [(b, min(grid.context_lens), n) for b in batches for n in news]


async def _prompt_tokens(client, messages: list[dict]) -> int:
    resp = await client.post("/tokenize", json={"messages": messages})
    resp.raise_for_status()
    return len(resp.json()["tokens"])


async def _mixed_sample(client, model, rng, batch: int, context: int, new: int,
                        overhead_s: float = 0.0) -> dict | None:
    """One mixed step: ``batch`` streams decoding at ``context`` when a
    ``new``-word prompt joins (None when no stream saw that step). Also what
    a disaggregated server's host sharing needs (``overlap_sample``)."""
    # the same prompt length alone first: host sharing's baseline when the server does not mix
    alone = await _Stream().run(client, model, _user(random_words(rng, new)), LONG_MAX_TOKENS)
    prompts = [_user(random_words(rng, context)) for _ in range(batch)]
    streams = [_Stream() for _ in prompts]
    # the streams only have to outlive the newcomer's first token: they are cancelled then
    tasks = [asyncio.create_task(s.run(client, model, m, MIXED_STREAM_TOKENS)) for s, m in zip(streams, prompts)]
    try:
        while any(len(s.times) < 3 for s in streams) and not any(t.done() for t in tasks):
            await asyncio.sleep(0.002)
        newcomer = await _Stream().run(client, model, _user(random_words(rng, new)), LONG_MAX_TOKENS)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if not newcomer.times:
        return None
    first = newcomer.times[0]
    gaps = [g for s in streams if (g := mixed_gap(s.times, newcomer.start, first)) is not None]
    if not gaps:
        return None
    decoded = statistics.median(sum(1 for t in s.times if t < first) for s in streams)
    ctx = await _prompt_tokens(client, prompts[0])
    return {"new": newcomer.prompt_tokens - newcomer.cached_tokens, "cached": newcomer.cached_tokens,
            "batch": batch, "context": round(ctx + decoded), "time_s": statistics.median(gaps),
            **overlap_sample([s.times for s in streams], newcomer.start, first, overhead_s),
            "alone_ttft_s": (alone.times[0] if alone.times else time.perf_counter()) - alone.start}


def overlap_sample(times: list[list[float]], sent: float, first: float, overhead_s: float) -> dict:
    """What the streams (chunk arrival ``times`` each) and a newcomer (sent
    at ``sent``, first text at ``first``) say when the server does not mix:
    ``ttft_s``; ``decode_gap_s``, the streams' median step before the
    newcomer; ``overlap_gaps_s``, their steps once the newcomer's prefill
    runs (ending after it was admitted: the request overhead and two steps)."""
    before = [b - a for t in times for a, b in zip(t, t[1:]) if b <= sent][-3 * len(times):]
    step = statistics.median(before) if before else 0.0
    admitted = sent + overhead_s + 2 * step
    during = [b - a for t in times for a, b in zip(t, t[1:]) if a >= sent and admitted < b <= first]
    return {"ttft_s": first - sent, "decode_gap_s": step, "overlap_gaps_s": during}


def mixed_gap(times: list[float], sent: float, first: float) -> float | None:
    """The mixed step as one decoding stream (chunk arrival ``times``) saw
    it: the step ends between the newcomer's send and its first text (a
    first token that decodes to no text yet shows up a step later), so it is
    the stream's longest gap ending in that window; None if none does."""
    window = [b - a for a, b in zip(times, times[1:]) if sent < b <= first + _DELIVERY_JITTER_S]
    return max(window, default=None)


async def _mixed_points(client, model, rng, grid: ProfileGrid, on_point, overhead_s: float = 0.0,
                        progress: Progress | None = None) -> list[dict]:
    """Medians per cell over ``grid.repeats`` rounds of the whole grid."""
    progress = progress or _Quiet()
    cells = _mixed_cells(grid)
    samples: dict[tuple, list[dict]] = {c: [] for c in cells}
    for i in range(grid.repeats):
        for cell in cells:
            if (sample := await _mixed_sample(client, model, rng, *cell, overhead_s)) is not None:
                samples[cell].append(sample)
            progress.tick("mixed", f"round {i + 1}/{grid.repeats} batch {cell[0]} + new {cell[2]}")
    points = []
    for cell in cells:
        if not samples[cell]:
            continue
        group = samples[cell]
        points.append({"new": round(statistics.median(p["new"] for p in group)),
                       "cached": round(statistics.median(p["cached"] for p in group)), "batch": cell[0],
                       "context": round(statistics.median(p["context"] for p in group)),
                       "time_s": statistics.median(p["time_s"] for p in group),
                       "samples_s": [p["time_s"] for p in group],
                       "ttft_s": statistics.median(p["ttft_s"] for p in group),
                       "pairs": [{k: p[k] for k in ("ttft_s", "alone_ttft_s", "decode_gap_s", "overlap_gaps_s")}
                                 for p in group]})
        on_point("mixed", points[-1])
    return points


async def _worker_roles(client) -> set[str] | None:
    """The roles of the server's engine cores (None: no such view, e.g. not kvferry)."""
    try:
        resp = await client.get("/v1/admin/workers")
        return {w["role"] for w in resp.json()["data"]} if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, TypeError, KeyError):
        return None


def server_mixes(points: list[dict], prefill_fit: dict, roles: set[str] | None = None) -> bool:
    """Does the step that prefills a newcomer also decode running streams?
    Not on a server of prefill and decode cores (``roles``). Without roles:
    a step that prefills runs at least about as long as the prefill, while a
    disaggregated server's streams see only decode steps, far shorter (the
    median point under half the prefill fit here)."""
    if roles is not None:
        return not roles & {"prefill", "decode"}
    ratios = [p["time_s"] / pred for p in points if (pred := predict(prefill_fit, p)) > 0]
    return not ratios or statistics.median(ratios) >= 0.5


def host_sharing(apart: list[dict], overhead_s: float) -> dict | None:
    """The slowdowns of a step while the other core of the host steps, from
    the "mixed" points of a server that does not mix (``apart``; None when
    there are none), one ratio per sample (``pairs``): ``prefill``, the
    newcomer's prefill (TTFT less the request overhead and the routing hop,
    1.5 of the streams' steps) over the same prompt's prefill alone (its
    TTFT less the overhead); ``decode``, the streams' median step during
    that prefill over their step before it. Medians, at least 1; the points
    are kept."""
    pairs = [q for p in apart for q in p["pairs"]]
    if not pairs:
        return None
    prefill = [(q["ttft_s"] - overhead_s - 1.5 * q["decode_gap_s"]) / (q["alone_ttft_s"] - overhead_s)
               for q in pairs if q["alone_ttft_s"] > overhead_s]
    decode = [statistics.median(q["overlap_gaps_s"]) / q["decode_gap_s"] for q in pairs
              if q["decode_gap_s"] > 0 and q["overlap_gaps_s"]]
    return {"prefill": max(statistics.median(prefill), 1.0) if prefill else 1.0,
            "decode": max(statistics.median(decode), 1.0) if decode else 1.0,
            "prefill_ratios": [round(r, 3) for r in prefill], "decode_ratios": [round(r, 3) for r in decode],
            "points": apart}


def noise_samples(points: list[dict], model: dict) -> list[tuple[float, float]]:
    """Every sample of every point as (its ratio to the fit's prediction
    there, rounded to 0.1%; that prediction, s). Points the fit predicts
    no time for are skipped."""
    out = []
    for p in points:
        pred = predict(model, p)
        if pred > 0:
            out += [(round(t / pred, 3), pred) for t in p.get("samples_s", ()) if t > 0]
    return out


def noise_ratios(points: list[dict], model: dict) -> list[float]:
    return [r for r, _ in noise_samples(points, model)]


def mixed_noise_samples(points: list[dict], mixed_fit: dict) -> list[tuple[float, float]]:
    """Each mixed sample over the whole predicted mixed step (the two fits'
    sum, ``sum_s``, plus the mixed fit's extra), with that prediction."""
    return [(round(t / pred, 3), pred) for p in points
            if (pred := p["sum_s"] + predict(mixed_fit, p)) > 0 for t in p["samples_s"] if t > 0]


def step_noise(prefill: list[dict], prefill_fit: dict, decode: list[dict], decode_fit: dict,
               mixed: list[dict], mixed_fit: dict) -> dict:
    """``step_noise`` of a profile: the ratios, and the fitted step time each
    was measured at (``*_at_s``: the simulator draws a step's noise from
    steps of about its length). A mixed step carries prefill tokens: its
    spread joins the prefill steps'."""
    pre = noise_samples(prefill, prefill_fit) + mixed_noise_samples(mixed, mixed_fit)
    dec = noise_samples(decode, decode_fit)
    return {"prefill": [r for r, _ in pre], "decode": [r for r, _ in dec],
            "prefill_at_s": [round(t, 6) for _, t in pre], "decode_at_s": [round(t, 6) for _, t in dec]}


async def _request_overhead(client, model, rng, repeats: int, client_fit: dict, decode_fit: dict,
                            progress: Progress) -> float:
    """What a request pays once, outside engine steps (HTTP, templating,
    tokenization, process hops, detokenization and SSE of its first token):
    a one-word chat request's TTFT less its engine step, that is a step's
    fixed cost (the decode fit's intercept) plus its tokens' cost (the
    prefill fit without its intercept). Measured directly because on a noisy
    machine the prefill fit's intercept is the least certain coefficient."""
    rest = {"terms": client_fit["terms"][1:], "coef": client_fit["coef"][1:]}
    samples = []
    for i in range(repeats):
        ttft, new, cached, _ = await _prefill_sample(client, model, rng, 1, 0)
        samples.append(ttft - decode_fit["coef"][0] - predict(rest, {"new": new, "cached": cached}))
        progress.tick("request overhead", f"{i + 1}/{repeats}")
    return max(statistics.median(samples), 0.0)


async def _first_token_delay(client, model, rng, repeats: int, new: int, idle_gap_s: float,
                             progress: Progress) -> float:
    """How much later a first token reaches the client when the engine steps
    on after it (a request of ``LONG_MAX_TOKENS``) than when it idles (one
    token): medians over interleaved pairs of equal prompt length. A few ms
    (the front end's and the client's turn on CPUs the next step holds), so
    short prompts, whose TTFT varies least, and many pairs. Each request
    finds the server idle for ``idle_gap_s``, as a request of a moderate rate
    does: measured on one server, the lag was ~0.4 ms for requests sent back
    to back and ~5 ms after 0.6 s idle."""
    one, more = [], []
    for i in range(repeats):
        await asyncio.sleep(idle_gap_s)
        one.append((await _prefill_sample(client, model, rng, new, 0))[0])
        await asyncio.sleep(idle_gap_s)
        more.append((await _prefill_sample(client, model, rng, new, 0, LONG_MAX_TOKENS))[0])
        progress.tick("first-token delay", f"pair {i + 1}/{repeats}")
    return max(statistics.median(more) - statistics.median(one), 0.0)


async def _handover(client, model, rng, repeats: int, decode_step_s: float, progress: Progress) -> float:
    gaps = []
    for i in range(repeats):
        s = await _Stream().run(client, model, _user(random_words(rng, 64)), 8)
        gaps.append(s.times[1] - s.times[0])
        progress.tick("hand-over", f"{i + 1}/{repeats}")
    return max(statistics.median(gaps) - decode_step_s, 0.0)


async def _run(url: str, model: str, grid: ProfileGrid, on_point, progress: Progress) -> dict:
    rng = random.Random(grid.seed)
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
        for i in range(2):  # warm-up
            await _prefill_sample(client, model, rng, min(grid.new_tokens), 0)
            progress.tick("warm-up", f"{i + 1}/2")
        prefill = await _prefill_points(client, model, rng, grid, on_point, progress)
        decode = await _decode_points(client, model, rng, grid, on_point, progress)
        decode_fit = fit(decode, DECODE_TERMS)
        if all("engine_steps_s" in p for p in prefill):
            # the server timed each prefill step itself: fit those, and the
            # overhead is what each TTFT spent outside its step
            overhead = max(statistics.median(t - e for p in prefill
                                             for t, e in zip(p["samples_s"], p["engine_steps_s"])), 0.0)
            for p in prefill:
                p["ttft_s"], p["time_s"] = p["time_s"], statistics.median(p["engine_steps_s"])
                p["ttft_samples_s"], p["samples_s"] = p["samples_s"], p.pop("engine_steps_s")
            overhead_from = "engine_step_seconds"
            progress.skip("request overhead")
        else:
            overhead = await _request_overhead(client, model, rng, grid.repeats + 2, fit(prefill, PREFILL_TERMS),
                                               decode_fit, progress)
            for p in prefill:  # the engine's share of a TTFT: what the step model fits
                p["ttft_s"], p["time_s"] = p["time_s"], max(p["time_s"] - overhead, 0.0)
                p["samples_s"] = [max(t - overhead, 0.0) for t in p["samples_s"]]
            overhead_from = "one-word requests less the fits"
        one = min((p for p in decode if p["batch"] == 1), key=lambda p: p["context"], default=None)
        prefill_fit = fit(prefill, PREFILL_TERMS)
        probes = await _mixed_points(client, model, rng, grid, on_point, overhead, progress)
        # a server that does not mix (disagg) measured host sharing instead
        mixes = server_mixes(probes, prefill_fit, await _worker_roles(client))
        mixed, apart = (probes, []) if mixes else ([], probes)
        mixed_fit = fit_mixed(mixed, prefill_fit, decode_fit)
        result = {"prefill": {"points": prefill, "fit": prefill_fit},
                  "decode": {"points": decode, "fit": decode_fit},
                  "mixed": {"points": mixed, "fit": mixed_fit},
                  "host_sharing": host_sharing(apart, overhead),
                  "request_overhead_s": overhead, "request_overhead_from": overhead_from,
                  "first_token_delay_s": await _first_token_delay(client, model, rng, 3 * (grid.repeats + 2),
                                                                  min(grid.new_tokens), grid.idle_gap_s,
                                                                  progress),
                  "step_noise": step_noise(prefill, prefill_fit, decode, decode_fit, mixed, mixed_fit),
                  "handover_s": await _handover(client, model, rng, grid.repeats, one["time_s"] if one else 0.0,
                                                progress)}
    result["quality"] = fit_quality(result)
    return result


def run_served_profile(url: str, model: str, grid: ProfileGrid, on_point=lambda kind, p: None,
                       progress: Progress | None = None) -> dict:
    """Profile the server at ``url`` (base URL, no /v1) serving ``model``;
    a progress line per sample on stdout (``progress``, default
    ``plan_progress``); what ``fit_quality`` warns about goes to stderr (and
    stays in the result's ``quality``)."""
    progress = progress or plan_progress(grid)
    print(f"kvferry profile: {progress.total} samples against {url} (the first phases' times set the ETA)",
          flush=True)
    result = asyncio.run(_run(url, model, grid, on_point, progress))
    warn_quality(result["quality"])
    return result
