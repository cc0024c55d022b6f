"""Several engine requests read as one stream of choices.

A completions request with several prompts runs one engine request per
prompt (each of n sequences). ``ChoiceStreams`` reads them as one
``RequestStream``-like iterator (``async for``, ``pending()``, ``close()``),
so that the shared collect / SSE code (serving.collect, stream_events,
EventStreamResponse) serves it unchanged. Each output's sequence index is
renumbered to its choice index, ``prompt_index * n + i``, as vLLM numbers
them.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace

from kvferry.core.outputs import TokenLogprobs
from kvferry.outputs import RequestOutput
from kvferry.serve.request_stream import END, OutputQueue, RequestStream


class ChoiceStreams(OutputQueue):
    """The outputs of ``streams`` (one per prompt, in prompt order), in the
    order they arrive. An engine error on any of them ends the whole stream
    with that error (the others are aborted by ``close()``). Create it on
    the event loop; always ``close()`` it (idempotent: aborts whatever still
    runs)."""

    def __init__(self, streams: list[RequestStream], n: int) -> None:
        self.streams = streams
        self.n = n
        # Each choice's prompt logprobs, once its prompt is computed: the
        # streamed echo needs them, and the merged deltas do not carry them.
        self.prompt_logprobs: dict[int, list[TokenLogprobs | None]] = {}
        OutputQueue.__init__(self)
        self._num_open = len(streams)
        self._closed = False
        self._tasks = [asyncio.ensure_future(self._pump(k, s)) for k, s in enumerate(streams)]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            stream.close()

    async def _pump(self, prompt_index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._push(self._renumber(prompt_index, out))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # EngineDeadError and kin: the caller maps them
            self._push(exc)
            return
        self._num_open -= 1
        if self._num_open == 0:
            self._push(END)

    def _renumber(self, prompt_index: int, out: RequestOutput) -> RequestOutput:
        seq = out.outputs[0]
        choice = prompt_index * self.n + seq.index
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[choice] = out.prompt_logprobs
        if choice == seq.index:
            return out
        return replace(out, outputs=[replace(seq, index=choice)])
