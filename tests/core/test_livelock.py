"""No input may hang the scheduler: every request either finishes or is
rejected, in a bounded number of steps."""
from kvferry.config import SchedulerConfig
from kvferry.core.kv_manager import KVCacheManager
from tests.core.sim import simulate_step
from kvferry.core.scheduler import Scheduler
from kvferry.core.request import Request, RequestStatus
from kvferry.sampling import SamplingParams


def make(num_blocks, block_size=4, budget=12, chunked=False):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv)


def run_to_end(s, max_steps=200):
    for _ in range(max_steps):
        if not s.has_unfinished():
            return
        out = s.schedule()
        simulate_step(s, out)
        s.kv.check_integrity()
    raise AssertionError(f"scheduler made no progress: waiting={[r.request_id for r in s.waiting]}")


def test_preempted_request_longer_than_budget_resumes_without_chunking():
    # 6 blocks of 4: two 8-token prompts decode until the pool runs out; b is
    # preempted with 8 + 4 = 12 tokens to recompute, more than the budget of 11.
    s = make(num_blocks=6, budget=11)
    a = Request("a", list(range(8)), SamplingParams(max_tokens=8, ignore_eos=True))
    b = Request("b", list(range(100, 108)), SamplingParams(max_tokens=8, ignore_eos=True))
    s.add_request(a)
    s.add_request(b)
    run_to_end(s)
    assert s.num_preemptions >= 1
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert s.kv.pool.num_used_blocks == 0


def test_request_that_outgrows_the_pool_finishes_with_an_error():
    # No max_model_len: the request grows until it alone needs more blocks than
    # the pool has. It must end (with an error reason), not spin.
    s = make(num_blocks=3, budget=64, chunked=True)
    r = Request("a", list(range(8)), SamplingParams(max_tokens=100, ignore_eos=True))
    s.add_request(r)
    run_to_end(s)
    assert r.status == RequestStatus.FINISHED_ERROR
    # 3 blocks of 4 hold the KV of 12 tokens; the 13th was sampled from them.
    assert r.num_tokens == 13
    assert s.kv.pool.num_used_blocks == 0


def test_prompt_too_long_for_the_budget_left_does_not_block_shorter_ones():
    # Chunking off, budget 11: a takes 4, so b's 11-token prompt must wait
    # for a later step, but c (3 tokens) behind it runs now.
    s = make(num_blocks=32, budget=11)
    s.add_request(Request("a", list(range(4)), SamplingParams(max_tokens=5, ignore_eos=True)))
    s.add_request(Request("b", list(range(10, 21)), SamplingParams(max_tokens=3, ignore_eos=True)))
    s.add_request(Request("c", list(range(30, 33)), SamplingParams(max_tokens=3, ignore_eos=True)))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "c": 3}
    assert [r.request_id for r in s.waiting] == ["b"]
    simulate_step(s, out)
    run_to_end(s)
