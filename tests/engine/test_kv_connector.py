"""The KV connector seat: a connector from outside the package serves loads
and write-down in a real engine (greedy outputs equal HF's), a bad
``kv_connector`` is refused naming the field, and several connectors
compose in one engine core (the prefill/decode transfer, host swap and the
node store on a decode core)."""
from __future__ import annotations

import random

import pytest

from kvferry import LLM, SamplingParams
from kvferry.engine.kv_connector import (
    HostSwapWorker, MultiKVConnectorWorker, NodeStoreWorker, PDTransferWorker,
)
from tests.disagg.driver import assert_idle, closing_cores, drain, make_core, run_disagg, settle
from tests.engine import dict_tier_connector as dict_tier
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_models import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DICT_TIER = "tests.engine.dict_tier_connector:DictTierConnector"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("connector"), arch="llama", num_hidden_layers=2,
                                    max_position_embeddings=512))


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def test_a_connector_from_outside_the_package_loads_what_it_saved(checkpoint):
    hf = load_hf(checkpoint)
    prompt = prompt_of(70, seed=1)
    expected = hf_greedy(hf, prompt, GREEDY.max_tokens)
    dict_tier.BLOCKS.clear()
    writer = LLM(model=checkpoint, dtype="float32", block_size=16, kv_connector=DICT_TIER)
    first = writer.generate([prompt], GREEDY)[0]
    assert_greedy_match(hf, prompt, first.outputs[0].token_ids, expected)
    assert dict_tier.COUNTS["saved_blocks"] >= 4  # every full block of the prompt went down
    # A fresh engine: an empty device cache, so the prompt's blocks come from the dict.
    reader = LLM(model=checkpoint, dtype="float32", block_size=16, kv_connector=DICT_TIER)
    before = dict_tier.COUNTS["loaded_blocks"]
    second = reader.generate([prompt], GREEDY)[0]
    assert dict_tier.COUNTS["loaded_blocks"] - before == 4  # 70 tokens: 4 full blocks, the last token computed
    assert second.num_cached_tokens == 64
    assert_greedy_match(hf, prompt, second.outputs[0].token_ids, expected)
    reader.engine.check_integrity()


@pytest.mark.parametrize(("spec", "message"), [
    ("tests.engine.dict_tier_connector", "module:Class"),
    ("tests.engine.no_such_module:X", "cannot be loaded"),
    ("tests.engine.dict_tier_connector:NotAConnector", "is not a"),
])
def test_a_bad_connector_is_refused_naming_the_field(checkpoint, spec, message):
    with pytest.raises(ValueError, match=message) as info:
        LLM(model=checkpoint, dtype="float32", kv_connector=spec)
    assert "kv_connector" in str(info.value)


def test_transfer_swap_and_store_compose_in_one_decode_core(checkpoint):
    colocated = LLM(model=checkpoint, dtype="float32")
    prefill = make_core(checkpoint)
    decode = make_core(checkpoint, prefill.loaded, num_swap_blocks=16, kv_dram_gb=0.05)
    with closing_cores(prefill, decode):
        connector = decode.runner.connector
        assert isinstance(connector, MultiKVConnectorWorker)
        assert [type(w) for w in connector.workers] == [PDTransferWorker, HostSwapWorker, NodeStoreWorker]
        prompt = prompt_of(90, seed=2)
        expected = list(colocated.generate([prompt], GREEDY)[0].outputs[0].token_ids)
        result = run_disagg(prefill, decode, "pd", prompt, GREEDY)
        assert result.tokens == expected and not result.transfer_errors
        drain(decode)
        drain(prefill)
        # The store's write-down ran in the same core: the block the decode
        # filled (tokens 80..95, the last 6 of them generated here) went down.
        # (The received prompt blocks count as loaded, as a tier's would.)
        assert decode.stats().kv_saved_blocks == 1
        store = connector.find(NodeStoreWorker)
        hashes = decode_block_hashes(decode, prompt + result.tokens)
        assert store.store.lookup(hashes[5:6]) == 1 and store.store.lookup(hashes[:1]) == 0
        # A colocated request on the same core runs through the same connectors.
        other = prompt_of(40, seed=3)
        from tests.disagg.driver import request, step_until
        decode.add_request(request("co", other, GREEDY))
        outs = step_until(decode, lambda seen: any(o.finished for o in seen))
        tokens = [t for o in outs if o.request_id == "co" for t in o.new_token_ids]
        assert tokens == list(colocated.generate([other], GREEDY)[0].outputs[0].token_ids)
        settle(decode)
        assert_idle(prefill)  # drained above and not stepped since


def decode_block_hashes(core, prompt: list[int]) -> list[bytes]:
    """The prompt's full-block hashes as the core's KV manager keys them."""
    from kvferry.core.request import Request
    probe = Request("probe", list(prompt), GREEDY)
    core.scheduler.kv.find_prefix_hit(probe)  # fills probe.block_hashes
    return list(probe.block_hashes)
