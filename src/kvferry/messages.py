"""Messages between the front end and an engine core. No torch.

Every process boundary speaks these types, through one serializer
(``encode`` / ``decode`` below: msgspec msgpack). The front end owns text
(tokenization, chat templates, detokenization, stop strings, n > 1 fan-out);
the core owns token ids, scheduling and the forward pass::

    front end                                   engine core
    ---------                                   -----------
    EngineCoreRequest  ------------------------>  scheduler.add_request
    EngineCoreAbort    ------------------------>  scheduler.finish_requests
    EngineCoreShutdown ------------------------>  abort everything, exit
    EngineCoreHello    ------------------------>  answer EngineCoreReady again (join, health check)
                       <------------------------  EngineCoreReady (once, after loading)
                       <------------------------  EngineCoreOutputs (one per step)

Each direction is one tagged union (``CoreInput`` / ``CoreOutput``), so a
socket carries one message type per direction and a decoder knows every
variant.

A core output carries only what a step added (``new_token_ids``, zero or
more: speculative decoding accepts several per step), never a whole history.
"""
from __future__ import annotations

import msgspec

from typing import Union

from kvferry.core.kv_events import KVEvent
from kvferry.core.outputs import TokenLogprobs
from kvferry.core.stats import SchedulerStats
from kvferry.sampling import SamplingParams

__all__ = [
    "CoreInput", "CoreOutput", "EngineCoreAbort", "EngineCoreOutput", "EngineCoreOutputs", "EngineCoreReady",
    "EngineCoreHello", "EngineCoreRequest", "EngineCoreShutdown", "SchedulerStats", "decode", "encode",
]


class EngineCoreRequest(msgspec.Struct, kw_only=True, tag=True):
    """One sequence to generate (the front end fans n > 1 out into n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Every end-of-sequence id of the model (Llama 3 has two).
    eos_token_ids: list[int]
    # time.monotonic() on the front end (CLOCK_MONOTONIC: one clock per host).
    arrival_time: float
    # Cache namespace (tenant); set by the server from its own view of the
    # caller, never from client input.
    cache_namespace: str = ""
    # Blocks wholly inside a declared public prefix, keyed in this namespace
    # (shared by every tenant); the rest stay in cache_namespace.
    public_cache_namespace: str = ""
    num_public_blocks: int = 0
    # Most blocks the cache may hold for cache_namespace (the tenant's
    # device quota, as the server sees it now); None: no cap.
    cache_quota_blocks: int | None = None
    # The caller's tenant as the server authenticated it ("" with one tenant).
    tenant: str = ""


class EngineCoreAbort(msgspec.Struct, kw_only=True, tag=True):
    """Finish these requests now (a client left, or a stop string matched)."""

    request_ids: list[str]


class EngineCoreShutdown(msgspec.Struct, kw_only=True, tag=True):
    """Abort whatever runs and exit (the front end is going away)."""


class EngineCoreHello(msgspec.Struct, kw_only=True, tag=True):
    """Send EngineCoreReady again. A router that joins a running core (or
    checks that it is alive) asks with this; the core's input thread answers
    at once, even during a long step."""


class EngineCoreOutput(msgspec.Struct, kw_only=True):
    """What one step did for one request."""

    request_id: str
    # Tokens accepted this step, in order (0..k+1 with speculation).
    new_token_ids: list[int]
    # One entry per new token when the request asked for logprobs.
    new_logprobs: list[TokenLogprobs] | None = None
    # "stop" | "length" | "abort" once the core finished the request.
    finish_reason: str | None = None
    # The stop token id that ended it (EOS is reported as None, as in vLLM).
    stop_reason: int | str | None = None
    # Prompt tokens served from the prefix cache on first scheduling.
    num_cached_tokens: int = 0
    # time.monotonic() when the core first scheduled the request; set on the
    # request's first output only (for the queue-time metric).
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, kw_only=True, tag=True):
    """One step's outputs for every request that changed.

    The core also sends one (maybe with no outputs) after applying inputs
    while idle, so that ``stats`` never goes stale after an abort."""

    outputs: list[EngineCoreOutput]
    # time.monotonic() when the step's results were ready.
    timestamp: float = 0.0
    # The scheduler's state after the step (for /metrics).
    stats: SchedulerStats | None = None
    # Set on the last message of a core that is dying: why (e.g. a failed
    # integrity check). The front end then fails every open request.
    engine_error: str | None = None
    # Block events since the previous message (stored / removed hashes):
    # the router's view of which prefixes this core holds.
    kv_events: list[KVEvent] | None = None
    # The step this message reports: tokens it computed and its wall time
    # (0 for a message sent while idle); the router fits its step-time model
    # on these.
    num_scheduled_tokens: int = 0
    step_duration_s: float = 0.0


class EngineCoreReady(msgspec.Struct, kw_only=True, tag=True):
    """The core's handshake, sent once the model is loaded: the facts the
    front end needs to validate requests before they cross the socket."""

    pid: int
    # The context length served (the model's, the user's cap, the KV pool's).
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    model_fingerprint: str
    # The HF folder the core loaded (a GGUF's converted folder): the front
    # end reads the same tokenizer from it.
    model_path: str
    # Every end-of-sequence id (from the tokenizer, else the model config).
    eos_token_ids: list[int]
    # The KV dtype keyed into block hashes (a router recomputes them).
    kv_dtype: str = ""


# One message type per direction.
CoreInput = Union[EngineCoreRequest, EngineCoreAbort, EngineCoreShutdown, EngineCoreHello]
CoreOutput = Union[EngineCoreReady, EngineCoreOutputs]


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, message_type: object):
    """Decode bytes into ``message_type`` (validating every field)."""
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.msgpack.Decoder(message_type)
    return decoder.decode(data)
