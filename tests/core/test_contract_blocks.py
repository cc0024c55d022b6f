"""Block-exact tests of the step contract, driven by a simulated runner:
exact block ids and eviction order for allocation, prefix hits, deltas,
preemption (recompute and swap), draft rollback, pinning, delayed free,
KV loaded from elsewhere, and the stored/removed events."""
from kvferry.config import SchedulerConfig
from kvferry.core.hashing import ExtraKeys, ROOT_PARENT, hash_block
from kvferry.types.kv_events import BlockRemoved, BlockStored
from kvferry.core.kv_connector import HostSwapScheduler, TierKVScheduler
from kvferry.core.kv_manager import KVCacheManager
from kvferry.core.outputs import CachedRequestData, RunnerOutput, SwapOrder, TransferOrder
from kvferry.core.scheduler import Scheduler
from kvferry.core.swap_space import HostSwapSpace
from kvferry.core.request import Request, RequestStatus
from kvferry.sampling import SamplingParams
from tests.core.sim import simulate_step

EXTRA = ExtraKeys().encode()


def make(num_blocks=8, block_size=4, caching=True, budget=64, swap_space=None, kv_source=None):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    connector = HostSwapScheduler(swap_space) if swap_space else TierKVScheduler(kv_source) if kv_source else None
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), kv, connector=connector)


def req(rid, tokens, max_tokens=8, **kwargs):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs))


def h(*blocks):
    """Chained hashes of consecutive 4-token blocks."""
    out, parent = [], ROOT_PARENT
    for tokens in blocks:
        parent = hash_block(parent, list(tokens), EXTRA)
        out.append(parent)
    return out


def test_new_request_then_deltas_and_hashes_published_after_the_step():
    s = make()
    a = req("a", range(10))
    s.add_request(a)
    out = s.schedule()
    assert [n.block_ids for n in out.new_requests] == [[0, 1, 2]]
    assert out.new_requests[0].num_computed_tokens == 0 and out.num_scheduled_tokens == {"a": 10}
    # Nothing is published before the runner has written the KV.
    assert s.kv.take_events() == []
    assert s.kv.pool.cached == {}
    simulate_step(s, out)
    h0, h1 = h(range(4), range(4, 8))
    assert s.kv.take_events() == [
        BlockStored(block_hashes=[h0, h1], parent_block_hash=None, token_ids=list(range(8)), block_size=4, owner="")
    ]
    out = s.schedule()
    assert out.new_requests == []
    assert out.cached_requests == [CachedRequestData("a", [], 10, [])]
    simulate_step(s, out)
    assert s.kv.take_events() == []  # position 10 computed: block 2 not yet full
    out = s.schedule()
    simulate_step(s, out)  # position 11 computed: block 2 = [8, 9, 7, 7] is full
    [event] = s.kv.take_events()
    assert event.parent_block_hash == h1 and event.token_ids == [8, 9, 7, 7]
    out = s.schedule()  # position 12 needs a 4th block: only its id is sent
    assert out.cached_requests == [CachedRequestData("a", [3], 12, [])]


def test_prefix_hit_ids_and_eviction_order():
    s = make()
    s.add_request(req("a", range(10), max_tokens=1))
    simulate_step(s, s.schedule())
    assert not s.has_unfinished()
    # Freed tail first: block 2 (partial, uncached) goes to the head, the
    # cached 1, 0 to the tail: the free queue is now [2, 3, 4, 5, 6, 7, 1, 0].
    assert [b.block_id for b in s.kv.pool.free_queue] == [2, 3, 4, 5, 6, 7, 1, 0]
    s.kv.take_events()
    s.add_request(req("b", range(13), max_tokens=1))
    out = s.schedule()
    # Blocks 0 and 1 hit; two new ones come from the head of the queue.
    assert out.new_requests[0].block_ids == [0, 1, 2, 3]
    assert out.new_requests[0].num_computed_tokens == 8 and out.num_scheduled_tokens == {"b": 5}
    simulate_step(s, out)  # b computed 13 tokens: block 2 (tokens 8..11) is published
    # b freed tail first: its partial block 3 to the head, 2, 1, 0 to the tail.
    assert [b.block_id for b in s.kv.pool.free_queue] == [3, 4, 5, 6, 7, 2, 1, 0]
    s.kv.take_events()
    s.add_request(req("c", range(100, 116), max_tokens=1))
    out = s.schedule()
    assert out.new_requests[0].block_ids == [3, 4, 5, 6]
    simulate_step(s, out)  # c's four full blocks are cached: queue [7, 2, 1, 0, 6, 5, 4, 3]
    s.kv.take_events()
    s.add_request(req("d", range(200, 205), max_tokens=1))
    out = s.schedule()
    # d takes the plain block 7, then 2, evicting b's third block (the
    # least recently used); a's and b's shared prefix (0, 1) stays cached.
    # The blocks taken are handed out in ascending id.
    assert out.new_requests[0].block_ids == [2, 7]
    h0, h1, h2 = h(range(4), range(4, 8), range(8, 12))
    assert s.kv.take_events() == [BlockRemoved(block_hashes=[h2])]
    assert s.kv.pool.lookup(h0).block_id == 0 and s.kv.pool.lookup(h1).block_id == 1


