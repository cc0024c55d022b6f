"""Scheduler driven by a simulated runner (the design keeps the scheduler free
of torch precisely so that it can be driven like this)."""
from kvferry.config import SchedulerConfig
from kvferry.core.kv_manager import KVCacheManager
from tests.core.sim import samples, simulate_step
from kvferry.core.scheduler import Scheduler
from kvferry.core.request import Request, RequestStatus
from kvferry.sampling import SamplingParams


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, caching=True):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), kv)


def req(rid, n_prompt, max_tokens=4, start=0):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s, token=7):
    return step_sampling(s, token)[0]


def step_sampling(s, token=7):
    """One step; also returns the requests that sampled in it."""
    out = s.schedule()
    sampling = samples(s, out)
    simulate_step(s, out, token)
    s.kv.check_integrity()
    return out, sampling


def test_chunked_prefill_respects_budget_and_mixes_decodes():
    s = make(budget=10)
    s.add_request(req("a", 3))
    s.add_request(req("b", 25))
    out, sampling = step_sampling(s)
    assert out.num_scheduled_tokens == {"a": 3, "b": 7}
    assert sampling == ["a"]
    out = step(s)
    # a decodes one token, b gets the remaining budget.
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    out, sampling = step_sampling(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    assert sampling == ["a", "b"]


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 4))
    out = step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert len(s.waiting) == 1


def test_requests_finish_at_max_tokens_and_free_blocks():
    s = make()
    s.add_request(req("a", 5, max_tokens=3))
    for _ in range(3):
        step(s)
    assert not s.has_unfinished()
    assert s.kv.pool.num_used_blocks == 0
    assert s.schedule().finished_request_ids == ["a"]


def test_preemption_when_blocks_run_out_then_resume():
    # 4 blocks of 4 tokens: two requests of 6 prompt tokens need 2 blocks each,
    # and the first decode that crosses a block boundary must preempt.
    s = make(num_blocks=4, block_size=4, caching=False)
    s.add_request(req("a", 7, max_tokens=6))
    s.add_request(req("b", 7, max_tokens=6, start=100))
    step(s)
    step(s)  # both at 8 tokens: 2 blocks each, pool full
    out = step(s)  # a needs a third block: b (admitted last) is preempted
    assert out.preempted_request_ids == ["b"]
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert s.requests["b"].num_computed_tokens == 0
    while s.has_unfinished():
        step(s)
    assert s.num_preemptions >= 1
    assert s.kv.pool.num_used_blocks == 0


def test_prefix_hit_skips_cached_blocks():
    s = make(block_size=4)
    s.add_request(req("a", 10, max_tokens=1))
    step(s)
    assert not s.has_unfinished()
    s.add_request(req("b", 13, max_tokens=1))
    out = step(s)
    # Blocks [0..3] and [4..7] are shared with "a": 8 tokens hit.
    assert out.new_requests[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 5}
    assert s.kv.stats.hits == 8


def test_full_prompt_hit_still_computes_last_token():
    s = make(block_size=4)
    s.add_request(req("a", 8, max_tokens=1))
    step(s)
    s.add_request(req("b", 8, max_tokens=1))
    out = step(s)
    assert out.new_requests[0].num_computed_tokens == 4
    assert out.num_scheduled_tokens == {"b": 4}


def test_namespace_isolates_prefix_cache():
    s = make(block_size=4)
    a = req("a", 9, max_tokens=1)
    a.cache_namespace = "tenant-a"
    s.add_request(a)
    step(s)
    b = req("b", 9, max_tokens=1)
    b.cache_namespace = "tenant-b"
    s.add_request(b)
    out = step(s)
    assert out.new_requests[0].num_computed_tokens == 0


def test_abort_frees_blocks():
    s = make()
    s.add_request(req("a", 10, max_tokens=50))
    step(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_used_blocks == 0 and not s.has_unfinished()
    s.kv.check_integrity()


def test_prompt_larger_than_pool_is_rejected():
    s = make(num_blocks=2, block_size=4)
    import pytest

    with pytest.raises(ValueError, match="KV cache"):
        s.add_request(req("a", 9))


def test_every_eos_id_stops():
    s = make()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=(5, 9))
    s.add_request(r)
    step(s, token=4)
    step(s, token=9)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [4, 9]
