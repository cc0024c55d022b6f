"""The scheduler's side of disaggregation, driven without a model (no
torch): exact block ids of a decode core's destination and of a prefill
core's per-step stream orders, resuming with the first token, recompute or
error on failure, and the delayed free on the prefill side."""
from __future__ import annotations

from kvferry.config import SchedulerConfig
from kvferry.core.kv_manager import KVCacheManager
from kvferry.core.outputs import RunnerOutput
from kvferry.core.kv_connector import KVTransferSettings, PDTransferScheduler
from kvferry.core.kv_connector.disagg import first_token_word
from kvferry.core.scheduler import Scheduler
from kvferry.messages import KVDestination, KVTransferParams
from kvferry.core.request import Request, RequestStatus
from kvferry.sampling import SamplingParams

BS = 16


def make(recompute: bool = True, budget: int = 512) -> Scheduler:
    settings = KVTransferSettings("tcp://d:1", "psm_d", 5.0, recompute)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), KVCacheManager(32, BS),
                     connector=PDTransferScheduler(settings))


def req(rid: str, n: int, params: KVTransferParams, start: int = 100) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=4, ignore_eos=True),
                   kv_transfer=params)


def test_decode_role_destination_then_resume_with_first_token():
    s = make()
    # A 32-token prefix already cached on D (two full blocks).
    s.add_request(Request("warm", list(range(100, 132)) + [1], SamplingParams(max_tokens=1, ignore_eos=True)))
    out = s.schedule()
    s.update_from_output(out, RunnerOutput(sampled_token_ids={"warm": [5]}))
    s.add_request(req("d", 40, KVTransferParams(role="decode")))
    out = s.schedule()
    assert out.num_scheduled_tokens == {} and len(out.kv_orders.receive) == 1
    order = out.kv_orders.receive[0]
    assert order.block_ids == s.kv.block_ids("d")[2:] and len(order.block_ids) == 1
    (first,) = s.update_from_output(out, RunnerOutput())
    dest = first.kv_destination
    assert (dest.num_cached_tokens, dest.block_ids, dest.transfer_id) == (32, order.block_ids, order.transfer_id)
    assert s.requests["d"].status == RequestStatus.WAITING_FOR_KV
    # The KV arrives with the prefill core's first token: decode starts at the second.
    out = s.schedule()
    assert s.update_from_output(out, RunnerOutput(finished_loading=["d"], kv_received={"d": [9]})) == []
    out = s.schedule()
    (new,) = out.new_requests
    assert (new.num_computed_tokens, new.output_token_ids, out.num_scheduled_tokens) == (40, [9], {"d": 1})
    (o,) = s.update_from_output(out, RunnerOutput(sampled_token_ids={"d": [10]}))
    assert o.new_token_ids == [10]


def test_decode_role_failure_recomputes_or_errors():
    for recompute in (True, False):
        s = make(recompute)
        s.add_request(req("d", 40, KVTransferParams(role="decode")))
        out = s.schedule()
        s.update_from_output(out, RunnerOutput())
        blocks = s.kv.block_ids("d")
        out = s.schedule()
        (o,) = s.update_from_output(out, RunnerOutput(failed_loading={"d": "checksum mismatch in layer 1"}))
        assert "checksum mismatch" in o.kv_transfer_error
        if recompute:
            assert not o.finished
            # No first token of the prefill core's came with it: this core
            # samples nothing until the router's word on it, and says so.
            assert o.kv_first_token_wanted
            for _ in range(3):
                assert s.schedule().num_scheduled_tokens == {}
            assert s.requests["d"].status == RequestStatus.WAITING_FOR_KV and s.kv.block_ids("d") == blocks
            first_token_word(s.connector, "d", [])  # none was streamed: sample it here
            out = s.schedule()  # the whole prompt, into the same blocks
            assert out.num_scheduled_tokens == {"d": 40} and s.kv.block_ids("d") == blocks
        else:
            assert o.finish_reason == "error"
            assert s.kv.pool.num_used_blocks == 0
        s.kv.check_integrity()


def test_a_decode_request_resumes_after_the_first_token_the_router_streamed():
    s = make()
    s.add_request(req("d", 40, KVTransferParams(role="decode")))
    s.update_from_output(s.schedule(), RunnerOutput())
    (o,) = s.update_from_output(s.schedule(), RunnerOutput(failed_loading={"d": "timeout"}))
    assert o.kv_first_token_wanted and o.new_token_ids == []
    first_token_word(s.connector, "d", [9])  # the prefill core's, which the client got
    first_token_word(s.connector, "d", [8])  # a second word is ignored
    out = s.schedule()
    # The prompt and that token are computed again: the step samples the second token.
    (new,) = out.new_requests
    assert out.num_scheduled_tokens == {"d": 41} and new.output_token_ids == [9]
    (o,) = s.update_from_output(out, RunnerOutput(sampled_token_ids={"d": [10]}))
    assert o.new_token_ids == [10]
    # An abort while it waits frees its blocks; a late word is ignored.
    s.add_request(req("e", 40, KVTransferParams(role="decode"), start=200))
    s.update_from_output(s.schedule(), RunnerOutput())
    s.update_from_output(s.schedule(), RunnerOutput(failed_loading={"e": "timeout"}))
    s.finish_requests(["e", "d"], RequestStatus.FINISHED_ABORTED)
    first_token_word(s.connector, "e", [9])
    assert s.kv.pool.num_used_blocks == 0 and not s.has_unfinished()
    s.kv.check_integrity()


def test_a_decode_request_with_no_word_within_a_lease_ends():
    s = make()
    s.connector.word_timeout_s = 0.0
    s.connector.settings.timeout_s = 0.0
    s.add_request(req("d", 40, KVTransferParams(role="decode")))
    s.update_from_output(s.schedule(), RunnerOutput())
    s.update_from_output(s.schedule(), RunnerOutput(failed_loading={"d": "timeout"}))
    s.schedule()  # the router is gone: it must not sample a first token, so it ends
    assert "d" not in s.requests and s.kv.pool.num_used_blocks == 0
    s.kv.check_integrity()


def test_prefill_role_streams_only_blocks_the_decode_core_lacks():
    s = make(budget=16)  # chunked: 16 tokens a step
    dest = KVDestination(transfer_id="t", address="tcp://d:1", shm_name="psm_d", block_ids=[20, 21],
                         num_cached_tokens=16, block_size=BS, lease_s=5.0, deadline=0.0)
    s.add_request(req("p", 40, KVTransferParams(role="prefill", dest=dest)))
    streams = []
    for _ in range(3):
        out = s.schedule()
        streams.append([(o.src_block_ids, o.dst_block_ids, o.last) for o in out.kv_orders.stream])
        outputs = s.update_from_output(out, RunnerOutput(sampled_token_ids={"p": [7]} if len(streams) == 3 else {}))
    _, p1, p2 = [b.block_id for b in s.kv.delayed_free["p"]]
    # Step 1 computes block 0, which D has: nothing to send.
    assert streams == [[([], [], False)], [([p1], [20], False)], [([p2], [21], True)]]
    (o,) = outputs
    assert (o.new_token_ids, o.finish_reason) == ([7], "prefilled")
    assert s.kv.pool.num_used_blocks == 3 and s.has_unfinished()  # held until D acknowledges
    s.update_from_output(s.schedule(), RunnerOutput(finished_sending=["p"]))
    assert s.kv.pool.num_used_blocks == 0 and not s.has_unfinished()
    s.kv.check_integrity()
