"""One request as prefill on core P and decode on core D (two in-process
engine cores, each with its real transfer socket, agent and threads; the
test plays the router): outputs equal colocated ``LLM.generate``, only the
blocks D lacks travel, and every failure ends in recompute or a clear error
with both pools back to idle."""
from __future__ import annotations

import random
import threading
import time

import pytest
import zmq

from kvferry import LLM, SamplingParams
from kvferry.engine.kv_connector import PDTransferWorker
from kvferry.messages import KVDestination, KVLayerChunk, KVWire, decode
from tests.disagg.driver import (
    Result, assert_idle, decode_side, drain, finish_decode, make_core, prefill_side, request, run_disagg, settle,
    step_until,
)
from tests.tiny_models import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("disagg"), arch="llama", num_hidden_layers=3,
                                    max_position_embeddings=1024))


@pytest.fixture(scope="module")
def colocated(checkpoint):
    return LLM(model=checkpoint, dtype="float32")


@pytest.fixture(scope="module")
def loaded(checkpoint):
    core = make_core(checkpoint, kv_transfer_address="")
    return core.loaded


@pytest.fixture
def cores(checkpoint, loaded):
    """Factory of cores sharing one loaded model; all closed at the end."""
    made = []

    def make(**kwargs):
        core = make_core(checkpoint, loaded, **kwargs)
        made.append(core)
        return core

    yield make
    for core in made:
        core.close()


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def reference(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return list(llm.generate([prompt], params)[0].outputs[0].token_ids)


@pytest.mark.parametrize(("transport", "prefill_budget"), [("shm", 512), ("tcp", 40)],
                         ids=["shm-whole-prompt", "tcp-chunked-prompt"])
def test_greedy_equals_colocated(cores, colocated, transport, prefill_budget):
    prefill = cores(kv_transport=transport, max_num_batched_tokens=prefill_budget)
    decode = cores()
    for i, n in enumerate((1, 17, 150)):
        prompt = prompt_of(n, seed=i)
        result = run_disagg(prefill, decode, f"r{i}", prompt, GREEDY)
        assert result.tokens == reference(colocated, prompt, GREEDY), n
        assert result.finish_reason == "length" and not result.transfer_errors
    link_kinds = {type(link).__name__ for link in prefill.runner.connector.find(PDTransferWorker).agent._links.values()}
    assert link_kinds == {"ShmTransport" if transport == "shm" else "TcpTransport"}
    settle(prefill, decode)


def test_seeded_sampling_with_penalties_equals_colocated(cores, colocated):
    """The first token, the output counts and the generator state travel:
    a seeded, penalized stream continues on D exactly as it would have."""
    prefill, decode = cores(), cores()
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, frequency_penalty=0.7,
                            repetition_penalty=1.3, ignore_eos=True)
    prompt = prompt_of(70, seed=7)
    result = run_disagg(prefill, decode, "s", prompt, params)
    assert result.tokens == reference(colocated, prompt, params)


