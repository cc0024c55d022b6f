"""Choosing a worker. Pure functions over what the router knows of each.

Prefill (and colocated) choice, after Dynamo's KV router: the cost of
sending a request to a worker is the prefill work it would wait for plus the
decode load already there, in tokens::

    cost = overlap_weight * (queued_prefill_tokens + prompt tokens it lacks)
           + active_kv_tokens

The prompt tokens a worker lacks shrink with its cached overlap, so a shared
prefix draws its requests to the worker that holds it until that worker's
queue outweighs the tokens saved. Ties go to the worker with fewer requests
in flight, then to the one chosen longest ago (round robin).

Decode choice: power of two choices over KV usage and running count, which
spreads load without herding every request onto one momentarily idle worker.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker, as the policy sees it."""

    name: str
    cached_blocks: int  # leading blocks of this request's chain it holds
    queued_prefill_tokens: int  # prompt tokens of routed requests not yet past their first token
    active_kv_tokens: int  # KV in use now (blocks used * block size)
    num_in_flight: int  # requests routed to it and not finished
    kv_usage: float = 0.0  # blocks used / blocks total
    num_running: int = 0
    last_chosen: int = 0  # a counter value; lower: chosen longer ago


def uncached_tokens(num_prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    """Prompt tokens still to compute; the last one always is (its logits
    give the first output token), so at most n - 1 tokens hit."""
    return num_prompt_tokens - min(cached_blocks * block_size, num_prompt_tokens - 1)


def prefill_cost(c: Candidate, num_prompt_tokens: int, block_size: int, overlap_weight: float = 1.0) -> float:
    new_tokens = uncached_tokens(num_prompt_tokens, c.cached_blocks, block_size)
    return overlap_weight * (c.queued_prefill_tokens + new_tokens) + c.active_kv_tokens


def choose_prefill(candidates: list[Candidate], num_prompt_tokens: int, block_size: int,
                   overlap_weight: float = 1.0) -> Candidate:
    """The cheapest candidate (see the module docstring). Raises ValueError
    when there is none."""
    if not candidates:
        raise ValueError("candidates must not be empty")
    return min(candidates, key=lambda c: (prefill_cost(c, num_prompt_tokens, block_size, overlap_weight),
                                          c.num_in_flight, c.last_chosen))


def choose_decode(candidates: list[Candidate], rng: random.Random) -> Candidate:
    """Power of two choices: the less loaded (KV usage, then running count)
    of two candidates drawn at random."""
    if not candidates:
        raise ValueError("candidates must not be empty")
    if len(candidates) == 1:
        return candidates[0]
    a, b = rng.sample(candidates, 2)
    return min((a, b), key=lambda c: (c.kv_usage, c.num_running, c.num_in_flight))
