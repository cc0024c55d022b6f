"""Pairing: one client stream from a sequence split across a decode core
and a prefill core; its prefill moves when a prefill core refuses or dies."""
from __future__ import annotations

import random
import time

from kvferry.messages import EngineCoreAbort, EngineCoreFirstToken, EngineCoreOutput, EngineCoreRequest, KVDestination
from kvferry.router.config import RouterConfig
from kvferry.router.errors import EngineDeadError, KVTransferFailedError
from kvferry.router.membership import Membership
from kvferry.router.pairing import MAX_PREFILL_ATTEMPTS, Pairing
from kvferry.router.prefix_index import PrefixIndex
from kvferry.router.routing import Router
from tests.router.fakes import READY, make_request, make_worker


class Cores:
    """Two prefill cores and a decode core behind a real router and pairing."""

    def __init__(self) -> None:
        self.p0, self.p1 = make_worker("prefill-0", "prefill"), make_worker("prefill-1", "prefill")
        self.d = make_worker("decode-0", "decode")
        members = Membership("disagg", READY)
        for worker in (self.p0, self.p1, self.d):
            members.add(worker)
        router = Router(members, RouterConfig(mode="disagg"), PrefixIndex(), random.Random(0))
        self.failed: list[tuple[str, BaseException]] = []
        self.pairing = Pairing(router, lambda child, error: self.failed.append((child, error)), READY.max_model_len)

    def start(self, request_id: str = "r0", **params) -> None:
        self.pairing.start(make_request(request_id, **params), self.d)
        # D allocated the blocks: it says where the KV goes.
        assert self.pairing.outputs(self.d, [out(request_id, kv_destination=destination())]) == []


def destination(deadline_s: float = 60.0) -> KVDestination:
    return KVDestination(transfer_id="t0", address="tcp://d:1", block_ids=[0, 1, 2, 3], num_cached_tokens=0,
                         block_size=4, lease_s=deadline_s, deadline=time.monotonic() + deadline_s)


def out(request_id: str = "r0", tokens: list[int] | None = None, finish: str | None = None, **fields):
    return EngineCoreOutput(request_id=request_id, new_token_ids=tokens or [], finish_reason=finish, **fields)


def prefill_requests(worker) -> list[EngineCoreRequest]:
    return [m for m in worker.connection.sent if isinstance(m, EngineCoreRequest)]


def aborts(worker) -> list[list[str]]:
    return [m.request_ids for m in worker.connection.sent if isinstance(m, EngineCoreAbort)]


def words(worker) -> list[tuple[str, list[int]]]:
    """The router's words on first tokens sent to ``worker``."""
    return [(m.request_id, m.token_ids) for m in worker.connection.sent if isinstance(m, EngineCoreFirstToken)]


def test_decode_first_then_prefill_where_decode_says():
    cores = Cores()
    cores.start()
    [to_d] = cores.d.connection.sent
    assert to_d.kv_transfer.role == "decode" and to_d.request_id == "r0"
    [to_p] = prefill_requests(cores.p0)
    assert to_p.kv_transfer.role == "prefill" and to_p.kv_transfer.dest.transfer_id == "t0"
    assert cores.p0.queued_prefill == {"r0": 16} and cores.p0.num_routed == 1
    assert prefill_requests(cores.p1) == []


def test_decode_tokens_that_overtake_the_first_wait_for_it():
    cores = Cores()
    cores.start()
    assert cores.pairing.outputs(cores.d, [out(tokens=[7])]) == []
    released = cores.pairing.outputs(cores.p0, [out(tokens=[5], finish="prefilled")])
    assert [(o.new_token_ids, o.finish_reason) for o in released] == [([5], None), ([7], None)]
    assert cores.p0.queued_prefill == {}
    # From now on D's tokens pass straight through, and its end forgets the sequence.
    assert cores.pairing.outputs(cores.d, [out(tokens=[8], finish="length")])[0].new_token_ids == [8]
    assert len(cores.pairing) == 0


