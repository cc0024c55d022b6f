"""``--kv-transport mooncake`` against a real ``mooncake_master`` (its HTTP
metadata server) on loopback: the link on its own (a real ``KVReceiver``
over a shared-memory pool that a real Transfer Engine registered, written
by ``MooncakeTransport`` from a registered source pool in this process),
then two in-process engine cores whose greedy output equals colocated."""
from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq

from kvferry import LLM, SamplingParams
from kvferry.config import EngineArgs, KVTransferConfig
from kvferry.disagg import mooncake_transport
from kvferry.disagg.transport import KVReceiver, SharedKVPool
from kvferry.engine.kv_connector import PDTransferWorker
from kvferry.messages import KVTransferDone
from tests.disagg.driver import drain, make_core, run_disagg
from tests.disagg.test_transport import LAYOUTS, await_ack
from tests.kvstore.mooncake_master import MooncakeMaster
from tests.tiny_models import make_tiny_checkpoint

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 40, 4, 2, 8
SHAPE = (LAYERS, 2, BLOCKS, BS, HEADS, DIM)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    try:
        mooncake_transport.load_transfer_engine()
    except ValueError as exc:
        pytest.skip(str(exc))
    m = MooncakeMaster(tmp_path_factory.mktemp("mc-transfer"))
    m.start()
    yield m
    m.kill()


@pytest.fixture(scope="module")
def link(master):
    """(source pool, destination pool, receiver, the link): each side's pool
    registered with an engine of its own, as in two cores."""
    src = torch.randn(SHAPE).to(torch.bfloat16)
    pool = SharedKVPool.create(SHAPE, torch.bfloat16)
    receiver = KVReceiver(pool.tensor, "tcp://127.0.0.1:0")
    decode_engine = mooncake_transport.MooncakeEngine("127.0.0.1", master.metadata, pool.tensor)
    prefill_engine = mooncake_transport.MooncakeEngine("127.0.0.1", master.metadata, src)
    prefill_engine.min_write_bytes = 0  # these blocks are tiny: by the engine all the same
    link = mooncake_transport.MooncakeTransport(zmq.Context.instance(), receiver.address, prefill_engine,
                                                decode_engine.descriptor)
    yield src, pool, receiver, link
    link.close()
    receiver.close()
    decode_engine.close()
    prefill_engine.close()
    pool.close()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_transfer_lands_verified(link, layout):
    src, pool, receiver, mc = link
    src_ids, dst_ids = LAYOUTS[layout]
    tid = f"t-{layout}"
    pool.tensor.zero_()
    receiver.expect("r", tid, dst_ids, time.monotonic() + 10)
    for layer in range(LAYERS):
        mc.write_layer(tid, layer, src[layer], src_ids, dst_ids, len(dst_ids))
    assert not mc._framed[tid]  # by the engine
    mc.send_done(KVTransferDone(transfer_id=tid, num_layers=LAYERS, block_ids=dst_ids, output_token_ids=[7]))
    ack = await_ack(mc)
    assert ack.ok, ack.reason
    s, d = torch.tensor(src_ids), torch.tensor(dst_ids)
    assert torch.equal(pool.tensor[:, :, d], src[:, :, s])
    untouched = sorted(set(range(BLOCKS)) - set(dst_ids))
    assert not pool.tensor[:, :, untouched].any()  # nothing else was written
    done, failed, _ = receiver.take()
    assert done["r"].output_token_ids == [7] and not failed


def test_small_writes_go_framed(link):
    """Below the engine's threshold a transfer goes framed, all of it, and
    lands the same."""
    src, pool, receiver, mc = link
    src_ids, dst_ids = LAYOUTS["scattered"]
    pool.tensor.zero_()
    receiver.expect("r", "t-framed", dst_ids, time.monotonic() + 10)
    mc.engine.min_write_bytes = 1 << 20
    try:
        for layer in range(LAYERS):
            mc.write_layer("t-framed", layer, src[layer], src_ids, dst_ids, len(dst_ids))
        assert mc._framed["t-framed"] and not mc._posted
        mc.send_done(KVTransferDone(transfer_id="t-framed", num_layers=LAYERS, block_ids=dst_ids,
                                    output_token_ids=[7]))
    finally:
        mc.engine.min_write_bytes = 0
    assert await_ack(mc).ok
    s, d = torch.tensor(src_ids), torch.tensor(dst_ids)
    assert torch.equal(pool.tensor[:, :, d], src[:, :, s])


def test_partial_block_is_verified_when_sent_whole(link):
    """A block sent half computed, then whole by the next step: the second
    write of a layer waits for its first, so the pool ends with the whole
    block, and it verifies."""
    src, pool, receiver, mc = link
    whole = src.clone()
    receiver.expect("r", "t-partial", [5, 6, 7], time.monotonic() + 10)
    src[:, :, 11] = 0  # what the source pool's block 11 holds after the first step
    for layer in range(LAYERS):
        mc.write_layer("t-partial", layer, src[layer], [10, 11], [5, 6], 1)
    src.copy_(whole)  # the next step completed block 11
    for layer in range(LAYERS):
        mc.write_layer("t-partial", layer, src[layer], [11, 12], [6, 7], 2)
    mc.send_done(KVTransferDone(transfer_id="t-partial", num_layers=LAYERS, block_ids=[5, 6, 7],
                                output_token_ids=[1]))
    assert await_ack(mc).ok
    assert torch.equal(pool.tensor[:, :, 5:8], whole[:, :, 10:13])