def test_only_missing_blocks_are_sent(cores, colocated):
    prefill, decode = cores(), cores()
    shared = prompt_of(64, seed=3)  # 4 full blocks
    first = shared + prompt_of(20, seed=4)
    second = shared + prompt_of(40, seed=5)
    run_disagg(prefill, decode, "a", first, GREEDY)
    received = decode.runner.connector.find(PDTransferWorker).agent.receiver
    before = received.num_blocks_written
    result = run_disagg(prefill, decode, "b", second, GREEDY)
    dest = result.destination
    assert dest.num_cached_tokens == 64  # D's own prefix hit
    assert len(dest.block_ids) == -(-len(second) // 16) - 4 == 3
    # 3 layers x 3 blocks, nothing of the 4 blocks D had
    assert received.num_blocks_written - before == 3 * 3
    assert result.tokens == reference(colocated, second, GREEDY)


class CorruptingProxy:
    """A man in the middle on the TCP link: forwards every frame between P
    and D, flipping one byte of the first layer payload it sees."""

    def __init__(self, upstream: str) -> None:
        self.ctx = zmq.Context.instance()
        self.front = self.ctx.socket(zmq.ROUTER)
        port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.back = self.ctx.socket(zmq.DEALER)
        self.back.connect(upstream)
        self.corrupted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        identity = None
        while not self._stop.is_set():
            events = dict(poller.poll(20))
            if self.front in events:
                identity, *frames = self.front.recv_multipart()  # [token, header, payload?]
                message = decode(frames[1], KVWire)
                if isinstance(message, KVLayerChunk) and message.has_payload and not self.corrupted:
                    payload = bytearray(frames[2])
                    payload[len(payload) // 2] ^= 0xFF
                    frames[2] = bytes(payload)
                    self.corrupted += 1
                self.back.send_multipart(frames)
            if self.back in events:
                self.front.send_multipart([identity, *self.back.recv_multipart()])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.front.close(0)
        self.back.close(0)


def _via(dest: KVDestination, address: str) -> KVDestination:
    return KVDestination(transfer_id=dest.transfer_id, address=address, shm_name="", block_ids=dest.block_ids,
                         num_cached_tokens=dest.num_cached_tokens, block_size=dest.block_size,
                         lease_s=dest.lease_s, deadline=dest.deadline)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_corrupted_transfer_is_detected(cores, colocated, policy):
    prefill, decode = cores(kv_transport="tcp"), cores(kv_transfer_failure=policy)
    prompt = prompt_of(90, seed=11)
    result = Result()
    dest = decode_side(decode, "c", prompt, GREEDY)
    proxy = CorruptingProxy(dest.address)
    try:
        first = prefill_side(prefill, "c", prompt, GREEDY, _via(dest, proxy.address))
        result.tokens = list(first.new_token_ids)
        finish_decode(decode, "c", result)
        # The decode core's refusal reaches P back through the proxy: it
        # stays open until P has heard it (closed first, P could only wait
        # out its 30 s lease).
        drain(prefill)  # the decode core refused the transfer: P's blocks go on that
        drain(decode)
    finally:
        proxy.close()
    assert proxy.corrupted == 1
    assert result.transfer_errors and "checksum mismatch" in result.transfer_errors[0]
    if policy == "recompute":
        assert result.tokens == reference(colocated, prompt, GREEDY)
        assert result.finish_reason == "length"
    else:
        assert result.finish_reason == "error"
        assert result.tokens == first.new_token_ids  # nothing decoded from the bad KV
    assert_idle(prefill)
    assert_idle(decode)


def test_prefill_core_gone_mid_transfer(cores, colocated):
    """P streams the first chunk of a long prompt, then stops for good: D
    waits out its lease, recomputes the prompt itself, and holds no block
    afterwards."""
    prefill = cores(max_num_batched_tokens=32)
    decode = cores(kv_transfer_timeout_s=1.0)
    prompt = prompt_of(150, seed=13)
    dest = decode_side(decode, "k", prompt, GREEDY)
    prefill.add_request(request("k", prompt, GREEDY, kv_transfer_params(dest)))
    prefill.step()  # the first 32 tokens' KV goes out, layer by layer
    time.sleep(0.2)
    assert decode.runner.connector.find(PDTransferWorker).agent.receiver.num_blocks_written == 3 * 2
    prefill.close()  # gone: no more layers, no Done
    started = time.monotonic()
    result = finish_decode(decode, "k", Result(), timeout_s=10)
    assert time.monotonic() - started >= 0.5  # it waited for the lease
    assert result.transfer_errors and "timeout" in result.transfer_errors[0]
    # Recomputed on D, the first token included (the router never got one).
    assert result.tokens == reference(colocated, prompt, GREEDY)
    settle(decode)


def kv_transfer_params(dest: KVDestination):
    from kvferry.messages import KVTransferParams
    return KVTransferParams(role="prefill", dest=dest)


def test_prefill_frees_blocks_on_ack(cores):
    prefill, decode = cores(), cores()
    prompt = prompt_of(80, seed=17)
    dest = decode_side(decode, "f", prompt, GREEDY)
    prefill_side(prefill, "f", prompt, GREEDY, dest)
    assert "f" in prefill.scheduler.kv.delayed_free  # held until D says it has the KV
    step_until(decode, lambda seen: not decode.scheduler.loading)  # D verifies and acks
    settle(prefill, timeout_s=5)


def test_prefill_frees_blocks_when_the_lease_expires(cores):
    """No decode core ever answers: P's blocks go when the lease ends."""
    prefill = cores()
    prompt = prompt_of(40, seed=19)
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes the bytes, never acks
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        dest = KVDestination(transfer_id="t@1", address=f"tcp://127.0.0.1:{port}", block_ids=[60, 61, 62],
                             num_cached_tokens=0, block_size=16, lease_s=1.0, deadline=time.monotonic() + 1.0)
        started = time.monotonic()
        prefill_side(prefill, "l", prompt, GREEDY, dest)
        assert prefill.scheduler.kv.delayed_free
        drain(prefill, timeout_s=5)
        assert time.monotonic() - started >= 0.9
        assert_idle(prefill)
    finally:
        silent.close(0)


def test_bad_destination_is_refused(cores):
    prefill = cores()
    dest = KVDestination(transfer_id="x", address="tcp://127.0.0.1:1", block_ids=[1], num_cached_tokens=0,
                         block_size=16, lease_s=1.0, deadline=0.0)
    with pytest.raises(ValueError, match="block_ids"):
        prefill.add_request(request("x", prompt_of(40), GREEDY, kv_transfer_params(dest)))
    plain = cores(kv_transfer_address="")
    with pytest.raises(ValueError, match="kv_transfer"):
        plain.add_request(request("y", prompt_of(40), GREEDY, kv_transfer_params(dest)))
