"""The step contract and the block events survive the one serializer
(msgspec msgpack), so the scheduler and runner, or a router subscribing to
events, can sit in different processes."""
import msgspec

from kvferry.types.kv_events import BlockRemoved, BlockStored, KVEvent
from kvferry.core.outputs import (
    CachedRequestData,
    KVOrders,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    SwapOrder,
    TokenLogprobs,
    TransferOrder,
)
from kvferry.messages import decode, encode
from kvferry.sampling import SamplingParams


def test_scheduler_output_round_trip():
    out = SchedulerOutput(
        new_requests=[NewRequestData("a", [1, 2], SamplingParams(seed=3, stop=["x"]), [2], [0, 1], 0, [5])],
        cached_requests=[CachedRequestData("b", [3], 4, [9])],
        num_scheduled_tokens={"a": 2, "b": 3},
        spec_token_ids={"b": [1, 2]},
        spec_tree_parents={"b": [-1, -1]},
        kv_orders=KVOrders(
            swap_out=[SwapOrder("c", [1], [0])],
            swap_in=[SwapOrder("e", [4], [1])],
            load=[TransferOrder("d", [2], keys=[b"k" * 32])],
            save=[TransferOrder("f", [5, 6], keys=[b"s" * 32, b"t" * 32], tenant="acme", num_public_blocks=1)],
        ),
        finished_request_ids=["z"],
        preempted_request_ids=["y"],
    )
    assert decode(encode(out), SchedulerOutput) == out


def test_runner_output_round_trip():
    result = RunnerOutput(
        sampled_token_ids={"a": [1, 2], "b": []},
        logprobs={"a": [TokenLogprobs(1, -0.5, 1, [1], [-0.5]), TokenLogprobs(2, -1.0, 2, [3], [-0.2])]},
        finished_loading=["d"],
        finished_saving=["c"],
        finished_sending=["f"],
    )
    assert decode(encode(result), RunnerOutput) == result


def test_block_events_round_trip_as_a_tagged_union():
    events = [
        BlockStored(block_hashes=[b"h" * 32], parent_block_hash=None, token_ids=[1, 2], block_size=2, owner="t"),
        BlockRemoved(block_hashes=[b"h" * 32]),
    ]
    assert decode(encode(events), list[KVEvent]) == events
    assert msgspec.msgpack.decode(encode(events[1]), type=KVEvent) == events[1]


def test_purge_tenant_and_its_answer_round_trip():
    from kvferry.messages import CoreInput, EngineCoreOutputs, EngineCorePurgeTenant

    purge = EngineCorePurgeTenant(purge_id="p1", tenant="acme")
    assert decode(encode(purge), CoreInput) == purge
    answer = EngineCoreOutputs(outputs=[], timestamp=1.0, purged={"p1": 3})
    assert decode(encode(answer), EngineCoreOutputs) == answer


def test_drop_public_blocks_round_trips():
    from kvferry.messages import CoreInput, EngineCoreDropPublicBlocks

    drop = EngineCoreDropPublicBlocks(purge_id="p2", public_namespace="pub", token_ids=[1, 2, 3, 4], first_block=1)
    assert decode(encode(drop), CoreInput) == drop