def test_every_output_reports_the_prefill_cores_cached_tokens():
    # P computed the prompt: what it did not compute (its device hit plus
    # its tier loads, 48 here) is the stream's cached_tokens, held outputs
    # of D's and later ones alike, not D's own device hit (0).
    cores = Cores()
    cores.start()
    assert cores.pairing.outputs(cores.d, [out(tokens=[7])]) == []
    released = cores.pairing.outputs(cores.p0, [out(tokens=[5], finish="prefilled", num_cached_tokens=48)])
    assert [o.num_cached_tokens for o in released] == [48, 48]
    [last] = cores.pairing.outputs(cores.d, [out(tokens=[8], finish="length")])
    assert last.num_cached_tokens == 48

    # D recomputed the prompt (its transfer failed): its own count stands.
    cores = Cores()
    cores.start()
    cores.pairing.outputs(cores.d, [out(kv_transfer_error="recomputing: timeout", kv_first_token_wanted=True)])
    cores.pairing.outputs(cores.p0, [out(tokens=[5], finish="prefilled", num_cached_tokens=48)])
    [last] = cores.pairing.outputs(cores.d, [out(tokens=[9], finish="length", num_cached_tokens=16)])
    assert last.num_cached_tokens == 16


def test_a_first_token_that_ends_the_sequence_ends_the_stream():
    cores = Cores()
    cores.start()
    [first] = cores.pairing.outputs(cores.p0, [out(tokens=[READY.eos_token_ids[0]], finish="prefilled")])
    assert first.finish_reason == "stop" and cores.pairing.get("r0") is None


def test_a_refused_prefill_moves_to_another_core_until_the_attempts_run_out():
    cores = Cores()
    cores.start()
    for attempt in range(1, MAX_PREFILL_ATTEMPTS):
        worker = cores.p0 if attempt % 2 else cores.p1
        assert cores.pairing.outputs(worker, [out(finish="abort")]) == []
        assert cores.pairing.get("r0").attempts == attempt + 1
    assert [len(prefill_requests(w)) for w in (cores.p0, cores.p1)] == [2, 1]
    cores.pairing.outputs(cores.p0, [out(finish="abort")])  # the last attempt: D's lease decides
    assert [len(prefill_requests(w)) for w in (cores.p0, cores.p1)] == [2, 1]
    assert cores.failed == []


def test_a_dead_prefill_core_is_replaced():
    cores = Cores()
    cores.start()
    cores.p0.alive = False
    cores.pairing.prefill_lost(cores.p0, EngineDeadError("p0 exited"))
    assert len(prefill_requests(cores.p1)) == 1 and cores.pairing.get("r0").prefill is cores.p1
    assert cores.failed == []


def test_a_finished_decode_whose_first_token_died_fails_the_request():
    cores = Cores()
    cores.start()
    cores.pairing.outputs(cores.d, [out(tokens=[7], finish="length")])  # held: P's token comes first
    cores.p0.alive = False
    error = EngineDeadError("p0 exited")
    cores.pairing.prefill_lost(cores.p0, error)
    assert cores.failed == [("r0", error)] and len(cores.pairing) == 0
    assert prefill_requests(cores.p1) == []


def test_a_failed_transfer_fails_or_recomputes_as_decode_says():
    cores = Cores()
    cores.start()
    assert cores.pairing.outputs(cores.d, [out(finish="error", kv_transfer_error="checksum")]) == []
    [(child, error)] = cores.failed
    assert child == "r0" and isinstance(error, KVTransferFailedError) and str(error) == "checksum"
    assert aborts(cores.p0) == [["r0"]]

    # D's lease ended before any token of P's came here: the router says so
    # (an empty word), D samples the first token itself, P's late one is dropped.
    cores = Cores()
    cores.start()
    assert cores.pairing.outputs(cores.d, [out(kv_transfer_error="recomputing: timeout",
                                                kv_first_token_wanted=True)]) == []
    assert words(cores.d) == [("r0", [])] and aborts(cores.p0) == [["r0"]]
    assert cores.pairing.outputs(cores.d, [out(tokens=[9])])[0].new_token_ids == [9]
    assert cores.pairing.outputs(cores.p0, [out(tokens=[5], finish="prefilled")]) == []
    assert cores.failed == []


