"""The adaptive controller alone: deterministic inputs, exact k sequences."""
from __future__ import annotations

from kvferry.spec.adaptive import AdaptiveSpecController


def run(controller: AdaptiveSpecController, accepted_fraction: list[float], num_running: int = 1) -> list[int]:
    """k asked each step; each step's drafts accept ``round(k * fraction)``."""
    ks = []
    for frac in accepted_fraction:
        k = controller.num_drafts("r", num_running)
        ks.append(k)
        controller.observe("r", k, round(k * frac))
    return ks


def test_full_acceptance_keeps_k_max():
    assert run(AdaptiveSpecController(4, 64), [1.0] * 5) == [4, 4, 4, 4, 4]


def test_failing_drafts_shrink_k_to_zero_then_probe():
    c = AdaptiveSpecController(4, 64, ewma_alpha=0.5, probe_interval=3)
    # EWMA 1 -> .5 -> .25 -> .125 (k = floor(ewma * 5): 4, 2, 1, 0)
    ks = run(c, [0.0] * 9)
    assert ks == [4, 2, 1, 0, 0, 1, 0, 0, 1]
    assert c.acceptance("r") == 1 / 32  # two rejected probes halved it twice more


def test_a_successful_probe_wins_drafts_back():
    c = AdaptiveSpecController(4, 64, ewma_alpha=0.5, probe_interval=2)
    ks = run(c, [0.0] * 6 + [1.0] * 4)
    # ewma .5 .25 .125 | k=0 | probe rejected: .0625 | k=0 | probe accepted: .53, .77, .88
    assert ks == [4, 2, 1, 0, 1, 0, 1, 2, 3, 4]


def test_batch_budget_caps_k():
    c = AdaptiveSpecController(4, batch_token_threshold=32)
    assert [c.batch_cap(n) for n in (1, 4, 6, 8, 15, 16, 17, 32)] == [4, 4, 4, 3, 1, 1, 0, 0]
    assert [c.num_drafts("r", n) for n in (1, 8, 16, 17)] == [4, 3, 1, 0]
    # No probe counting while the batch forbids drafts.
    assert c.acceptance("r") == 1.0


def test_not_adaptive_always_gives_the_batch_cap():
    c = AdaptiveSpecController(3, 64, adaptive=False)
    assert run(c, [0.0] * 4) == [3, 3, 3, 3]


def test_forget_resets_a_request():
    c = AdaptiveSpecController(4, 64)
    run(c, [0.0] * 3)
    c.forget("r")
    assert c.num_drafts("r", 1) == 4
