"""The engine on the node's KV store (a real ``kvferry kvstore`` process):
greedy outputs identical with and without it, a second turn resumed from
the store after the device pool is gone, partial loads recomputed, a store
killed mid-run, swap preemption through the store."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest

from kvferry import LLM, SamplingParams
from kvferry.config import KVTierConfig
from kvferry.engine.kv_connector import NodeStoreWorker
from kvferry.kvstore.client import KVStoreClient
from kvferry.kvstore.launch import start_store
from kvferry.kvstore.protocol import LoadResult
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 12
BLOCK = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiers"), arch="llama", max_position_embeddings=512))
    hf = load_hf(path)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in (61, 64, 45, 70)]
    return path, hf, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


@pytest.fixture
def store():
    process, address = start_store(KVTierConfig(kv_dram_gb=0.02))
    yield process, address
    if process.poll() is None:
        process.terminate()
        process.wait(timeout=10)


def tiered_llm(path, address, **kwargs):
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(model=path, dtype="float32", block_size=BLOCK, kv_store=address, **kwargs)


def store_stats(address):
    with KVStoreClient(address) as client:
        return client.stats()


def test_outputs_identical_and_blocks_written_down(case, store):
    path, hf, prompts, expected = case
    _, address = store
    llm = tiered_llm(path, address)
    results = llm.generate(prompts, GREEDY)
    for p, e, r in zip(prompts, expected, results):
        assert_greedy_match(hf, p, r.token_ids, e)
    stats = llm.engine.stats()
    # Every full block of prompt and output whose KV was computed (the last
    # sampled token never is): generated tokens' blocks included.
    written = sum((len(p) + MAX_NEW - 1) // BLOCK for p in prompts)
    assert stats.kv_saved_blocks == written
    assert store_stats(address).used_slots == written
    # Saves are done when generate returns: no block stays pinned.
    llm.engine.check_integrity()
    assert not llm.engine.core.scheduler.kv.pinned
    llm.engine.core.close()


def test_second_turn_resumes_from_the_store_on_a_fresh_engine(case, store):
    # Turn 1 on engine A; turn 2 (turn 1's prompt + reply + a new message)
    # on engine B, whose device pool never saw it: B loads everything
    # before the new message, the model's own reply included, from DRAM.
    path, hf, prompts, expected = case
    _, address = store
    first = tiered_llm(path, address)
    turn1 = first.generate([prompts[0]], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                                                          kv_retention_s=60))[0]
    first.engine.core.close()
    assert store_stats(address).retained_blocks == (len(prompts[0]) + MAX_NEW - 1) // BLOCK
    history = prompts[0] + turn1.token_ids
    turn2_prompt = history + [5, 6, 7, 8, 9, 10, 11]
    second = tiered_llm(path, address)
    turn2 = second.generate([turn2_prompt], GREEDY)[0]
    assert_greedy_match(hf, turn2_prompt, turn2.token_ids, hf_greedy(hf, turn2_prompt, MAX_NEW))
    loaded = (len(history) - 1) // BLOCK * BLOCK
    assert turn2.num_cached_tokens == loaded
    stats = second.engine.stats()
    assert stats.kv_loaded_tokens == loaded and stats.kv_store_hits == loaded and stats.prefix_hits == 0
    second.engine.core.close()


class TruncatingClient(KVStoreClient):
    """The real client, whose load results lose all but their first block:
    what the store answers when a block turns out missing or corrupt."""

    def poll_loads(self) -> list[LoadResult]:
        return [LoadResult(ticket=r.ticket, slots=r.slots[:1]) for r in super().poll_loads()]


def test_partial_load_recomputes_the_rest(case, store):
    path, hf, prompts, expected = case
    _, address = store
    writer = tiered_llm(path, address)
    writer.generate([prompts[1]], GREEDY)
    writer.engine.core.close()
    reader = tiered_llm(path, address)
    connector = reader.engine.core.runner.connector
    connector.store = TruncatingClient(address)
    prompt = prompts[1] + [9, 8, 7]
    result = reader.generate([prompt], GREEDY)[0]
    assert_greedy_match(hf, prompt, result.token_ids, hf_greedy(hf, prompt, MAX_NEW))
    stats = reader.engine.stats()
    assert stats.kv_partial_loads == 1 and stats.kv_loaded_tokens == BLOCK
    assert result.num_cached_tokens == BLOCK
    reader.engine.check_integrity()
    reader.engine.core.close()


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` until true. The bound only turns a hang into a
    failure: the states awaited here take a few seconds (the client's 1 s
    timeout and its backoff of at most 2 s), more on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_store_killed_mid_run_keeps_serving_then_reconnects(case, store):
    path, hf, prompts, expected = case
    process, address = store
    llm = tiered_llm(path, address)
    connector = llm.engine.core.runner.connector
    lookups = llm.engine.core.scheduler.connector.source.stats
    assert_greedy_match(hf, prompts[0], llm.generate([prompts[0]], GREEDY)[0].token_ids, expected[0])
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    # The I/O thread notices (off the step's path); from then on the
    # scheduler's lookups skip the store instead of waiting on it.
    wait_for(lambda: not connector.store_up, "the I/O thread to see the store down")
    queries = lookups.queries
    start = time.monotonic()
    results = llm.generate(prompts[1:], GREEDY)
    for p, e, r in zip(prompts[1:], expected[1:], results):
        assert_greedy_match(hf, p, r.token_ids, e)
    assert lookups.queries == queries
    # A hang guard, not a speed figure: no step waits on the dead store.
    assert time.monotonic() - start < 120
    # A store comes back at the same address: the engine reconnects and
    # writes down again.
    process2, _ = start_store(KVTierConfig(kv_store=address, kv_dram_gb=0.02))
    try:
        wait_for(lambda: connector.store_up, "the I/O thread to reconnect")
        saved = llm.engine.stats().kv_saved_blocks
        llm.generate([prompts[2] + [3, 4]], GREEDY)
        assert llm.engine.stats().kv_saved_blocks > saved
        assert store_stats(address).used_slots > 0
    finally:
        llm.engine.core.close()
        process2.terminate()
        process2.wait(timeout=10)


class StoreKillingClient(KVStoreClient):
    """The real client, which SIGKILLs the store the moment the store has
    accepted a load: a store lost in the middle of a load, every time
    (a kill timed from outside mostly lands before or after the load)."""

    def __init__(self, address: str, process) -> None:
        super().__init__(address)
        self.process = process

    def begin_load(self, keys, owners) -> int:
        ticket = super().begin_load(keys, owners)
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        return ticket


def test_a_store_killed_mid_load_fails_the_load_at_once_and_the_request_recomputes(case, store):
    path, hf, prompts, expected = case
    process, address = store
    writer = tiered_llm(path, address)
    writer.generate([prompts[1]], GREEDY)
    writer.engine.core.close()
    reader = tiered_llm(path, address)  # its device pool never saw the prompt: it loads from the store
    connector = reader.engine.core.runner.connector
    connector.store = StoreKillingClient(address, process)
    start = time.monotonic()
    result = reader.generate([prompts[1]], GREEDY)[0]
    elapsed = time.monotonic() - start
    assert process.returncode == -signal.SIGKILL  # the load did start, and the store died under it
    assert_greedy_match(hf, prompts[1], result.token_ids, expected[1])
    stats = reader.engine.stats()
    assert stats.kv_partial_loads == 1 and stats.kv_loaded_tokens == 0 and result.num_cached_tokens == 0
    # The load failed as soon as the store's end of the socket closed: not
    # after the client's 1 s call timeout (nor the connector's 10 s load
    # timeout), which a request used to wait out before recomputing.
    assert connector.stats.failed_loads == 1 and connector.stats.load_seconds < 0.5, connector.stats
    # generate() also drains the request's saves, each refused by the dead
    # store without a wait.
    assert elapsed < 6.0, elapsed
    # The engine keeps serving without the store.
    other = reader.generate([prompts[2]], GREEDY)[0]
    assert_greedy_match(hf, prompts[2], other.token_ids, expected[2])
    reader.engine.check_integrity()
    reader.engine.core.close()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_swap_preemption_through_the_store_keeps_greedy_output(case, mode):
    # 32 blocks of 8 admit the four prompts (31 blocks) but not their
    # decodes: preemption must happen. Swap without a host swap space goes
    # through the store: the resumed request loads its blocks back.
    # A victim's blocks stay pinned on the device until their save is done,
    # and a resume that comes first hits them there instead of loading: on
    # a loaded machine (slow saves) a whole run can resume from the device.
    # Both paths are right; the store's is asserted over up to three runs,
    # each on a fresh engine and an empty store (so every load is a
    # resume's), every one of them checked against HF.
    path, hf, prompts, expected = case
    loaded = 0
    for _attempt in range(3):
        process, address = start_store(KVTierConfig(kv_dram_gb=0.02))
        try:
            llm = tiered_llm(path, address, num_kv_blocks=32, preemption_mode=mode)
            results = llm.generate(prompts, GREEDY)
            for p, e, r in zip(prompts, expected, results):
                assert_greedy_match(hf, p, r.token_ids, e)
            stats = llm.engine.stats()
            assert stats.num_preemptions > 0
            llm.engine.check_integrity()
            llm.engine.core.close()
        finally:
            process.terminate()
            process.wait(timeout=10)
        loaded = stats.kv_loaded_tokens
        if loaded > 0:
            break
    assert loaded > 0


def test_resume_from_the_ssd_tier_after_dram_was_flushed(case, tmp_path):
    # DRAM of ~78 blocks over a disk tier: the conversations after turn 1
    # push its blocks down to SSD, and the next turn loads them from there.
    path, hf, prompts, expected = case
    process, address = start_store(KVTierConfig(kv_dram_gb=0.0003, kv_disk=str(tmp_path / "kvdisk"),
                                                kv_disk_gb=0.01))
    try:
        writer = tiered_llm(path, address)
        history = prompts[3] + writer.generate([prompts[3]], GREEDY)[0].token_ids
        rng = random.Random(11)
        for _ in range(4):
            writer.generate([[rng.randrange(3, 300) for _ in range(200)]], GREEDY)
        writer.engine.core.close()
        turn2 = history + [12, 13, 14]
        reader = tiered_llm(path, address)
        result = reader.generate([turn2], GREEDY)[0]
        assert_greedy_match(hf, turn2, result.token_ids, hf_greedy(hf, turn2, MAX_NEW))
        assert result.num_cached_tokens == (len(history) - 1) // BLOCK * BLOCK
        assert store_stats(address).tiers["disk"].hits > 0
        reader.engine.core.close()
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_loads_are_capped_per_request(case, store):
    # --max-load-tokens 16: two blocks come from the store, the rest of the
    # prefix is recomputed; the output does not change.
    path, hf, prompts, expected = case
    _, address = store
    writer = tiered_llm(path, address)
    writer.generate([prompts[1]], GREEDY)
    writer.engine.core.close()
    reader = tiered_llm(path, address, max_load_tokens=2 * BLOCK)
    result = reader.generate([prompts[1]], GREEDY)[0]
    assert_greedy_match(hf, prompts[1], result.token_ids, expected[1])
    stats = reader.engine.stats()
    assert stats.kv_loaded_tokens == 2 * BLOCK and result.num_cached_tokens == 2 * BLOCK
    assert stats.kv_partial_loads == 0
    reader.engine.core.close()


def test_tier_flags_parse_and_bad_values_name_the_flag():
    import argparse

    from kvferry.config import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args([
        "--kv-store", "ipc:///tmp/s.sock", "--max-load-tokens", "256", "--preemption-mode", "swap",
        "--kv-dram-gb", "2", "--kv-disk", "/tmp/d", "--kv-disk-gb", "10", "--kv-remote", "redis://127.0.0.1:6379/0"]))
    config = args.create_engine_config()
    assert config.kv_tiers.kv_store == "ipc:///tmp/s.sock" and config.kv_tiers.max_load_tokens == 256
    assert config.kv_tiers.kv_disk_gb == 10 and config.scheduler.preemption_mode == "swap"
    for field, value, flag in [("preemption_mode", "sometimes", "preemption_mode"), ("max_load_tokens", -1, None),
                               ("kv_dram_gb", -1.0, None), ("kv_remote", "http://x", None),
                               ("kv_disk", "/tmp/d", "kv_disk_gb")]:
        with pytest.raises(ValueError, match=flag or field):
            EngineArgs(**{field: value})


def test_offline_engine_starts_a_store_of_its_own(case):
    path, hf, prompts, expected = case
    llm = LLM(model=path, dtype="float32", block_size=BLOCK, num_kv_blocks=64, kv_dram_gb=0.02)
    # The node store connector owns the store it started (the core knows no store).
    store = llm.engine.core.runner.connector.find(NodeStoreWorker).node_store.process
    assert store is not None and store.poll() is None
    result = llm.generate([prompts[2]], GREEDY)[0]
    assert_greedy_match(hf, prompts[2], result.token_ids, expected[2])
    assert llm.engine.stats().kv_saved_blocks == (len(prompts[2]) + MAX_NEW - 1) // BLOCK
    llm.engine.core.close()
    assert store.poll() is not None  # stopped with the engine


def test_the_core_reaches_its_store_only_through_the_connector_hooks(case, store):
    # EngineCore knows no store: the tiers' counters come from the
    # connector's report_stats, and a tenant purge reaches every tier
    # through its purge_tenant (the node store connector's index client).
    from kvferry.config import EngineArgs
    from kvferry.engine.core import EngineCore
    from kvferry.messages import EngineCoreRequest
    from kvferry.types.cache_scope import CacheScope

    path, _, prompts, _ = case
    _, address = store
    core = EngineCore(EngineArgs(model=path, dtype="float32", block_size=BLOCK, num_kv_blocks=64,
                                 kv_store=address).create_engine_config())
    try:
        scope = CacheScope(namespace="t-acme", tenant="acme")
        core.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=prompts[0], sampling_params=GREEDY,
                                           eos_token_ids=[2], arrival_time=time.monotonic(), cache_scope=scope))
        written = (len(prompts[0]) + MAX_NEW - 1) // BLOCK
        wait_for(lambda: (core.step(), not core.has_unfinished_requests())[1], "the request to finish")
        wait_for(lambda: (core.step(), store_stats(address).used_slots == written)[1], "the write-down")
        wait_for(lambda: core.stats().kv_tiers.get("dram", {}).get("num_blocks") == written, "the tier stats")
        assert core.stats().kv_store_id == address and not core.store_stats_changed()
        dropped = core.purge_tenant("acme")
        assert dropped >= written  # the device pool's cached blocks, and the store's
        assert store_stats(address).used_slots == 0
    finally:
        core.close()
