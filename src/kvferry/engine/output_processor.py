"""Turns sampled tokens into text and user-facing outputs.

Detokenization is incremental per sequence. Stop strings are matched on the
text; while a sequence runs, the last ``max(len(stop)) - 1`` characters are
held back from streaming so that a stop string split across tokens is never
shown to the client and then taken back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvferry.core.outputs import TokenLogprobs
from kvferry.messages import EngineCoreOutput
from kvferry.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvferry.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvferry.request import FINISH_REASON, Request, RequestStatus


@dataclass(slots=True)
class SequenceState:
    """Engine-side view of one generated sequence (one of a request's n)."""

    request: Request
    parent_id: str
    index: int
    prompt: str | None
    detok: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    stop_holdback: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class ProcessedStep:
    outputs: list[RequestOutput] = field(default_factory=list)
    # Sequences a stop string ended: the scheduler must finish them.
    stopped_by_string: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.seqs: dict[str, SequenceState] = {}

    def add(self, request: Request, parent_id: str, index: int, prompt: str | None) -> None:
        params = request.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        holdback = max((len(s) for s in params.stop), default=1) - 1
        self.seqs[request.request_id] = SequenceState(
            request, parent_id, index, prompt, detok,
            logprobs=[] if params.logprobs is not None else None,
            stop_holdback=holdback,
        )

    def remove(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedStep:
        step = ProcessedStep()
        for core_out in outputs:
            seq = self.seqs.get(core_out.request_id)
            if seq is None:
                continue
            request = seq.request
            new_tokens = core_out.new_token_ids
            if core_out.new_logprobs and seq.logprobs is not None:
                seq.logprobs.extend(core_out.new_logprobs)
            if self._append_text(request, seq, new_tokens):
                step.stopped_by_string.append(request.request_id)
            step.outputs.append(self._snapshot(request, seq))
        return step

    def _append_text(self, request: Request, seq: SequenceState, new_tokens: list[int]) -> bool:
        """Detokenize new tokens; returns True if a stop string ended the text."""
        params = request.sampling_params
        # A stop token (or EOS) is not part of the text.
        visible = new_tokens
        if request.status == RequestStatus.FINISHED_STOPPED and new_tokens:
            visible = new_tokens[:-1]
        if visible:
            seq.text += seq.detok.step(visible)
        if request.is_finished:
            seq.text += seq.detok.flush()  # a held-back partial UTF-8 tail
        if not params.stop or request.is_finished and request.status != RequestStatus.FINISHED_LENGTH:
            return False
        # Only the tail can contain a new match: search from just before it.
        search_from = max(0, seq.num_emitted_chars - seq.stop_holdback - 1)
        for stop in params.stop:
            pos = seq.text.find(stop, search_from)
            if pos >= 0:
                seq.text = seq.text[: pos + len(stop)] if params.include_stop_str_in_output else seq.text[:pos]
                seq.stop_reason = stop
                return True
        return False

    def _snapshot(self, request: Request, seq: SequenceState) -> RequestOutput:
        # A stop string ends the sequence here; the scheduler learns of it after.
        finished = request.is_finished or isinstance(seq.stop_reason, str)
        if finished:
            if isinstance(seq.stop_reason, str):
                seq.finish_reason = "stop"
            else:
                seq.finish_reason = FINISH_REASON.get(request.status)
                seq.stop_reason = request.stop_reason
        emit_upto = len(seq.text) if finished else max(seq.num_emitted_chars, len(seq.text) - seq.stop_holdback)
        new_text = seq.text[seq.num_emitted_chars : emit_upto]
        seq.num_emitted_chars = emit_upto
        new_tokens = request.output_token_ids[seq.num_emitted_tokens :]
        seq.num_emitted_tokens = request.num_output_tokens
        new_logprobs = seq.logprobs[-len(new_tokens) :] if seq.logprobs and new_tokens else []
        completion = CompletionOutput(
            index=seq.index,
            text=seq.text,
            token_ids=list(request.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=seq.parent_id,
            prompt=seq.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=request.num_cached_tokens or 0,
            new_token_ids=new_tokens,
            new_text=new_text,
            new_logprobs=new_logprobs,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=request.first_token_time,
                finished_time=time.monotonic() if finished else None,
                num_prompt_tokens=request.num_prompt_tokens,
                num_generation_tokens=request.num_output_tokens,
            ),
        )
