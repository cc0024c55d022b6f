"""A tiny stand-in for LLMEngine (same surface the server uses), for fast
tests of the HTTP layer and the engine loop without a model.

Tokens are characters (id = code point). A request "generates" the cycled
text ``reply`` one character per step, honours max_tokens, n, stop strings
(crudely) and logprobs, and holds ceil(tokens / block_size) fake KV blocks
while it runs. ``step_delay_s`` simulates slow steps; ``crash_on_step``
raises inside step() to test a dying engine loop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvferry.core.outputs import TokenLogprobs
from kvferry.core.scheduler import SchedulerStats
from kvferry.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvferry.sampling import SamplingParams


class CharTokenizer:
    eos_token_ids = [0]
    vocab_size = 0x110000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Seq:
    parent: str
    index: int
    prompt: list[int]
    params: SamplingParams
    arrival: float
    out: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    first_scheduled: float | None = None


class FakeEngine:
    def __init__(self, reply: str = "hello world ", max_model_len: int = 1_000_000, block_size: int = 16,
                 num_blocks: int = 1000, step_delay_s: float = 0.0) -> None:
        self.tokenizer = CharTokenizer()
        self.max_model_len = max_model_len
        self.reply = reply
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.step_delay_s = step_delay_s
        self.crash_on_step = False
        self.broken_integrity = False
        self.num_integrity_checks = 0
        self.seqs: dict[str, _Seq] = {}
        self.num_steps = 0
        self.added: list[str] = []
        self.added_at_step: dict[str, int] = {}  # request id -> steps run before it was added
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params, cache_namespace=""):
        if any(s.parent == request_id for s in self.seqs.values()):
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if ids[0] == ord("!"):  # a prompt the "engine" rejects, to test propagation
            raise ValueError("prompt starts with '!', which this fake engine rejects")
        for i in range(params.n):
            self.seqs[f"{request_id}#{i}"] = _Seq(request_id, i, ids, params, time.monotonic())
        self.added.append(request_id)
        self.added_at_step[request_id] = self.num_steps

    def abort_request(self, request_ids):
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for rid in ids:
            for key in [k for k, s in self.seqs.items() if s.parent == rid]:
                del self.seqs[key]
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.seqs)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.crash_on_step:
            raise RuntimeError("fake engine crashed")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outputs = []
        for key, s in list(self.seqs.items()):
            if s.first_scheduled is None:
                s.first_scheduled = time.monotonic()
            token = ord(self.reply[len(s.out) % len(self.reply)])
            s.out.append(token)
            new_lp = []
            if s.params.logprobs is not None:
                lp = TokenLogprobs(token, -0.5, 1, [token, ord("?")][: s.params.logprobs], [-0.5, -2.0][: s.params.logprobs])
                s.logprobs.append(lp)
                new_lp = [lp]
            text = self.tokenizer.decode(s.out)
            finish, stop_reason = None, None
            for stop in s.params.stop:
                if stop in text:
                    text, finish, stop_reason = text[: text.index(stop)], "stop", stop
            if finish is None and len(s.out) >= s.params.max_tokens:
                finish = "length"
            new_text = text[len(self.tokenizer.decode(s.out[:-1])):] if finish != "stop" else ""
            if finish is not None:
                del self.seqs[key]
            outputs.append(RequestOutput(
                request_id=s.parent, prompt=None, prompt_token_ids=s.prompt,
                outputs=[CompletionOutput(s.index, text, list(s.out), finish, stop_reason,
                                          list(s.logprobs) if s.params.logprobs is not None else None)],
                finished=finish is not None, num_cached_tokens=0, new_token_ids=[token], new_text=new_text,
                new_logprobs=new_lp,
                metrics=RequestMetrics(s.arrival, s.first_scheduled, None, None, len(s.prompt), len(s.out)),
            ))
        return outputs

    def stats(self) -> SchedulerStats:
        used = sum(-(-(len(s.prompt) + len(s.out)) // self.block_size) for s in self.seqs.values())
        return SchedulerStats(num_running=len(self.seqs), kv_blocks_used=used, kv_blocks_total=self.num_blocks)

    def check_integrity(self) -> None:
        self.num_integrity_checks += 1
        if self.broken_integrity:
            raise AssertionError("fake KV bookkeeping is broken")
