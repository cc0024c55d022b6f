"""Shared builders for the planner tests: a profile JSON with chosen
coefficients and hand-made requests / traces."""
from __future__ import annotations

import json
from pathlib import Path

from kvferry.plan.latency import StepCostModel
from kvferry.plan.workload import SimRequest


def write_profile(path: Path, prefill: tuple, decode: tuple) -> Path:
    """A profile file as ``kvferry profile`` writes it (only the fits are read)."""
    path.write_text(json.dumps({
        "prefill": {"fit": {"terms": ["1", "new", "new*cached", "new^2"], "coef": list(prefill)}},
        "decode": {"fit": {"terms": ["1", "batch", "batch*context"], "coef": list(decode)}}}))
    return path


def cost(prefill: tuple, decode: tuple) -> StepCostModel:
    return StepCostModel(tuple(prefill), tuple(decode))


def unique_request(i: int, arrival_s: float, input_len: int, output_len: int, block_size: int = 16) -> SimRequest:
    """A request sharing no block with any other (distinct keys)."""
    num_blocks = -(-input_len // block_size)
    keys = tuple(10_000_000 * (i + 1) + k for k in range(num_blocks))
    return SimRequest(i, arrival_s, input_len, output_len, keys, block_size)


def write_trace(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> Path:
    """rows: (timestamp ms, input_length, output_length, hash_ids)."""
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": m, "hash_ids": h}) + "\n"
                            for t, n, m, h in rows))
    return path


def profile_with_quality(path: Path, prefill_r2: float, prefill_rms: float, decode_r2: float = 0.99,
                         decode_rms: float = 0.02) -> Path:
    write_profile(path, (0.002, 1e-5, 0, 0), (0.001, 1e-5, 0))
    data = json.loads(path.read_text())
    data["prefill"]["fit"].update(r2=prefill_r2, rms_rel_error=prefill_rms)
    data["decode"]["fit"].update(r2=decode_r2, rms_rel_error=decode_rms)
    path.write_text(json.dumps(data))
    return path
