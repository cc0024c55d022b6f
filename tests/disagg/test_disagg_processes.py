"""Two real engine-core processes ("kvferry: prefill-0", "kvferry: decode-0")
over their real sockets: the disaggregated flow gives the colocated tokens;
a prefill core killed with SIGKILL while it streams leaves the decode core
to recompute after its lease (once the router's word says no first token
was streamed), with its pool back to idle."""
from __future__ import annotations

import os
import signal
import time

import pytest

from kvferry import LLM, SamplingParams
from kvferry.config import EngineArgs
from kvferry.engine.core_client import CoreConnection, CoreProcess
from kvferry.messages import (
    CoreOutput, EngineCoreFirstToken, EngineCoreOutputs, EngineCoreReady, EngineCoreShutdown, KVTransferParams, decode,
)
from tests.disagg.driver import request
from tests.disagg.test_disagg_engine import prompt_of
from tests.tiny_models import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("disagg-proc"), arch="qwen2", num_hidden_layers=2,
                                    max_position_embeddings=2048))


class Core:
    def __init__(self, path: str, name: str, **kwargs) -> None:
        args = dict(model=path, dtype="float32", num_kv_blocks=160, block_size=16,
                    kv_transfer_address="tcp://127.0.0.1:0")
        args.update(kwargs)
        self.process = CoreProcess.start(EngineArgs(**args).create_engine_config(), name=name)
        self.conn = CoreConnection(self.process.addresses)
        self.conn.wait_ready(timeout_s=120, process=self.process)
        self.last_stats = None

    def outputs(self, until, timeout_s: float = 30.0):
        """Every request output until ``until(outputs so far)``."""
        seen = []
        deadline = time.monotonic() + timeout_s
        while not until(seen):
            assert time.monotonic() < deadline, "the core never got there"
            if self.conn.output.poll(100):
                message = decode(self.conn.output.recv(), CoreOutput)
                if isinstance(message, EngineCoreReady):
                    continue  # the answer to wait_ready's hello, after the first handshake
                assert isinstance(message, EngineCoreOutputs) and not message.engine_error
                seen.extend(message.outputs)
                self.last_stats = message.stats or self.last_stats
        return seen

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(EngineCoreShutdown())
        self.process.stop(10)
        self.conn.close()


@pytest.fixture
def pair(checkpoint):
    made = []

    def make(name: str, **kwargs) -> Core:
        core = Core(checkpoint, name, **kwargs)
        made.append(core)
        return core

    yield make
    for core in made:
        core.stop()


def test_disagg_across_processes_then_prefill_killed(pair, checkpoint):
    prefill = pair("prefill-0", max_num_batched_tokens=16)  # a long prompt streams over many steps
    decode_core = pair("decode-0", kv_transfer_timeout_s=2.0)
    reference = LLM(model=checkpoint, dtype="float32")

    # 1. The whole flow across processes.
    prompt = prompt_of(100, seed=21)
    decode_core.conn.send(request("a", prompt, GREEDY, KVTransferParams(role="decode")))
    dest = next(o.kv_destination for o in decode_core.outputs(lambda s: any(o.kv_destination for o in s)))
    assert dest.shm_name  # a CPU decode core's pool is in shared memory
    prefill.conn.send(request("a", prompt, GREEDY, KVTransferParams(role="prefill", dest=dest)))
    first = [o for o in prefill.outputs(lambda s: any(o.finished for o in s)) if o.finished][0]
    assert first.finish_reason == "prefilled" and len(first.new_token_ids) == 1
    rest = decode_core.outputs(lambda s: any(o.finished for o in s))
    tokens = first.new_token_ids + [t for o in rest for t in o.new_token_ids]
    assert tokens == list(reference.generate([prompt], GREEDY)[0].outputs[0].token_ids)

    # 2. The prefill core dies with SIGKILL while it streams a long prompt.
    long_prompt = prompt_of(1500, seed=22)
    decode_core.conn.send(request("b", long_prompt, GREEDY, KVTransferParams(role="decode")))
    dest = next(o.kv_destination for o in decode_core.outputs(lambda s: any(o.kv_destination for o in s)))
    prefill.last_stats = None
    prefill.conn.send(request("b", long_prompt, GREEDY, KVTransferParams(role="prefill", dest=dest)))
    # Its first steps have run (each step reports stats): ~90 more to go.
    prefill.outputs(lambda s: prefill.last_stats is not None and prefill.last_stats.num_running == 1)
    os.kill(prefill.process.pid, signal.SIGKILL)
    outs = decode_core.outputs(lambda s: any(o.kv_transfer_error for o in s), timeout_s=60)
    [report] = [o for o in outs if o.kv_transfer_error]
    assert "timeout" in report.kv_transfer_error and report.kv_first_token_wanted
    # The router's word: no first token of P's was streamed (P died first).
    decode_core.conn.send(EngineCoreFirstToken(request_id="b", token_ids=[]))
    outs += decode_core.outputs(lambda s: any(o.finished for o in s), timeout_s=60)
    tokens = [t for o in outs for t in o.new_token_ids]  # recomputed here, the first token included
    assert tokens == list(reference.generate([long_prompt], GREEDY)[0].outputs[0].token_ids)
    assert outs[-1].finish_reason == "length"
    # No block held for the dead transfer: the pool holds only evictable cache.
    assert decode_core.last_stats.kv_blocks_used == 0
    assert decode_core.last_stats.num_running == decode_core.last_stats.num_waiting == 0