def test_eviction_publishes_removed_in_order():
    s = make(num_blocks=4)
    s.add_request(req("a", range(9), max_tokens=1))
    simulate_step(s, s.schedule())  # blocks 0, 1 cached, block 2 free
    stored = s.kv.take_events()
    assert [e.block_hashes for e in stored] == [h(range(4), range(4, 8))]
    s.add_request(req("b", range(100, 115), max_tokens=1))
    s.schedule()
    # b takes 2, 3 (plain: a's partial block went back to the head), then
    # 1, 0 (cached: evicted tail first, as the events show), and holds them
    # in ascending id.
    assert s.kv.block_ids("b") == [0, 1, 2, 3]
    h0, h1 = h(range(4), range(4, 8))
    assert s.kv.take_events() == [BlockRemoved(block_hashes=[h1]), BlockRemoved(block_hashes=[h0])]


def test_preempted_request_is_resent_in_full():
    s = make(num_blocks=4, caching=False)
    a, b = req("a", range(7), max_tokens=6), req("b", range(100, 107), max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [n.block_ids for n in out.new_requests] == [[0, 1], [2, 3]]
    simulate_step(s, out)
    simulate_step(s, s.schedule())  # both have computed 8 tokens: pool full
    out = s.schedule()  # a needs a third block: b, admitted last, is preempted
    assert out.preempted_request_ids == ["b"]
    # b freed 3, then 2, each plain, each to the head of the queue: 2 is first.
    assert out.cached_requests == [CachedRequestData("a", [2], 8, [])]
    simulate_step(s, out)
    while "a" in s.requests:  # b cannot fit back until a is done
        out = s.schedule()
        assert "b" not in out.num_scheduled_tokens
        simulate_step(s, out)
    out = s.schedule()
    [new] = out.new_requests
    assert new.request_id == "b" and new.num_computed_tokens == 0
    assert new.output_token_ids == [7, 7] and new.prompt_token_ids == list(range(100, 107))
    assert out.num_scheduled_tokens["b"] == 9


def test_preemption_swaps_out_and_back_in_when_host_has_room():
    s = make(num_blocks=4, caching=False, swap_space=HostSwapSpace(4))
    a, b = req("a", range(7), max_tokens=3), req("b", range(100, 107), max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    simulate_step(s, s.schedule())
    simulate_step(s, s.schedule())
    out = s.schedule()
    assert out.preempted_request_ids == ["b"]
    # b had computed 8 tokens: its two blocks go to host slots 0 and 1.
    assert out.kv_orders.swap_out == [SwapOrder("b", [2, 3], [0, 1])]
    assert s.connector.space.num_free == 2
    simulate_step(s, out)  # a: 3rd token, finished; frees 3, 1, 0
    out = s.schedule()
    [new] = out.new_requests
    assert new.request_id == "b" and new.num_computed_tokens == 8
    assert out.kv_orders.swap_in == [SwapOrder("b", new.block_ids[:2], [0, 1])]
    assert out.num_scheduled_tokens == {"b": 1}  # only the token after the swapped KV
    simulate_step(s, out)
    assert s.connector.space.num_free == 4
    assert s.stats().num_swapped_out == 1 and s.num_preemptions == 1


def test_draft_rollback_and_publication_of_accepted_tokens():
    s = make()
    a = req("a", range(6))
    s.add_request(a)
    simulate_step(s, s.schedule())  # 6 computed, 7 tokens
    s.kv.take_events()
    a.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.spec_token_ids == {"a": [1, 2, 3]}
    assert out.cached_requests[0].new_block_ids == [2]  # room for 6 + 4 tokens
    outputs = simulate_step(s, out, token=9, accept={"a": 1})  # draft 1 accepted, then 9
    assert outputs[0].new_token_ids == [1, 9]
    # 10 computed minus 2 rejected drafts: positions 0..7 hold real KV.
    assert a.num_computed_tokens == 8 and a.num_tokens == 9
    assert s.kv.block_ids("a") == [0, 1, 2]  # the block past the drafts is kept for reuse
    [event] = s.kv.take_events()
    assert event.token_ids == [4, 5, 7, 1]  # block 1: prompt 4, 5, first sample, accepted draft
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (3, 1)
    assert a.spec_token_ids == []


def test_stop_token_inside_accepted_drafts_truncates():
    s = make()
    a = Request("a", list(range(6)), SamplingParams(max_tokens=20), eos_token_ids=(9,))
    s.add_request(a)
    simulate_step(s, s.schedule())
    a.spec_token_ids = [4, 9, 5]
    outputs = simulate_step(s, s.schedule(), token=8)
    assert outputs[0].new_token_ids == [4, 9] and outputs[0].finish_reason == "stop"
    assert a.output_token_ids == [7, 4, 9] and a.status == RequestStatus.FINISHED_STOPPED
    assert s.kv.pool.num_used_blocks == 0


def test_drafts_never_exceed_max_tokens_or_budget():
    s = make(budget=3)
    a = req("a", range(2), max_tokens=3)
    s.add_request(a)
    simulate_step(s, s.schedule())
    a.spec_token_ids = [1, 2, 3, 4]
    out = s.schedule()
    # 1 output so far, 2 more allowed: the last is the target's own sample.
    assert out.spec_token_ids == {"a": [1]}


def test_pinned_blocks_are_never_evicted_until_unpinned():
    s = make(num_blocks=4)
    s.add_request(req("a", range(9), max_tokens=1))
    simulate_step(s, s.schedule())  # 0, 1 cached; 2 free
    s.kv.pin("save-a", [0, 1])  # a tier is reading them
    assert s.kv.pool.num_free_blocks == 2
    s.add_request(req("b", range(100, 115), max_tokens=1))
    s.schedule()
    assert s.kv.block_ids("b") == []  # needs 4, only 2 are not pinned: waits
    s.kv.unpin("save-a")
    s.kv.check_integrity()
    s.schedule()
    assert s.kv.block_ids("b") == [0, 1, 2, 3]


def test_delayed_free_holds_blocks_until_released():
    s = make(num_blocks=4)
    a = req("a", range(8), max_tokens=1)
    s.add_request(a)
    s.schedule()
    s.kv.free(a, delay=True)  # a send of a's KV is in flight
    assert s.kv.pool.num_used_blocks == 2
    s.kv.check_integrity()
    s.kv.release_delayed("a")
    assert s.kv.pool.num_used_blocks == 0
    s.kv.check_integrity()


class ExternalSource:
    """A KV source (tier or prefill worker) holding the first 8 tokens of
    the requests named in it."""

    def __init__(self, rids):
        self.rids = rids

    def num_matched_tokens(self, request, num_computed_tokens):
        return 8 - num_computed_tokens if request.request_id in self.rids else 0


def test_request_waiting_for_kv_does_not_block_the_queue():
    s = make(num_blocks=16, kv_source=ExternalSource({"b"}))
    for rid, start in (("a", 0), ("b", 100), ("c", 200)):
        s.add_request(req(rid, range(start, start + 10)))
    out = s.schedule()
    b = s.requests["b"]
    assert out.num_scheduled_tokens == {"a": 10, "c": 10}
    assert b.status == RequestStatus.WAITING_FOR_KV
    assert out.kv_orders.load == [TransferOrder("b", [3, 4], keys=b.block_hashes[:2])]
    simulate_step(s, out)
    out = s.schedule()  # still loading: skipped again
    assert "b" not in out.num_scheduled_tokens
    simulate_step(s, out)
    out = s.schedule()
    s.update_from_output(out, RunnerOutput(finished_loading=["b"]))
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 8
    out = s.schedule()
    [new] = out.new_requests
    assert new.request_id == "b" and new.num_computed_tokens == 8 and new.block_ids == [3, 4, 8]
    assert out.num_scheduled_tokens["b"] == 2


def test_finishing_while_loading_keeps_blocks_until_the_load_ends():
    s = make(num_blocks=8, kv_source=ExternalSource({"b"}))
    s.add_request(req("b", range(100, 110)))
    out = s.schedule()
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_used_blocks == 2  # the load still writes them
    s.update_from_output(out, RunnerOutput(finished_loading=["b"]))
    assert s.kv.pool.num_used_blocks == 0
    s.kv.check_integrity()


def test_blocks_taken_from_a_descending_run_are_held_in_ascending_order():
    """A finished request's cached blocks rejoin the queue in reverse; the
    next long prompt takes them and lays its KV forward in memory."""
    s = make(num_blocks=8)
    s.add_request(req("a", range(16), max_tokens=1))
    simulate_step(s, s.schedule())  # a's four full blocks cached, freed tail first
    assert [b.block_id for b in s.kv.pool.free_queue][-4:] == [3, 2, 1, 0]
    s.add_request(req("b", range(100, 131), max_tokens=1))  # 32 tokens: eight blocks
    s.schedule()
    assert s.kv.block_ids("b") == list(range(8))
    s.kv.check_integrity()
