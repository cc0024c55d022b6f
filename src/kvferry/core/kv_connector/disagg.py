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

A decode request whose transfer failed without the prefill core's first
token (its lease ended, or the prefill core gave up) waits for the router's
word on that token before it samples anything (``first_token_word``): the
prefill core may have reported it, and the router streamed it, after this
core's lease ended. Only the router knows; a first token sampled here could
differ from the one the client got (sampling, or a bf16 near-tie).
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from kvferry.core.kv_connector.base import ExternalTokens, KVConnectorScheduler
from kvferry.core.outputs import KVOrders, ReceiveOrder, RunnerOutput, StreamOrder
from kvferry.messages import EngineCoreOutput, KVDestination, KVTransferParams
from kvferry.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVTransferSettings:
    """This core's side of prefill/decode disaggregation (from the worker
    half once its transfer socket and KV pool exist)."""

    address: str  # the transfer socket a prefill core connects to
    shm_name: str  # the KV pool's shared-memory segment ("": none)
    timeout_s: float  # the lease of each transfer
    recompute_on_failure: bool  # else finish the request with an error
    # This core's tensor-parallel ranks, each with a pool of its own heads
    # (KVDestination.tp_size).
    tp_size: int = 1


def kv_role(request: Request) -> str:
    """"prefill", "decode" or "" (both phases on this core)."""
    params = request.kv_transfer
    return params.role if isinstance(params, KVTransferParams) else ""


class PDTransferScheduler(KVConnectorScheduler):
    # How long a request waits for the router's word on its first token
    # (at least): past it the router is gone. The router answers as soon as
    # it reads the request's report, so only a dead or wedged router is this
    # late; the bound keeps such a request from holding its blocks forever.
    word_timeout_s = 60.0

    def __init__(self, settings: KVTransferSettings) -> None:
        self.settings = settings
        # Per prefill-role request: the first of its blocks not yet sent whole.
        self._streams: dict[str, int] = {}
        # Decode-role requests waiting for the router's word on their first
        # token, and until when (then the router is gone: they end).
        self._awaiting_word: dict[str, tuple[Request, float]] = {}

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
                             lease_s=settings.timeout_s, deadline=deadline, tp_size=settings.tp_size)

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
        second token. Without it the request stays parked (skipped by the
        queue, its blocks kept) until ``first_token_word``: the prefill core
        may have reported its token to the router after this core's lease
        ended."""
        request.kv_transfer = None
        control = self.control
        if self.settings.recompute_on_failure:
            first = result.kv_received.get(request.request_id, [])
            if first:
                request.status = RequestStatus.WAITING
                stop = control.append_tokens(request, first)
                if stop is not None:
                    control.finish(request, stop)
            else:
                # Still WAITING_FOR_KV: the queue skips it until the word comes.
                wait_s = max(self.word_timeout_s, self.settings.timeout_s)
                self._awaiting_word[request.request_id] = (request, time.monotonic() + wait_s)
            output = control.core_output(request, [])
            output.kv_transfer_error = f"KV transfer failed ({reason}); recomputing the prompt"
            output.kv_first_token_wanted = not first
        else:
            control.finish(request, RequestStatus.FINISHED_ERROR)
            output = control.core_output(request, [])
            output.kv_transfer_error = f"KV transfer failed: {reason}"
        outputs.append(output)

    def first_token_word(self, request_id: str, token_ids: list[int]) -> None:
        """The router's word on a parked request's first token: the prefill
        core's, which the client got (appended: the recompute samples the
        second), or none (the recompute samples the first). Unknown or
        finished ids are ignored (an abort overtook the word)."""
        request, _ = self._awaiting_word.pop(request_id, (None, 0.0))
        if request is None:
            return
        request.status = RequestStatus.WAITING
        stop = self.control.append_tokens(request, token_ids)
        if stop is not None:
            # The router ends such a stream at the prefill core's token and
            # sends no word for it; this only keeps the request from running on.
            self.control.finish(request, stop)

    def start_step(self, orders: KVOrders) -> None:
        now = time.monotonic()
        for rid, (request, deadline) in list(self._awaiting_word.items()):
            if now > deadline:
                # No router answered in time: it is gone (its streams
                # with it). Sampling a first token now could still duplicate
                # the prefill core's, so the request ends instead.
                logger.warning("request %s: no word on its first token from the router in time; ending it", rid)
                del self._awaiting_word[rid]
                self.control.finish(request, RequestStatus.FINISHED_ERROR)

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
            dst_tp_size=dest.tp_size,
        ))

    def apply_completions(self, result: RunnerOutput) -> None:
        for rid in result.finished_sending:
            self._streams.pop(rid, None)

    def request_finished(self, request: Request) -> bool:
        """A prefill's blocks stay until its stream is acknowledged (or its lease ends)."""
        self._awaiting_word.pop(request.request_id, None)
        return request.request_id in self._streams


def first_token_word(connector: KVConnectorScheduler, request_id: str, token_ids: list[int]) -> None:
    """Hand the router's word (``EngineCoreFirstToken``) to the core's
    prefill/decode connector, alone or within a multi-connector."""
    for part in getattr(connector, "connectors", (connector,)):
        if isinstance(part, PDTransferScheduler):
            part.first_token_word(request_id, token_ids)
