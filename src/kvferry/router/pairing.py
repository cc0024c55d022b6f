"""One sequence split across a decode core D and a prefill core P
(``--mode disagg``), as the router tracks it::

    router --request(role=decode)--> D --kv_destination--> router
    router --request(role=prefill, dest)--> P --first token, "prefilled"--> router
    D --tokens from the second on--> router

``Pairing`` runs that for every paired sequence of the client: it sends
each to its cores, rewrites their outputs into the one stream below, and
moves the prefill to another core when P dies or refuses it.

The client sees one stream: P's first token (made an ordinary token), then
D's. D's outputs that overtake P's first token are held until it arrives.
Every output of the stream reports P's cached prompt tokens (its device
prefix hit plus what it loaded from a KV store tier), as a colocated core
reports its own: P computed the prompt, so what P did not compute is what
the client's ``cached_tokens`` counts. D's own count (its device hit, which
saves only transfer) stands only where D recomputed the prompt.

When the transfer fails, D recomputes the prompt itself. If P's Done
reached D (only the KV was bad), D kept P's first token and continues from
the second: P reports that token too, and it is awaited as usual. If not
(D's lease ended, or P gave up), D samples nothing and asks
(``kv_first_token_wanted``), because P may have reported its token after
D's lease ended; this router alone knows whether it streamed one, and
answers (``EngineCoreFirstToken``) with P's token, which D continues
after, or with none: D samples the first token itself, and P's, should it
still come, is dropped. So the client never gets two first tokens, nor a
continuation of a first token it did not get.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from msgspec.structs import replace as _replace

from kvferry.messages import (
    EngineCoreAbort, EngineCoreFirstToken, EngineCoreOutput, EngineCoreRequest, KVDestination, KVTransferParams,
)
from kvferry.router.errors import EngineDeadError, KVTransferFailedError
from kvferry.router.routing import Router
from kvferry.router.worker import Worker

logger = logging.getLogger(__name__)

# Prefill attempts per sequence (the first, then retries on other prefill
# cores when one dies or refuses); past them D's lease decides.
MAX_PREFILL_ATTEMPTS = 3


@dataclass(eq=False)
class PairedSequence:
    request: EngineCoreRequest  # as the front end built it (no kv_transfer)
    decode: Worker  # decoding it
    prefill: Worker | None = None  # prefilling it now
    dest: KVDestination | None = None
    first_token: list[int] | None = None  # P's, once streamed to the client
    recomputing: bool = False  # D computes the prompt (and first token) itself: P's is dropped
    decode_has_first: bool = False  # D kept P's first token from its Done (the KV failed): P's report is awaited
    held: list[EngineCoreOutput] = field(default_factory=list)
    attempts: int = 0
    prefill_cached: int | None = None  # P's cached prompt tokens, once its first token came
    decode_recomputed: bool = False  # the transfer failed: D computed the prompt itself

    def as_streamed(self, out: EngineCoreOutput) -> EngineCoreOutput:
        """D's output with the cached prompt tokens of the core that
        computed the prompt: P's, unless D recomputed it."""
        if self.prefill_cached is None or self.decode_recomputed or out.num_cached_tokens == self.prefill_cached:
            return out
        return _replace(out, num_cached_tokens=self.prefill_cached)


