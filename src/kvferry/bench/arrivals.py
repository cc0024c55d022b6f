"""Inter-arrival times: Poisson (burstiness 1) or gamma at a mean rate.

A gamma process with shape ``burstiness`` and scale ``1 / (rate * burstiness)``
keeps the mean rate; burstiness < 1 makes arrivals burstier, > 1 smoother
(vLLM's ``--burstiness``).
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterator


def intervals(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Seconds to wait before each arrival (the first included); 0 forever
    when the rate is infinite (everything at once)."""
    rng = random.Random(seed)
    while True:
        if math.isinf(rate):
            yield 0.0
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
