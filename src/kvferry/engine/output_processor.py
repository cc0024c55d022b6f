"""Front end: turns the core's per-step token deltas into text and
user-facing RequestOutputs.

Detokenization is incremental per sequence. Stop strings are matched on the
text; while a sequence runs, the last ``max(len(stop)) - 1`` characters are
held back from streaming so that a stop string split across tokens is never
shown to the client and then taken back. A matched stop string finishes the
sequence here; the caller then aborts it in the core.

Cost per step is O(new tokens): a snapshot's ``outputs[i].token_ids`` and
``logprobs`` are the sequence's own lists, grown in place (a live view while
the sequence runs, final once it finished), never copies. Streaming
consumers read the deltas ``new_token_ids`` / ``new_text`` / ``new_logprobs``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvferry.types.logprobs import TokenLogprobs
from kvferry.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from kvferry.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvferry.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvferry.sampling import SamplingParams


@dataclass(slots=True)
class SequenceState:
    """Front-end view of one generated sequence (one of a request's n)."""

    parent_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    text: str = ""
    num_emitted_chars: int = 0
    stop_holdback: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None


@dataclass(slots=True)
class ParentState:
    """A user request; n > 1 fans out into n sequences sharing a prompt."""

    child_ids: list[str]
    num_unfinished: int


@dataclass(slots=True)
class ProcessedStep:
    outputs: list[RequestOutput] = field(default_factory=list)
    # Sequences a stop string ended: the caller must abort them in the core.
    stopped_by_string: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.seqs: dict[str, SequenceState] = {}
        self.parents: dict[str, ParentState] = {}

    # -- request lifecycle -----------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, requests: list[EngineCoreRequest]) -> None:
        """Track a user request and its sequences (the core requests of one fan-out)."""
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        for index, req in enumerate(requests):
            params = req.sampling_params
            self.seqs[req.request_id] = SequenceState(
                request_id, index, prompt, req.prompt_token_ids, params,
                IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens),
                arrival_time=req.arrival_time,
                logprobs=[] if params.logprobs is not None else None,
                stop_holdback=max((len(s) for s in params.stop), default=1) - 1,
            )
        self.parents[request_id] = ParentState([r.request_id for r in requests], len(requests))

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget these user requests; returns their sequence ids still
        running in the core (to abort there)."""
        child_ids = []
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            if parent is None:
                continue
            for child_id in parent.child_ids:
                if self.seqs.pop(child_id, None) is not None:
                    child_ids.append(child_id)
        return child_ids

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.parents)

    # -- one step's outputs --------------------------------------------------------
    def process(self, core_outputs: EngineCoreOutputs) -> ProcessedStep:
        step = ProcessedStep()
        for out in core_outputs.outputs:
            seq = self.seqs.get(out.request_id)
            if seq is None:  # aborted after the step was planned
                continue
            seq.token_ids += out.new_token_ids
            if out.new_logprobs and seq.logprobs is not None:
                seq.logprobs += out.new_logprobs
            if out.prompt_logprobs is not None:
                seq.prompt_logprobs = out.prompt_logprobs
            if out.pooled is not None:
                seq.embedding = out.pooled
            if out.first_scheduled_time is not None:
                seq.first_scheduled_time = out.first_scheduled_time
            if seq.first_token_time is None and out.new_token_ids:
                seq.first_token_time = core_outputs.timestamp or time.monotonic()
            seq.num_cached_tokens = out.num_cached_tokens
            if self._append_text(seq, out):
                step.stopped_by_string.append(out.request_id)
            request_output = self._snapshot(seq, out)
            step.outputs.append(request_output)
            if request_output.finished:
                self._finish_sequence(out.request_id, seq)
        return step

    def _append_text(self, seq: SequenceState, out: EngineCoreOutput) -> bool:
        """Detokenize new tokens; returns True if a stop string ended the text."""
        params = seq.params
        # A stop token (or EOS) is not part of the text.
        visible = out.new_token_ids[:-1] if out.finish_reason == "stop" else out.new_token_ids
        if visible:
            seq.text += seq.detok.step(visible)
        if out.finished:
            seq.text += seq.detok.flush()  # a held-back partial UTF-8 tail
        if not params.stop or out.finished and out.finish_reason != "length":
            return False
        # Only the tail can contain a new match: search from just before it.
        search_from = max(0, seq.num_emitted_chars - seq.stop_holdback - 1)
        for stop in params.stop:
            pos = seq.text.find(stop, search_from)
            if pos >= 0:
                seq.text = seq.text[: pos + len(stop)] if params.include_stop_str_in_output else seq.text[:pos]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        return False

    def _snapshot(self, seq: SequenceState, out: EngineCoreOutput) -> RequestOutput:
        if seq.finish_reason is None and out.finished:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        finished = seq.finish_reason is not None
        emit_upto = len(seq.text) if finished else max(seq.num_emitted_chars, len(seq.text) - seq.stop_holdback)
        new_text = seq.text[seq.num_emitted_chars : emit_upto]
        seq.num_emitted_chars = emit_upto
        completion = CompletionOutput(
            index=seq.index,
            text=seq.text,
            token_ids=seq.token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=seq.logprobs,
        )
        return RequestOutput(
            request_id=seq.parent_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=seq.num_cached_tokens,
            new_token_ids=out.new_token_ids,
            new_text=new_text,
            new_logprobs=out.new_logprobs or [],
            prompt_logprobs=seq.prompt_logprobs,
            embedding=seq.embedding,
            metrics=RequestMetrics(
                arrival_time=seq.arrival_time,
                first_scheduled_time=seq.first_scheduled_time,
                first_token_time=seq.first_token_time,
                finished_time=time.monotonic() if finished else None,
                num_prompt_tokens=len(seq.prompt_token_ids),
                num_generation_tokens=len(seq.token_ids),
            ),
        )

    def _finish_sequence(self, child_id: str, seq: SequenceState) -> None:
        del self.seqs[child_id]
        parent = self.parents.get(seq.parent_id)
        if parent is None:
            return
        parent.num_unfinished -= 1
        if parent.num_unfinished == 0:
            del self.parents[seq.parent_id]
