"""Prefill/decode transfer, scheduler half (the runner's
``PDTransferWorker`` moves the bytes, layer by layer).

Decode role: a request arrives with its prompt and no KV. It is admitted
with blocks for the whole prompt past its prefix hit, expects the prompt's
KV from a prefill core, and announces where the KV goes::

    | hit (ours) |  external: written by the prefill core  |
    '-- kept --' '-- KVDestination.block_ids --------------'

Prefill role: each step streams every block it completes or touches that
the decode core lacks, layer by layer during the forward pass; a block
partly written now is sent again, whole, by a later step::

    P blocks: | P's hit | computed before | this step |
    D blocks: | D's hit |<-- sent earlier -->|<- now ->|
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from kvferry.core.kv_connector.base import ExternalTokens, KVConnectorScheduler
from kvferry.core.outputs import KVOrders, ReceiveOrder, RunnerOutput, StreamOrder
from kvferry.messages import EngineCoreOutput, KVDestination, KVTransferParams
from kvferry.core.request import Request, RequestStatus


@dataclass(slots=True)
class KVTransferSettings:
    """This core's side of prefill/decode disaggregation (from the worker
    half once its transfer socket and KV pool exist)."""

    address: str  # the transfer socket a prefill core connects to
    shm_name: str  # the KV pool's shared-memory segment ("": none)
    timeout_s: float  # the lease of each transfer
    recompute_on_failure: bool  # else finish the request with an error


def kv_role(request: Request) -> str:
    """"prefill", "decode" or "" (both phases on this core)."""
    params = request.kv_transfer
    return params.role if isinstance(params, KVTransferParams) else ""


class PDTransferScheduler(KVConnectorScheduler):
    def __init__(self, settings: KVTransferSettings) -> None:
        self.settings = settings
        # Per prefill-role request: the first of its blocks not yet sent whole.
        self._streams: dict[str, int] = {}

    # -- decode role ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalTokens:
        if kv_role(request) != "decode":
            return ExternalTokens()
        return ExternalTokens(request.num_tokens - num_computed_tokens, is_async=True)

    def update_state_after_alloc(self, request: Request, external: ExternalTokens,
                                 orders: KVOrders) -> KVDestination | None:
        if not external.num_tokens or kv_role(request) != "decode":
            return None
        rid, kv = request.request_id, self.control.kv
        bs, settings = kv.block_size, self.settings
        request.first_scheduled_time = time.monotonic()
        deadline = time.monotonic() + settings.timeout_s
        block_ids = kv.block_ids(rid)[request.num_computed_tokens // bs :]
        transfer_id = f"{rid}@{uuid.uuid4().hex[:12]}"
        orders.receive.append(ReceiveOrder(rid, transfer_id, block_ids, deadline))
        return KVDestination(transfer_id=transfer_id, address=settings.address, shm_name=settings.shm_name,
                             block_ids=block_ids, num_cached_tokens=request.num_computed_tokens, block_size=bs,
                             lease_s=settings.timeout_s, deadline=deadline)

    def load_finished(self, request: Request, num_tokens: int, result: RunnerOutput,
                      outputs: list[EngineCoreOutput]) -> None:
        """The prompt's KV arrived whole and verified; resume with the
        prefill core's first token appended (which that core reported: only
        a finish is reported here)."""
        request.num_computed_tokens += num_tokens
        request.status = RequestStatus.WAITING
        request.kv_transfer = None
        stop = self.control.append_tokens(request, result.kv_received.get(request.request_id, []))
        self.control.kv.cache_computed_blocks(request)
        if stop is not None:
            self.control.finish(request, stop)
            outputs.append(self.control.core_output(request, []))

    def load_failed(self, request: Request, reason: str, result: RunnerOutput,
                    outputs: list[EngineCoreOutput]) -> None:
        """Never decode from partial KV. Recompute the prompt here (its
        blocks stay; nothing past the prefix hit was published), or end the
        request with the reason.

        ``kv_received``: the prefill core's first token when its Done
        arrived (only the KV failed): it was computed from intact KV and
        reported already, so it is appended and the recompute samples the
        second token. Without it (a timeout) the recompute samples the first
        token here; a router that streamed one from the prefill core drops
        this core's first (the same token: same KV, same seed)."""
        request.kv_transfer = None
        control = self.control
        if self.settings.recompute_on_failure:
            request.status = RequestStatus.WAITING
            first = result.kv_received.get(request.request_id, [])
            stop = control.append_tokens(request, first)
            if stop is not None:
                control.finish(request, stop)
            output = control.core_output(request, [])
            output.kv_transfer_error = f"KV transfer failed ({reason}); recomputing the prompt"
            output.kv_first_token_resampled = not first
        else:
            control.finish(request, RequestStatus.FINISHED_ERROR)
            output = control.core_output(request, [])
            output.kv_transfer_error = f"KV transfer failed: {reason}"
        outputs.append(output)

    # -- prefill role --------------------------------------------------------------
    def on_scheduled(self, request: Request, num_new_tokens: int, orders: KVOrders) -> None:
        if kv_role(request) != "prefill":
            return
        dest: KVDestination = request.kv_transfer.dest
        rid, bs = request.request_id, self.control.kv.block_size
        d_first = dest.num_cached_tokens // bs
        lo = self._streams.get(rid, d_first)
        end = min(request.num_computed_tokens + num_new_tokens, request.num_prompt_tokens)
        hi = -(-end // bs)
        self._streams[rid] = max(lo, end // bs)
        block_ids = self.control.kv.block_ids(rid)
        orders.stream.append(StreamOrder(
            request_id=rid, transfer_id=dest.transfer_id, address=dest.address, shm_name=dest.shm_name,
            src_block_ids=block_ids[lo:hi], dst_block_ids=dest.block_ids[lo - d_first : hi - d_first],
            all_dst_block_ids=list(dest.block_ids),
            num_final_blocks=hi - lo if end >= request.num_prompt_tokens else end // bs - lo,
            last=end >= request.num_prompt_tokens, lease_s=dest.lease_s, deadline=dest.deadline,
        ))

    def apply_completions(self, result: RunnerOutput) -> None:
        for rid in result.finished_sending:
            self._streams.pop(rid, None)

    def request_finished(self, request: Request) -> bool:
        """A prefill's blocks stay until its stream is acknowledged (or its lease ends)."""
        return request.request_id in self._streams
