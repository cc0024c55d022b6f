"""A simulated runner for scheduler tests: what a real runner would sample,
decided from the scheduler's own counters (no torch)."""
from kvferry.core.outputs import RunnerOutput, SchedulerOutput
from kvferry.core.scheduler import Scheduler


def samples(s: Scheduler, out: SchedulerOutput) -> list[str]:
    """Requests whose scheduled tokens reach past their known tokens (a
    non-final prefill chunk does not sample)."""
    return [
        rid for rid in out.num_scheduled_tokens
        if rid in s.requests and s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens
    ]


def simulate_step(s: Scheduler, out: SchedulerOutput, token: int = 7, accept: dict[str, int] | None = None):
    """Every sampling request gets ``token``; a request with drafts gets its
    first ``accept[rid]`` drafts (all by default) and then ``token``."""
    result = RunnerOutput()
    for rid in samples(s, out):
        drafts = out.spec_token_ids.get(rid, [])
        n = len(drafts) if accept is None else accept.get(rid, len(drafts))
        result.sampled_token_ids[rid] = drafts[:n] + [token]
    return s.update_from_output(out, result)
