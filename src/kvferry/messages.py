"""Messages between the front end and an engine core. No torch.

Every process boundary speaks these types, through one serializer
(``encode`` / ``decode`` below: msgspec msgpack). The front end owns text
(tokenization, chat templates, detokenization, stop strings, n > 1 fan-out);
the core owns token ids, scheduling and the forward pass::

    front end                                   engine core
    ---------                                   -----------
    EngineCoreRequest  ------------------------>  scheduler.add_request
    EngineCoreAbort    ------------------------>  scheduler.finish_requests
                       <------------------------  EngineCoreOutputs (one per step)

A core output carries only what a step added (``new_token_ids``, zero or
more: speculative decoding accepts several per step), never a whole history.
"""
from __future__ import annotations

import msgspec

from kvferry.core.outputs import TokenLogprobs
from kvferry.sampling import SamplingParams


class EngineCoreRequest(msgspec.Struct, kw_only=True):
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


class EngineCoreAbort(msgspec.Struct, kw_only=True):
    """Finish these requests now (a client left, or a stop string matched)."""

    request_ids: list[str]


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, kw_only=True):
    """One step's outputs for every request that changed."""

    outputs: list[EngineCoreOutput]
    # time.monotonic() when the step's results were ready.
    timestamp: float = 0.0


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, message_type: type):
    """Decode bytes into ``message_type`` (validating every field)."""
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.msgpack.Decoder(message_type)
    return decoder.decode(data)