def first_token_finish(request: EngineCoreRequest, token: int, max_model_len: int) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) if the first output token already ends
    the sequence, by the scheduler's own rule (engine/core scheduler
    ``_check_stop`` with one output token); None otherwise. P reports its
    token as "prefilled" either way; the router ends the stream here rather
    than wait for D to say so."""
    params = request.sampling_params
    if 1 >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return "stop", None
        if token in (params.stop_token_ids or ()):
            return "stop", token
    if params.max_tokens is not None and params.max_tokens <= 1:
        return "length", None
    if max_model_len and len(request.prompt_token_ids) + 1 >= max_model_len:
        return "length", None
    return None


class Pairing:
    """The paired sequences, by child request id, from the decode request
    until the stream no longer needs either core's word. ``router`` picks
    each prefill core; ``fail(child, error)`` ends the client's whole
    request of a sequence that cannot go on (its stream gets ``error``)."""

    def __init__(self, router: Router, fail: Callable[[str, BaseException], None], max_model_len: int) -> None:
        self.router = router
        self.fail = fail
        self.max_model_len = max_model_len
        self._seqs: dict[str, PairedSequence] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def get(self, child: str) -> PairedSequence | None:
        return self._seqs.get(child)

    def start(self, request: EngineCoreRequest, decode: Worker) -> None:
        """Send a sequence to its decode core, which answers with where its
        KV goes; the prefill core is chosen then."""
        self._seqs[request.request_id] = PairedSequence(request, decode)
        decode.connection.send(_replace(request, kv_transfer=KVTransferParams(role="decode")))

    def drop(self, child: str) -> None:
        """Forget a sequence the client ended; its prefill (if any) is aborted."""
        seq = self._seqs.pop(child, None)
        if seq is not None:
            self._release_prefill(seq, child, abort=True)

    def prefill_lost(self, worker: Worker, error: BaseException) -> None:
        """``worker`` died: its sequences that have no first token yet are
        prefilled again elsewhere (the decode core still waits)."""
        retry = [(child, seq) for child, seq in self._seqs.items() if seq.prefill is worker]
        for child, seq in retry:
            seq.prefill = None
            if any(o.finished for o in seq.held) or (seq.decode_has_first and seq.first_token is None):
                # D finished from this core's KV, or continues from this
                # core's first token (its Done came), but that token died
                # with the core: another core's could differ.
                self._seqs.pop(child, None)
                self.fail(child, error)
            elif seq.first_token is None and not seq.recomputing:
                self._retry_prefill(seq, child, str(error))

    def outputs(self, worker: Worker, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """The outputs of paired sequences as the client must see them."""
        result: list[EngineCoreOutput] = []
        for out in outputs:
            seq = self._seqs.get(out.request_id)
            if seq is None:
                if out.kv_first_token_wanted:
                    # The stream ended already (P's first token ended it, or
                    # the client left): nothing for D to continue.
                    _send(worker, EngineCoreAbort(request_ids=[out.request_id]))
                result.append(out)
            elif worker is seq.decode:
                result.extend(self._from_decode(seq, out))
            elif worker is seq.prefill:
                result.extend(self._from_prefill(seq, out))
            # else: a prefill core this sequence has moved away from
        return result

    def _from_decode(self, seq: PairedSequence, out: EngineCoreOutput) -> list[EngineCoreOutput]:
        child = out.request_id
        if out.kv_destination is not None:
            seq.dest = out.kv_destination
            self._send_prefill(seq, child)
            out = _replace(out, kv_destination=None)
        if out.kv_transfer_error:
            logger.warning("request %s: %s", child, out.kv_transfer_error)
            seq.decode_recomputed = True
            if out.finished:  # --kv-transfer-failure fail
                self._release_prefill(seq, child, abort=True)
                self._seqs.pop(child, None)
                self.fail(child, KVTransferFailedError(out.kv_transfer_error))
                return []
            if out.kv_first_token_wanted:
                # D's lease ended without P's Done; P's token may have come
                # here all the same. D waits for this word before sampling.
                self._release_prefill(seq, child, abort=True)
                if seq.first_token is None:
                    seq.recomputing = True  # D's own first token comes next; P's is dropped
                _send(seq.decode, EngineCoreFirstToken(request_id=child, token_ids=seq.first_token or []))
            else:
                # D kept P's first token (P's Done came, only the KV was bad):
                # its outputs start at the second, and P's report of the
                # first, sent with that Done, is awaited from P as usual.
                seq.decode_has_first = True
        waiting_first = seq.first_token is None and not seq.recomputing
        if waiting_first and (out.new_token_ids or out.finish_reason in ("stop", "length")):
            # Overtook the prefill core's first token (which D already has:
            # it may even have ended the sequence): after it, in order.
            seq.held.append(out)
            return []
        if out.finished:
            self._seqs.pop(child, None)
            self._release_prefill(seq, child, abort=True)
        elif not out.new_token_ids:
            return []
        if seq.held:
            held, seq.held = seq.held, []
            return [seq.as_streamed(o) for o in (*held, out)]
        return [seq.as_streamed(out)]

    def _from_prefill(self, seq: PairedSequence, out: EngineCoreOutput) -> list[EngineCoreOutput]:
        child = out.request_id
        if out.finish_reason != "prefilled":
            if out.finished:  # P could not take it (refused, aborted): another one may
                self._release_prefill(seq, child, abort=False)
                self._retry_prefill(seq, child, f"the prefill core ended it ({out.finish_reason})")
            return []
        self._release_prefill(seq, child, abort=False)
        if seq.recomputing or seq.first_token is not None:
            return []
        seq.first_token = list(out.new_token_ids)
        seq.prefill_cached = out.num_cached_tokens
        finish = (first_token_finish(seq.request, out.new_token_ids[0], self.max_model_len)
                  if out.new_token_ids else None)
        first = _replace(out, finish_reason=finish[0] if finish else None, stop_reason=finish[1] if finish else None)
        if finish is not None:  # D ends it too; its word is no longer needed
            self._seqs.pop(child, None)
            return [first]
        held, seq.held = seq.held, []
        if any(o.finished for o in held):
            self._seqs.pop(child, None)
        return [first, *(seq.as_streamed(o) for o in held)]

    def _send_prefill(self, seq: PairedSequence, child: str) -> None:
        seq.attempts += 1
        try:
            worker, new_tokens = self.router.choose(seq.request, "prefill")
        except EngineDeadError as exc:
            # No prefill core: the decode core's lease ends it (recompute or fail).
            logger.error("request %s: %s; the decode core's lease decides", child, exc)
            return
        seq.prefill = worker
        worker.queued_prefill[child] = new_tokens
        worker.num_routed += 1
        worker.connection.send(_replace(seq.request, kv_transfer=KVTransferParams(role="prefill", dest=seq.dest)))

    def _retry_prefill(self, seq: PairedSequence, child: str, reason: str) -> None:
        if seq.dest is None:
            return  # not sent to a prefill core yet: it goes when D reports
        if seq.attempts >= MAX_PREFILL_ATTEMPTS or time.monotonic() >= seq.dest.deadline:
            logger.error("request %s: %s; no retry left, the decode core's lease decides", child, reason)
            return
        logger.warning("request %s: %s; prefilling it on another core", child, reason)
        self._send_prefill(seq, child)

    def _release_prefill(self, seq: PairedSequence, child: str, abort: bool) -> None:
        worker, seq.prefill = seq.prefill, None
        if worker is None:
            return
        worker.queued_prefill.pop(child, None)
        if abort and worker.alive:
            _send(worker, EngineCoreAbort(request_ids=[child]))


def _send(worker: Worker, message: EngineCoreAbort | EngineCoreFirstToken) -> None:
    with contextlib.suppress(zmq.ZMQError):
        worker.connection.send(message)
