"""SLO admission: predict a request's TTFT and TPOT on its chosen worker,
and refuse it at once (429, Retry-After) when it cannot meet its SLO,
as Mooncake's early rejection does, rather than accept it and miss.

The prediction rests on a step-time model fitted online per worker::

    step seconds = fixed_s + per_token_s * scheduled tokens

by least squares over the worker's recent steps (each EngineCoreOutputs
names its step's token count and wall time). A new request's TTFT is the
time to compute the prefill queued before it plus its own uncached tokens,
in steps of at most ``max_num_batched_tokens``, each also carrying one
decode token per running request; its TPOT is one decode step of the
running batch plus itself.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # worker.py imports this module
    from kvferry.router.worker import Worker


class SloRejectedError(RuntimeError):
    """The request cannot meet its SLO now; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StepTimeModel:
    """seconds = fixed_s + per_token_s * tokens over the last ``window`` steps."""

    def __init__(self, window: int = 256) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds >= 0:
            self._steps.append((num_tokens, seconds))

    @property
    def num_observations(self) -> int:
        return len(self._steps)

    def fit(self) -> tuple[float, float] | None:
        """(fixed_s, per_token_s), both >= 0; None before any step."""
        n = len(self._steps)
        if n == 0:
            return None
        mean_x = sum(x for x, _ in self._steps) / n
        mean_y = sum(y for _, y in self._steps) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self._steps)
        if var_x < 1e-9:
            # Every step the same size (all decode): no slope to see; charge
            # the time per token, which over-predicts large prefills least badly
            # of the two readings.
            return 0.0, mean_y / mean_x
        slope = sum((x - mean_x) * (y - mean_y) for x, y in self._steps) / var_x
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_x, 0.0), slope

    def predict_s(self, num_tokens: int, num_steps: int = 1) -> float | None:
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_token = fitted
        return num_steps * fixed + per_token * num_tokens


@dataclass(frozen=True, slots=True)
class SloConfig:
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    @property
    def enabled(self) -> bool:
        return self.ttft_slo_ms is not None or self.tpot_slo_ms is not None


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_s: float
    tpot_s: float
    queue_drain_s: float  # time until the work queued before this request is done


def predict(model: StepTimeModel, queued_prefill_tokens: int, new_tokens: int, num_running: int,
            max_num_batched_tokens: int) -> Prediction | None:
    """TTFT / TPOT of a request on one worker; None while the model has no data."""
    if model.fit() is None:
        return None
    prefill = queued_prefill_tokens + new_tokens
    steps = max(1, math.ceil(prefill / max(1, max_num_batched_tokens)))
    ttft = model.predict_s(prefill + steps * num_running, steps)
    queued_steps = math.ceil(queued_prefill_tokens / max(1, max_num_batched_tokens))
    drain = model.predict_s(queued_prefill_tokens + queued_steps * num_running, queued_steps) if queued_steps else 0.0
    return Prediction(ttft_s=ttft, tpot_s=model.predict_s(num_running + 1), queue_drain_s=drain)


def admit(slo: SloConfig, prediction: Prediction | None) -> None:
    """Raise SloRejectedError when the prediction misses an SLO. Without a
    prediction (no step seen yet) the request is admitted: no evidence."""
    if prediction is None or not slo.enabled:
        return
    retry = max(1.0, prediction.queue_drain_s)
    if slo.ttft_slo_ms is not None and prediction.ttft_s * 1000 > slo.ttft_slo_ms:
        raise SloRejectedError(
            f"predicted time to first token {prediction.ttft_s * 1000:.0f} ms exceeds the TTFT SLO of "
            f"{slo.ttft_slo_ms:g} ms; retry later", retry)
    if slo.tpot_slo_ms is not None and prediction.tpot_s * 1000 > slo.tpot_slo_ms:
        raise SloRejectedError(
            f"predicted time per output token {prediction.tpot_s * 1000:.1f} ms exceeds the TPOT SLO of "
            f"{slo.tpot_slo_ms:g} ms; retry later", retry)


class Admission:
    """Admits a request to the worker it was routed to, or raises
    SloRejectedError: the worker's own step-time model predicts its TTFT and
    TPOT there. Without SLOs every request passes, at no cost."""

    def __init__(self, slo: SloConfig) -> None:
        self.slo = slo

    def check(self, worker: "Worker", new_tokens: int) -> None:
        """``new_tokens``: the prompt tokens ``worker`` would compute for it."""
        if not self.slo.enabled:
            return
        prediction = predict(worker.step_model, worker.queued_prefill_tokens, new_tokens,
                             worker.stats.num_running, worker.ready.max_num_batched_tokens)
        admit(self.slo, prediction)
