"""The offline API: ``LLM(...).generate(prompts, params)`` and ``.chat(...)``."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvferry.config import EngineArgs
from kvferry.engine.cpu_threads import pinning_requested, step_executor
from kvferry.engine.engine import LLMEngine
from kvferry.outputs import CompletionOutput, RequestOutput
from kvferry.sampling import SamplingParams

Message = dict[str, str]


class LLM:
    """``LLM(model=..., dtype=..., max_num_seqs=...)``: every keyword is an
    EngineArgs field (see ``kvferry serve --help`` for the same options)."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        args = EngineArgs(model=model, **engine_args)
        if pinning_requested():
            # Built on the stepping thread that will run its steps: a second
            # thread running torch ops would give the process a second
            # OpenMP team, and libgomp then sleeps its workers at every
            # parallel region (see engine/core_proc.py).
            self.engine = step_executor().submit(LLMEngine.from_engine_args, args).result()
        else:
            self.engine = LLMEngine.from_engine_args(args)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; results come back in prompt order.

        Every prompt is validated before any is queued, so a bad one raises
        ValueError and leaves the engine as it was.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, {rid: p.n for rid, p in zip(ids, params)})

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one or many conversations.
        Special-token text typed in a message (``<|im_start|>``) stays text
        unless ``special_tokens_in_content`` (as the server's flag)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode_chat(conv, add_generation_prompt=add_generation_prompt,
                                       special_tokens_in_content=special_tokens_in_content)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    @staticmethod
    def _params_per_prompt(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
        return params

    def _run(self, ids: list[str], n_of: dict[str, int]) -> list[RequestOutput]:
        finals: dict[str, dict[int, RequestOutput]] = {rid: {} for rid in ids}
        pending = set(ids)
        # With KVFERRY_CPU_BIND, steps run on the process's stepping thread
        # (cpu_threads.py), whose OpenMP team is its own and pinned; otherwise
        # on the caller's thread (no hand-off per step).
        steps = step_executor() if pinning_requested() else None
        step = (lambda: steps.submit(self.engine.step).result()) if steps is not None else self.engine.step
        while pending:
            for out in step():
                if out.finished and out.request_id in finals:
                    finals[out.request_id][out.outputs[0].index] = out
                    if len(finals[out.request_id]) == n_of[out.request_id]:
                        pending.discard(out.request_id)
            if pending and not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine idle with unfinished requests {sorted(pending)}")
        # Finish the KV write-down of this batch, so that the node's store
        # holds its blocks once generate returns (another process may resume).
        while self.engine.has_unfinished_requests() and not self.engine.get_num_unfinished_requests():
            step()
        return [_merge(finals[rid]) for rid in ids]


def _merge(by_index: dict[int, RequestOutput]) -> RequestOutput:
    first = by_index[0]
    outputs: list[CompletionOutput] = [by_index[i].outputs[0] for i in sorted(by_index)]
    return RequestOutput(
        request_id=first.request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=outputs,
        finished=True,
        num_cached_tokens=first.num_cached_tokens,
        metrics=first.metrics,
        prompt_logprobs=first.prompt_logprobs,
        embedding=first.embedding,
    )