def test_a_decode_core_whose_lease_ended_after_the_first_token_streamed_continues_from_it():
    # P reported its first token (streamed), but D's lease ended before P's
    # Done reached it: D samples nothing until the router's word, which is
    # P's token. The client sees it once, and D continues from it.
    cores = Cores()
    cores.start()
    [first] = cores.pairing.outputs(cores.p0, [out(tokens=[5], finish="prefilled")])
    assert first.new_token_ids == [5]
    assert cores.pairing.outputs(cores.d, [out(kv_transfer_error="recomputing: timeout",
                                                kv_first_token_wanted=True)]) == []
    assert words(cores.d) == [("r0", [5])]
    assert cores.pairing.outputs(cores.d, [out(tokens=[7, 8])])[0].new_token_ids == [7, 8]
    assert cores.failed == []

    # P's first token ended the stream already: D is told to stop, not to go on.
    cores = Cores()
    cores.start()
    [first] = cores.pairing.outputs(cores.p0, [out(tokens=[READY.eos_token_ids[0]], finish="prefilled")])
    assert first.finish_reason == "stop"
    cores.pairing.outputs(cores.d, [out(kv_transfer_error="recomputing: timeout", kv_first_token_wanted=True)])
    assert words(cores.d) == [] and aborts(cores.d) == [["r0"]]


def test_a_decode_core_that_kept_the_first_token_waits_for_the_prefill_cores_report_of_it():
    # P's Done reached D (only the KV was bad): D kept P's token and goes on
    # from the second, even when its report overtakes P's.
    cores = Cores()
    cores.start()
    assert cores.pairing.outputs(cores.d, [out(kv_transfer_error="recomputing: checksum")]) == []
    assert cores.pairing.outputs(cores.d, [out(tokens=[6])]) == []  # held: P's token comes first
    released = cores.pairing.outputs(cores.p0, [out(tokens=[5], finish="prefilled")])
    assert [o.new_token_ids for o in released] == [[5], [6]]
    assert words(cores.d) == [] and aborts(cores.p0) == [] and cores.failed == []

    # P dies before its report: another core's first token could differ from D's.
    cores = Cores()
    cores.start()
    cores.pairing.outputs(cores.d, [out(kv_transfer_error="recomputing: checksum")])
    cores.p0.alive = False
    error = EngineDeadError("p0 exited")
    cores.pairing.prefill_lost(cores.p0, error)
    assert cores.failed == [("r0", error)] and prefill_requests(cores.p1) == []


def test_drop_aborts_the_prefill_and_stale_cores_are_ignored():
    cores = Cores()
    cores.start()
    cores.start("r1")
    cores.pairing.drop("r0")
    assert aborts(cores.p0) == [["r0"]] and cores.pairing.get("r0") is None
    # r1 went to p1; p0 has nothing to say about it any more.
    assert cores.pairing.get("r1").prefill is cores.p1
    assert cores.pairing.outputs(cores.p0, [out("r1", tokens=[5], finish="prefilled")]) == []
    unpaired = out("other", tokens=[1])
    assert cores.pairing.outputs(cores.p0, [unpaired]) == [unpaired]


def test_no_retry_past_the_decode_cores_deadline():
    cores = Cores()
    cores.pairing.start(make_request(), cores.d)
    cores.pairing.outputs(cores.d, [out(kv_destination=destination(deadline_s=-1.0))])
    cores.pairing.outputs(cores.p0, [out(finish="abort")])
    assert len(prefill_requests(cores.p0)) + len(prefill_requests(cores.p1)) == 1
