"""Step time of one engine step, from the fitted ``kvferry profile`` models.

A step runs prefill chunks and decodes together (chunked prefill)::

    t = a_pre * [any prefill] + sum over chunks (b * new + c * new * cached + d * new^2)
      + a_dec * [any decode] + b_dec * batch + c_dec * sum(context)
      + [both] * (m_1 + m_batch * batch + m_new * sum(new))

where ``cached`` is what the chunk attends to before itself (prefix hit or
earlier chunks). The two intercepts are fixed per-step costs (launch,
sampling); a mixed step pays the larger one only, since it is one forward pass,
plus what a served profile measured a mixed step to cost beyond that sum (the
front end's work for the decoding streams competing with a longer step).
The terms, the fit and this formula live in ``bench/step_cost.py``; here
the fitted coefficients meet the measured noise and host sharing.
"""
from __future__ import annotations

import bisect
import json
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from kvferry.bench.step_cost import (DECODE_TERMS, MIXED_TERMS, PREFILL_TERMS, poor_fits, prefill_chunk_seconds,
                                     step_seconds)
from kvferry.plan.host import HostSharing


class PlanError(Exception):
    """A user-facing error of simulate / plan: one line, exit code 2."""


@dataclass(frozen=True, slots=True)
class StepNoise:
    """How much a real step varies around the fitted time: ratios of measured
    step times to the fit's prediction at the same point (a served profile's
    every sample, ``step_noise`` in its JSON), one list for steps that carry
    prefill tokens and one for decode-only steps.

    A simulated step draws one ratio and multiplies the fitted time by it.
    Where the profile says at what fitted time each ratio was measured
    (``prefill_at_s``, ``decode_at_s``), the draw is among the samples of
    steps of about the same length (fitted within a factor of
    ``NEAR_FACTOR``, or the ``MIN_NEAR`` nearest): a hiccup of a few ms
    doubles a 20 ms step but is a few percent of a 100 ms one, so the
    short steps' outliers must not stretch the long ones (measured: one 46-token
    prefill sample at 2.4x its fit made every simulated 290-token prompt
    draw 2.4x one time in 42, and the TTFT p99 of a cache-off run came out
    25-30% over the measured one). Without the times, the draw is uniform
    over the whole list. Either way the draws' mean is the (local) mean of
    the ratios, so the simulated mean step is the measured one (the fits
    are medians, and the ratios carry the skew above them); their spread
    gives queueing and the p99s the tail that one fitted time cannot."""

    prefill: tuple[float, ...]
    decode: tuple[float, ...]
    # The fitted step time (s) each ratio was measured at, ascending; () : unknown.
    prefill_at: tuple[float, ...] = ()
    decode_at: tuple[float, ...] = ()

    NEAR_FACTOR = 2.0
    MIN_NEAR = 8

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            ratios, at = getattr(self, name), getattr(self, f"{name}_at")
            if not ratios or any(not r > 0 for r in ratios):
                raise ValueError(f"step_noise.{name}: need at least one ratio, all > 0")
            if at and (len(at) != len(ratios) or any(not t > 0 for t in at)
                       or any(a > b for a, b in zip(at, at[1:]))):
                raise ValueError(f"step_noise.{name}_at_s: one fitted time > 0 per ratio, ascending")

    @classmethod
    def from_json(cls, data: dict | None) -> StepNoise | None:
        """A profile's ``step_noise``; None when it has none (an in-process
        profile) or measured no sample of one kind."""
        if not data or not data.get("prefill") or not data.get("decode"):
            return None
        lists = {}
        for name in ("prefill", "decode"):
            ratios = [float(r) for r in data[name]]
            at = data.get(f"{name}_at_s")
            if at is not None and len(at) == len(ratios):
                pairs = sorted(zip((float(t) for t in at), ratios))  # by fitted time
                lists[name], lists[f"{name}_at"] = tuple(r for _, r in pairs), tuple(t for t, _ in pairs)
            else:
                if at is not None:
                    raise ValueError(f"step_noise.{name}_at_s: {len(at)} times for {len(ratios)} ratios")
                lists[name] = tuple(ratios)
        return cls(**lists)

    def factor(self, rng: random.Random, has_prefill: bool, at_s: float | None = None) -> float:
        """A ratio for a step of fitted time ``at_s`` (any step's when None
        or when the profile kept no times)."""
        ratios = self.prefill if has_prefill else self.decode
        at = self.prefill_at if has_prefill else self.decode_at
        if not at or at_s is None:
            return ratios[rng.randrange(len(ratios))]
        lo = bisect.bisect_left(at, at_s / self.NEAR_FACTOR)
        hi = bisect.bisect_right(at, at_s * self.NEAR_FACTOR)
        if hi - lo < self.MIN_NEAR:  # too few alike: the MIN_NEAR nearest by ratio of fitted times
            lo = hi = bisect.bisect_left(at, at_s)  # at[:lo] <= at_s <= at[hi:]
            while hi - lo < min(self.MIN_NEAR, len(at)):
                if lo > 0 and (hi == len(at) or at_s / at[lo - 1] <= at[hi] / at_s):
                    lo -= 1
                else:
                    hi += 1
        return ratios[rng.randrange(lo, hi)]

    def mean(self, has_prefill: bool) -> float:
        ratios = self.prefill if has_prefill else self.decode
        return sum(ratios) / len(ratios)


