"""The disaggregation messages survive the one serializer: a request's
transfer part, a decode core's destination, the router's word on a first
token, and the transfer wire."""
from __future__ import annotations

import pytest

from kvferry.messages import (
    CoreInput, CoreOutput, EngineCoreFirstToken, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, KVDestination,
    KVLayerChunk, KVTransferAck, KVTransferDone, KVTransferParams, KVWire, decode, encode,
)
from kvferry.sampling import SamplingParams

DEST = KVDestination(transfer_id="r1@ab", address="tcp://10.0.0.2:5555", shm_name="psm_1", block_ids=[7, 3, 9],
                     num_cached_tokens=32, block_size=16, lease_s=30.0, deadline=1234.5)


def test_request_with_transfer_round_trips():
    for params in (KVTransferParams(role="decode"), KVTransferParams(role="prefill", dest=DEST)):
        req = EngineCoreRequest(request_id="r1", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(seed=5),
                                eos_token_ids=[2], arrival_time=1.0, kv_transfer=params)
        assert decode(encode(req), CoreInput) == req


def test_first_token_word_round_trips():
    for tokens in ([42], []):
        word = EngineCoreFirstToken(request_id="r1", token_ids=tokens)
        assert decode(encode(word), CoreInput) == word


def test_output_with_destination_round_trips():
    out = EngineCoreOutputs(outputs=[
        EngineCoreOutput(request_id="r1", new_token_ids=[], kv_destination=DEST, num_cached_tokens=32),
        EngineCoreOutput(request_id="r2", new_token_ids=[], finish_reason="error",
                         kv_transfer_error="KV transfer failed: checksum mismatch in layer 0"),
        EngineCoreOutput(request_id="r3", new_token_ids=[42], finish_reason="prefilled"),
        EngineCoreOutput(request_id="r4", new_token_ids=[], kv_transfer_error="KV transfer failed (timeout)",
                         kv_first_token_wanted=True),
    ])
    assert decode(encode(out), CoreOutput) == out


@pytest.mark.parametrize("message", [
    KVLayerChunk(transfer_id="t", layer=3, block_ids=[1, 2], has_payload=True, num_final_blocks=1,
                 checksum=2**64 - 1),
    KVTransferDone(transfer_id="t", num_layers=2, block_ids=[1, 2], output_token_ids=[9],
                   generator_state=b"\x00\xff" * 8),
    KVTransferDone(transfer_id="t", num_layers=0, block_ids=[], output_token_ids=[], error="aborted"),
    # Speculation: the signature, and a head's hidden state with its checksum.
    KVTransferDone(transfer_id="t", num_layers=3, block_ids=[4], output_token_ids=[9], speculative="head",
                   hidden_state=b"\x01\x02" * 16, hidden_state_dtype="bfloat16", hidden_state_checksum=2**64 - 1),
    KVTransferAck(transfer_id="t", ok=False, reason="unknown or expired transfer"),
], ids=lambda m: type(m).__name__)
def test_wire_round_trips(message):
    assert decode(encode(message), KVWire) == message
