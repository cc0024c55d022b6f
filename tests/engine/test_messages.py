"""Every message between the front end and an engine core survives the one
serializer unchanged, through the union its socket decodes, and bad bytes
are refused with an error naming the field."""
from __future__ import annotations

import msgspec
import pytest

from kvferry.core.hashing import CacheScope
from kvferry.types.kv_events import BlockRemoved, BlockStored
from kvferry.core.outputs import TokenLogprobs
from kvferry.messages import (
    CoreInput, CoreOutput, EngineCoreAbort, EngineCoreHello, EngineCoreOutput, EngineCoreOutputs, EngineCoreReady,
    EngineCoreRequest, EngineCoreShutdown, SchedulerStats, decode, encode,
)
from kvferry.sampling import SamplingParams


def _request() -> EngineCoreRequest:
    params = SamplingParams(n=1, max_tokens=7, temperature=0.5, top_k=3, seed=2**63, stop=["\n\n", "END"],
                            stop_token_ids=[9], logprobs=2, include_stop_str_in_output=True)
    return EngineCoreRequest(request_id="cmpl-1#0", prompt_token_ids=[1, 2, 3], sampling_params=params,
                             eos_token_ids=[2, 7], arrival_time=123.25,
                             cache_scope=CacheScope("tenant-a", "public", num_public_blocks=3))


def _outputs() -> EngineCoreOutputs:
    lp = TokenLogprobs(token_id=5, logprob=-0.25, rank=1, top_token_ids=[5, 6], top_logprobs=[-0.25, -1.5])
    return EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(request_id="a", new_token_ids=[5], new_logprobs=[lp], num_cached_tokens=16,
                             first_scheduled_time=10.5),
            EngineCoreOutput(request_id="b", new_token_ids=[8, 9], finish_reason="stop", stop_reason=9),
            EngineCoreOutput(request_id="c", new_token_ids=[], finish_reason="abort"),
        ],
        timestamp=99.5,
        stats=SchedulerStats(num_running=2, num_waiting=1, num_preemptions=3, kv_blocks_used=4,
                             kv_blocks_total=64, prefix_queries=100, prefix_hits=32),
        engine_error=None,
        kv_events=[BlockStored(block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=None,
                               token_ids=list(range(8)), block_size=4, owner="tenant-a"),
                   BlockRemoved(block_hashes=[b"\x03" * 32])],
        num_scheduled_tokens=130, step_duration_s=0.25,
    )


INPUTS = [_request(), EngineCoreAbort(request_ids=["a", "b#1"]), EngineCoreShutdown(), EngineCoreHello()]
OUTPUTS = [
    _outputs(),
    EngineCoreOutputs(outputs=[], engine_error="the engine core died: AssertionError()"),
    EngineCoreReady(pid=42, max_model_len=2048, vocab_size=49152, num_kv_blocks=100, block_size=16,
                    max_num_batched_tokens=2048, enable_chunked_prefill=True, model_fingerprint="ab" * 32,
                    model_path="/models/x", eos_token_ids=[2, 7], kv_dtype="float32", speculative="draft:cd"),
]


@pytest.mark.parametrize("message", INPUTS, ids=lambda m: type(m).__name__)
def test_inputs_round_trip(message):
    assert decode(encode(message), CoreInput) == message
    assert decode(encode(message), type(message)) == message


@pytest.mark.parametrize("message", OUTPUTS, ids=lambda m: type(m).__name__)
def test_outputs_round_trip(message):
    assert decode(encode(message), CoreOutput) == message


def test_round_trip_keeps_types_not_just_values():
    request = decode(encode(_request()), CoreInput)
    assert isinstance(request.sampling_params, SamplingParams) and request.sampling_params.stop == ["\n\n", "END"]
    out = decode(encode(_outputs()), CoreOutput)
    assert isinstance(out.outputs[0].new_logprobs[0], TokenLogprobs) and isinstance(out.stats, SchedulerStats)
    assert out.outputs[1].finished and not out.outputs[0].finished
    assert [type(e) for e in out.kv_events] == [BlockStored, BlockRemoved]


def test_a_message_of_the_other_direction_is_refused():
    with pytest.raises(msgspec.ValidationError):
        decode(encode(_outputs()), CoreInput)
    with pytest.raises(msgspec.ValidationError):
        decode(encode(_request()), CoreOutput)


def test_bad_fields_are_refused_naming_the_field():
    raw = msgspec.msgpack.decode(encode(_request()))
    raw["prompt_token_ids"] = ["x"]
    with pytest.raises(msgspec.ValidationError, match="prompt_token_ids"):
        decode(msgspec.msgpack.encode(raw), CoreInput)
    # SamplingParams validation runs on decode too.
    raw = msgspec.msgpack.decode(encode(_request()))
    raw["sampling_params"]["top_p"] = 0.0
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        decode(msgspec.msgpack.encode(raw), CoreInput)
