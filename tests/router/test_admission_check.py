"""Admission: a routed request is checked against the SLOs on its worker's
own step-time model and queue."""
from __future__ import annotations

import pytest

from kvferry.router.admission import Admission, SloConfig, SloRejectedError
from tests.router.fakes import make_worker


def slow_worker():
    worker = make_worker("engine-0")
    for tokens in (1, 64):  # 10 ms + 1 ms per token
        worker.step_model.observe(tokens, 0.01 + 0.001 * tokens)
    return worker


def test_without_slos_everything_passes():
    Admission(SloConfig()).check(slow_worker(), 10_000)


def test_a_worker_without_steps_seen_admits():
    Admission(SloConfig(ttft_slo_ms=1)).check(make_worker("engine-0"), 10_000)


def test_the_ttft_slo_counts_the_workers_queue():
    admission = Admission(SloConfig(ttft_slo_ms=100))
    worker = slow_worker()
    admission.check(worker, 32)  # one step of 32 tokens: 42 ms
    worker.queued_prefill["ahead"] = 64  # now 96 tokens in two steps: 116 ms
    with pytest.raises(SloRejectedError, match="time to first token 116 ms exceeds the TTFT SLO of 100 ms") as err:
        admission.check(worker, 32)
    assert err.value.retry_after_s == 1.0  # the queue drains in 74 ms; never advise under a second


def test_the_tpot_slo_counts_the_running_batch():
    admission = Admission(SloConfig(tpot_slo_ms=20))
    worker = slow_worker()
    admission.check(worker, 1)
    worker.stats.num_running = 10  # a decode step of 11 tokens: 21 ms
    with pytest.raises(SloRejectedError, match="TPOT SLO of 20 ms"):
        admission.check(worker, 1)
