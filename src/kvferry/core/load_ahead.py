"""Load at arrival: requests still queued (behind ``max_num_seqs`` or the
token budget) start loading their KV connector's matches now, not when
admitted, so that the load overlaps their wait::

    queued request: | device hit | loaded ahead (tier) | computed once admitted |

Each request is looked up once. A load ahead takes only blocks the running
requests cannot need for their prompts and next token (``spare_blocks``);
the blocks belong to the request (nothing evicts them) until it runs,
finishes, or gives them up to a running request (``release``). No torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.core.kv_connector import ExternalTokens, kv_role
from kvferry.core.outputs import SchedulerOutput
from kvferry.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvferry.core.scheduler import Scheduler


class LoadAhead:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        # Queued requests whose matches were looked up -> the end (in
        # tokens) of what the connector held then (0: nothing, or not
        # again); and the requests holding blocks loaded ahead (not running yet).
        self._held: dict[str, int] = {}
        self._loaded: set[str] = set()
        self.num_loads_ahead = 0

    def start_loads(self, out: SchedulerOutput) -> None:
        s = self.scheduler
        if not s.connector.can_load_ahead or not s.waiting:
            return
        kv, spare = s.kv, self.spare_blocks()
        # Queue order (arrival, preempted first): cheap with many tenants,
        # and each request behind is looked up once only.
        for request in list(s.waiting):
            if spare <= 0:
                break
            rid = request.request_id
            if self._held.get(rid) == 0 or not self._may_load(request):
                continue
            hit = kv.find_prefix_hit(request)
            if rid not in self._held:
                external = s.connector.get_num_new_matched_tokens(request, hit.num_tokens)
                held = external.num_tokens if external.is_async else 0
                self._held[rid] = hit.num_tokens + held if held else 0
            num_load = self._held[rid] - hit.num_tokens
            if num_load <= 0:
                continue
            bs = kv.block_size
            needed = -(-(hit.num_tokens + num_load) // bs) - len(hit.blocks)
            needed += sum(1 for b in hit.blocks if b.ref_cnt == 0)  # touching them takes them off the free queue
            if needed > spare:
                break  # the requests behind it do not jump ahead
            if kv.allocate_slots(request, 0, hit, num_external_tokens=num_load) is None:
                break
            spare -= needed
            request.num_computed_tokens += hit.num_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.num_tokens
                kv.record_lookup(request, hit)
            s.connector.update_state_after_alloc(request, ExternalTokens(num_load, is_async=True), out.kv_orders)
            s.wait_for_load(request, num_load)
            self._loaded.add(rid)
            self.num_loads_ahead += 1

    def _may_load(self, request: Request) -> bool:
        """Queued, never looked up, holding nothing, and not a decode-role
        request (its KV comes from a prefill core)."""
        s, rid = self.scheduler, request.request_id
        return (request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and rid not in self._loaded
                and request.num_computed_tokens == 0 and not s.connector.resume_tokens(request)
                and rid not in s.kv.req_blocks and kv_role(request) != "decode")

    def spare_blocks(self) -> int:
        """Free blocks beyond what the running requests need to finish their
        prompts and take their next token (and its drafts)."""
        s = self.scheduler
        bs, reserved = s.kv.block_size, 0
        # Drafts' slots only at batch sizes where drafts may run (none at a large batch).
        k = s.draft_budget.max_drafts(len(s.running)) if s.draft_budget is not None else s.num_speculative_tokens
        for request in s.running:
            held = len(s.kv.req_blocks.get(request.request_id, ()))
            reserved += max(0, -(-(request.num_tokens + 1 + k) // bs) - held)
        return s.kv.pool.num_free_blocks - reserved

    def forget(self, request_id: str) -> None:
        """Running or finished: a later preemption looks it up afresh."""
        self._held.pop(request_id, None)
        self._loaded.discard(request_id)

    def release(self, keep: Request | None = None) -> bool:
        """Give up the blocks of the last queued request (other than
        ``keep``) that loaded ahead and is done loading: its KV is published
        first, so that its blocks stay in the prefix cache (evictable) and a
        later admission hits them. Returns whether one was released."""
        s = self.scheduler
        for request in reversed(s.waiting):
            rid = request.request_id
            if (request is keep or rid not in self._loaded or rid in s.loading
                    or rid not in s.kv.req_blocks):
                continue
            s.kv.cache_computed_blocks(request)
            s.kv.free(request)
            request.num_computed_tokens = 0
            self._loaded.discard(rid)
            self._held[rid] = 0  # not again: the pool is short
            return True
        return False
