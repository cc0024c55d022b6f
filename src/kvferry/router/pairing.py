"""One sequence split across a decode core D and a prefill core P
(``--mode disagg``), as the router tracks it::

    router --request(role=decode)--> D --kv_destination--> router
    router --request(role=prefill, dest)--> P --first token, "prefilled"--> router
    D --tokens from the second on--> router

The client sees one stream: P's first token (made an ordinary token), then
D's. D's outputs that overtake P's first token are held until it arrives.
If D recomputes the prompt itself (a failed transfer) before P's token came
(P stuck: a timeout), D samples the first token and P's is dropped; if P's
token came already, D kept it too and continues from the second.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.messages import EngineCoreOutput, EngineCoreRequest, KVDestination

# Prefill attempts per sequence (the first, then retries on other prefill
# cores when one dies or refuses); past them D's lease decides.
MAX_PREFILL_ATTEMPTS = 3


@dataclass(eq=False)
class PairedSequence:
    request: EngineCoreRequest  # as the front end built it (no kv_transfer)
    decode: object  # the Worker decoding it
    prefill: object | None = None  # the Worker prefilling it now
    dest: KVDestination | None = None
    first_token_seen: bool = False  # streamed to the client
    recomputing: bool = False  # D computes the prompt (and first token) itself
    held: list[EngineCoreOutput] = field(default_factory=list)
    attempts: int = 0


def first_token_finish(request: EngineCoreRequest, token: int, max_model_len: int) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) if the first output token already ends
    the sequence, by the scheduler's own rule (engine/core scheduler
    ``_check_stop`` with one output token); None otherwise. P reports its
    token as "prefilled" either way; the router ends the stream here rather
    than wait for D to say so."""
    params = request.sampling_params
    if 1 >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return "stop", None
        if token in (params.stop_token_ids or ()):
            return "stop", token
    if params.max_tokens is not None and params.max_tokens <= 1:
        return "length", None
    if max_model_len and len(request.prompt_token_ids) + 1 >= max_model_len:
        return "length", None
    return None