@dataclass(frozen=True, slots=True)
class StepCostModel:
    # seconds per unit of PREFILL_TERMS: 1, new, new*cached, new^2
    prefill: tuple[float, float, float, float]
    # seconds per unit of DECODE_TERMS: 1, batch, batch*context
    decode: tuple[float, float, float]
    # A served profile's per-request time outside engine steps (HTTP, tokenization,
    # process hops, detokenization): a request reaches its engine this much later.
    request_overhead_s: float = 0.0
    # A served profile's measured step-time spread; None: every step takes its fitted time.
    noise: StepNoise | None = None
    # seconds per unit of MIXED_TERMS (1, batch, new): what a step that both
    # prefills and decodes costs beyond the two fits' sum (a served profile's
    # ``mixed`` fit; zero without one)
    mixed: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # A served profile's measured lag of a token that reaches the client while
    # its engine runs the next step (the output path competes with the step).
    first_token_delay_s: float = 0.0
    # A served profile's measured slowdown of a step while another instance of
    # its host steps (applied only to instances placed on one host).
    host_sharing: HostSharing | None = None

    @classmethod
    def from_profile(cls, path: str) -> StepCostModel:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except OSError as e:
            raise PlanError(f"--profile: cannot read {path}: {e.strerror}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise PlanError(f"--profile: {path} is not a kvferry profile JSON: {e}") from None

    @classmethod
    def from_json(cls, data: dict, layout: dict | None = None) -> StepCostModel:
        """A profile's model; ``layout``: one entry of its ``layouts`` (that
        layout's fits, the profile's measured overheads). Raises ValueError,
        KeyError or TypeError on a malformed profile."""
        fits = layout if layout is not None else data
        pre, dec = fits["prefill"]["fit"], fits["decode"]["fit"]
        if tuple(pre["terms"]) != PREFILL_TERMS or tuple(dec["terms"]) != DECODE_TERMS:
            raise ValueError(f"fit terms {pre['terms']} / {dec['terms']} are not "
                             f"{list(PREFILL_TERMS)} / {list(DECODE_TERMS)}")
        mixed = (data.get("mixed") or {}).get("fit") or {"terms": MIXED_TERMS, "coef": (0.0, 0.0, 0.0)}
        if tuple(mixed["terms"]) != MIXED_TERMS:
            raise ValueError(f"mixed fit terms {mixed['terms']} are not {list(MIXED_TERMS)}")
        return cls(tuple(float(c) for c in pre["coef"]), tuple(float(c) for c in dec["coef"]),
                   float(data.get("request_overhead_s") or 0.0), StepNoise.from_json(data.get("step_noise")),
                   tuple(float(c) for c in mixed["coef"]), float(data.get("first_token_delay_s") or 0.0),
                   HostSharing.from_json(data.get("host_sharing")))

    def scaled(self, factor: float) -> StepCostModel:
        """Every step ``factor`` times as long (the fits' coefficients scaled;
        the request overhead and first-token delay, spent outside steps, kept):
        the same model on a machine that runs steps ``1 / factor`` as fast."""
        if not factor > 0:
            raise ValueError(f"--step-time-scale must be > 0, got {factor}")
        return replace(self, prefill=tuple(factor * c for c in self.prefill),
                       decode=tuple(factor * c for c in self.decode), mixed=tuple(factor * c for c in self.mixed))

    def prefill_chunk(self, new: int, cached: int) -> float:
        """Variable cost of one prefill chunk (no intercept)."""
        return prefill_chunk_seconds(self.prefill, new, cached)

    def step(self, chunks: list[tuple[int, int]], decode_batch: int, decode_context: int) -> float:
        """One step: prefill ``chunks`` of (new, cached) tokens plus ``decode_batch``
        decodes whose contexts sum to ``decode_context`` (the formula: ``bench/step_cost.py``)."""
        return step_seconds(self.prefill, self.decode, self.mixed, chunks, decode_batch, decode_context)

    def noisy_step(self, chunks: list[tuple[int, int]], decode_batch: int, decode_context: int,
                   rng: random.Random | None) -> float:
        """``step`` times a measured noise ratio drawn from ``rng`` (the fitted
        time alone without a noise model or an ``rng``)."""
        t = self.step(chunks, decode_batch, decode_context)
        if self.noise is None or rng is None:
            return t
        return t * self.noise.factor(rng, bool(chunks), t)

    def prefill_time(self, new: int, cached: int) -> float:
        """A whole prompt prefilled in one step."""
        return self.step([(new, cached)], 0, 0)

    def decode_step(self, batch: int, mean_context: float) -> float:
        return self.step([], batch, int(batch * mean_context))


def check_profile_fits(path: str, allow_poor_fit: bool, command: str) -> None:
    """Refuse a profile whose step-time fits are poor (``poor_fits``: a busy
    machine's scatter, so every prediction made from it is off), unless
    ``allow_poor_fit``: then say so on stderr and go on."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlanError(f"--profile: cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise PlanError(f"--profile: {path} is not a kvferry profile JSON: {e}") from None
    try:
        problems = poor_fits(data)
    except (AttributeError, TypeError):  # not a profile's shape: from_profile says what is wrong
        return
    if not problems:
        return
    what = "; ".join(problems)
    if not allow_poor_fit:
        raise PlanError(f"--profile: {path}: {what} (or pass --allow-poor-fit to use it anyway)")
    print(f"kvferry {command}: WARNING: --profile {path}: {what}; --allow-poor-fit: using it anyway, "
          "so expect the predictions to be off", file=sys.stderr, flush=True)


def profile_handover_s(path: str) -> float:
    """The prefill -> decode hand-over a served profile (``kvferry profile
    --url``) measured; 0 for an in-process profile."""
    try:
        return float(json.loads(Path(path).read_text()).get("handover_s") or 0.0)
    except OSError as e:
        raise PlanError(f"--profile: cannot read {path}: {e.strerror}") from None
    except (ValueError, TypeError, AttributeError) as e:
        raise PlanError(f"--profile: {path} is not a kvferry profile JSON: {e}") from None


@dataclass(frozen=True, slots=True)
class KVTransferModel:
    """Prefill -> decode KV transfer: a fixed latency plus bytes / bandwidth."""

    bytes_per_token: float = 0.0  # KV bytes of one token over all layers (K and V)
    bandwidth_gbps: float = 100.0  # GB/s
    latency_s: float = 0.0

    def time(self, num_tokens: int) -> float:
        return self.latency_s + num_tokens * self.bytes_per_token / (self.bandwidth_gbps * 1e9)