def test_wrong_checksum_fails_the_transfer(link):
    """What the decode core verifies is its own pool: a chunk claiming other
    bytes than the engine wrote fails the transfer."""
    from kvferry.messages import KVLayerChunk

    src, pool, receiver, mc = link
    receiver.expect("r", "t-bad", [1, 2], time.monotonic() + 10)
    for layer in range(LAYERS):
        mc.write_layer("t-bad", layer, src[layer], [3, 4], [1, 2], 2)
    mc.send_message(KVLayerChunk(transfer_id="t-bad", layer=1, block_ids=[1, 2], num_final_blocks=2, checksum=1))
    mc.send_done(KVTransferDone(transfer_id="t-bad", num_layers=LAYERS, block_ids=[1, 2], output_token_ids=[1]))
    ack = await_ack(mc)
    assert not ack.ok and ack.reason == "checksum mismatch in layer 1"


def test_unusable_descriptors_are_refused(master, link):
    src, pool, receiver, mc = link
    other = torch.zeros(LAYERS, 2, 8, BS, HEADS, 2 * DIM, dtype=torch.bfloat16)  # another model's blocks
    engine = mooncake_transport.MooncakeEngine("127.0.0.1", master.metadata, other)
    try:
        with pytest.raises(ValueError, match="does not match"):
            mooncake_transport.MooncakeTransport(zmq.Context.instance(), receiver.address, mc.engine,
                                                 engine.descriptor)
        with pytest.raises(ValueError, match="unreadable"):
            mooncake_transport.MooncakeTransport(zmq.Context.instance(), receiver.address, mc.engine, b"\x01junk")
    finally:
        engine.close()


def test_a_missing_metadata_server_is_a_clear_error():
    with pytest.raises(ValueError, match="--kv-transfer-metadata"):
        KVTransferConfig(kv_transfer_address="tcp://127.0.0.1:0", kv_transport="mooncake")
    with pytest.raises(ValueError, match="--kv-transfer-metadata"):
        EngineArgs(kv_transfer_address="tcp://127.0.0.1:0", kv_transport="mooncake",
                   kv_transfer_metadata="127.0.0.1:8080")


def test_an_unreachable_metadata_server_is_a_clear_error(master):
    with pytest.raises(ValueError, match="did not start"):  # nothing serves metadata there
        mooncake_transport.MooncakeEngine("127.0.0.1", "http://127.0.0.1:1/metadata",
                                          torch.zeros(SHAPE, dtype=torch.bfloat16))


# -- two engine cores --------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("disagg-mc"), arch="llama", num_hidden_layers=3,
                                    max_position_embeddings=1024))


def test_greedy_equals_colocated(master, checkpoint):
    colocated = LLM(model=checkpoint, dtype="float32")
    common = dict(kv_transport="mooncake", kv_transfer_metadata=master.metadata)
    prefill = make_core(checkpoint, max_num_batched_tokens=40, **common)  # chunked: blocks re-sent whole
    decode = make_core(checkpoint, prefill.loaded, **common)
    agent = prefill.runner.connector.find(PDTransferWorker).agent
    agent.mooncake.min_write_bytes = 0  # a tiny model's blocks: by the engine all the same
    try:
        for i, n in enumerate((1, 17, 150)):
            prompt = [(7 * i + 13 * j) % 290 + 3 for j in range(n)]
            result = run_disagg(prefill, decode, f"r{i}", prompt, GREEDY)
            want = list(colocated.generate([prompt], GREEDY)[0].outputs[0].token_ids)
            assert result.tokens == want, n
            assert result.finish_reason == "length" and not result.transfer_errors
        assert {type(link).__name__ for link in agent._links.values()} == {"MooncakeTransport"}
        drain(prefill)
        drain(decode)
    finally:
        prefill.close()
        decode.close()


def test_a_write_that_fails_fails_the_transfer_not_the_link(master, link):
    """A write the decode core's engine refuses (outside its registered
    pool) sends no chunk: the Done finds the layers missing, and the link
    goes on serving the next transfer."""
    src, pool, receiver, mc = link
    bad = msgspec.structs.replace(mc.peer, base=mc.peer.base + (1 << 40))
    wrong = mooncake_transport.MooncakeTransport(zmq.Context.instance(), receiver.address, mc.engine,
                                                 msgspec.msgpack.encode(bad))
    try:
        receiver.expect("r", "t-refused", [1, 2], time.monotonic() + 10)
        for layer in range(LAYERS):
            wrong.write_layer("t-refused", layer, src[layer], [3, 4], [1, 2], 2)
        wrong.send_done(KVTransferDone(transfer_id="t-refused", num_layers=LAYERS, block_ids=[1, 2],
                                       output_token_ids=[1]))
        ack = await_ack(wrong)
        assert not ack.ok and "missing blocks" in ack.reason
    finally:
        wrong.close()
    receiver.take()
    test_transfer_lands_verified(link, "contiguous")  # the pool and the good link are unharmed
