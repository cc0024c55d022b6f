"""A small router stand-in for engine-side disaggregation tests: it drives a
prefill core and a decode core (in-process ``EngineCore``s, each with its
real transfer socket and agent) through the flow of ``kvferry.messages``."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from kvferry.config import EngineArgs
from kvferry.core.kv_connector.disagg import first_token_word
from kvferry.engine.core import EngineCore
from kvferry.messages import EngineCoreOutput, EngineCoreRequest, KVDestination, KVTransferParams
from kvferry.sampling import SamplingParams


def make_core(path: str, loaded=None, **kwargs) -> EngineCore:
    defaults = dict(model=path, dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=512,
                    kv_transfer_address="tcp://127.0.0.1:0")
    defaults.update(kwargs)
    return EngineCore(EngineArgs(**defaults).create_engine_config(), loaded)


def request(rid: str, prompt: list[int], params: SamplingParams, kv_transfer=None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params, eos_token_ids=[2],
                             arrival_time=time.monotonic(), kv_transfer=kv_transfer)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    destination: KVDestination | None = None
    prefill_output: EngineCoreOutput | None = None
    transfer_errors: list[str] = field(default_factory=list)


def step_until(core: EngineCore, done, timeout_s: float = 30.0) -> list[EngineCoreOutput]:
    """Step ``core`` until ``done(outputs so far)``; every output, in order."""
    seen: list[EngineCoreOutput] = []
    deadline = time.monotonic() + timeout_s
    while not done(seen):
        assert time.monotonic() < deadline, "the core never got there"
        seen.extend(core.step().outputs)
    return seen


def decode_side(decode: EngineCore, rid: str, prompt: list[int], params: SamplingParams) -> KVDestination:
    decode.add_request(request(rid, prompt, params, KVTransferParams(role="decode")))
    outs = step_until(decode, lambda seen: any(o.kv_destination for o in seen))
    return next(o.kv_destination for o in outs if o.kv_destination)


def prefill_side(prefill: EngineCore, rid: str, prompt: list[int], params: SamplingParams,
                 dest: KVDestination) -> EngineCoreOutput:
    prefill.add_request(request(rid, prompt, params, KVTransferParams(role="prefill", dest=dest)))
    outs = step_until(prefill, lambda seen: any(o.finished for o in seen))
    return next(o for o in outs if o.finished)


def finish_decode(decode: EngineCore, rid: str, result: Result, timeout_s: float = 30.0) -> Result:
    """Step ``decode`` until ``rid`` finishes; ``result.tokens`` holds what
    was streamed so far (the prefill core's first token, if it came). A
    decode core that asks for the word on its first token gets it as the
    router gives it: that token, or none."""
    deadline = time.monotonic() + timeout_s
    while result.finish_reason is None:
        assert time.monotonic() < deadline, "the core never got there"
        for o in decode.step().outputs:
            if o.request_id != rid:
                continue
            result.tokens += o.new_token_ids
            result.finish_reason = o.finish_reason or result.finish_reason
            if o.kv_transfer_error:
                result.transfer_errors.append(o.kv_transfer_error)
            if o.kv_first_token_wanted:
                first_token_word(decode.scheduler.connector, rid, result.tokens[:1])
    return result


def run_disagg(prefill: EngineCore, decode: EngineCore, rid: str, prompt: list[int],
               params: SamplingParams) -> Result:
    """The whole flow for one request: its tokens as the router streams them
    (the prefill core's first token, then the decode core's)."""
    result = Result()
    result.destination = decode_side(decode, rid, prompt, params)
    first = prefill_side(prefill, rid, prompt, params, result.destination)
    assert first.finish_reason == "prefilled", first
    result.prefill_output = first
    result.tokens = list(first.new_token_ids)
    return finish_decode(decode, rid, result)


def drain(core: EngineCore, timeout_s: float = 10.0) -> None:
    """Step until nothing is left (delayed frees included)."""
    deadline = time.monotonic() + timeout_s
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the core never went idle"
        core.step()


def assert_idle(core: EngineCore) -> None:
    """Every block back: none held by a request, a delayed free or a pin."""
    kv = core.scheduler.kv
    assert not kv.req_blocks and not kv.delayed_free and not kv.pinned
    assert kv.pool.num_used_blocks == 0, kv.pool.num_used_blocks
    core.check_integrity()


def settle(*cores: EngineCore, timeout_s: float = 10.0) -> None:
    """How a P/D test ends: drain each core in the order given (a core's
    last steps can send what another is waiting for, such as an ack), then
    check that each holds no block."""
    for core in cores:
        drain(core, timeout_s=timeout_s)
    for core in cores:
        assert_idle(core)


@contextmanager
def closing_cores(*cores: EngineCore) -> Iterator[tuple[EngineCore, ...]]:
    """Close every core on the way out, in the order given; one close that
    raises still lets the others run (their sockets and threads go too)."""
    try:
        yield cores
    finally:
        with ExitStack() as stack:
            for core in reversed(cores):  # the stack unwinds last-in first
                stack.callback(core.close)
