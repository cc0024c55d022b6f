"""Speculation's default and its off switch, as configs: ``default`` is
method auto under the cost-aware controller, off by itself where
speculation cannot run (while an explicit config there keeps its error);
``off``, JSON null and ``{"method": "off"}`` are off; ``LLM(...)`` without
it is off, as vLLM's; the commands' flag defaults to ``default``. And auto
with a head among its choices: the head drafts where it has been right,
scored by its verified acceptance."""
from __future__ import annotations

import argparse
import json

import pytest

from kvferry.config import EMBEDDED_DRAFT_HEAD, EngineArgs, SpeculativeConfig, default_speculation
from kvferry.spec import AutoProposer, NgramProposer, ReservedDraftSlots, SuffixProposer, speculation, speculation_signature
from kvferry.spec.reserved import PLACEHOLDER_ID
from tests.spec.test_suffix import request


def test_default_is_auto_under_the_cost_aware_controller():
    spec = EngineArgs(speculative="default").create_engine_config().speculative
    assert spec is not None and spec.method == "auto" and spec.cost_aware and spec.adaptive and spec.draft_tree
    # The embedded model's committed head is among auto's choices; another target has none.
    assert spec.model == str(EMBEDDED_DRAFT_HEAD) and EMBEDDED_DRAFT_HEAD.is_file()
    other = EngineArgs(model="/some/model", speculative="default").create_engine_config().speculative
    assert other.method == "auto" and other.model is None
    assert "draft head" in EngineArgs(speculative="default").default_speculation_line()
    assert "auto" in EngineArgs(speculative="default").default_speculation_line()
    assert EngineArgs(speculative='{"method": "auto"}').default_speculation_line() is None  # given: no line


@pytest.mark.parametrize("value", ["off", "OFF", "null", "none", None, {"method": "off"}, '{"method": "off"}'])
def test_off_spellings(value):
    assert EngineArgs(speculative=value).create_engine_config().speculative is None
    assert EngineArgs(speculative=value).default_speculation_line() is None


@pytest.mark.parametrize("bad, field", [('{"method": "off", "num_speculative_tokens": 2}', "num_speculative_tokens"),
                                        ("of", "off or default"), ('{"method": "nope"}', "(or off)"),
                                        ("[1]", "JSON object")])
def test_bad_values_name_what_is_wrong(bad, field):
    with pytest.raises(ValueError, match="speculative") as err:
        EngineArgs(speculative=bad)
    assert field in str(err.value)


@pytest.mark.parametrize("kwargs, why", [({"deterministic": True}, "--deterministic")])
def test_default_is_quietly_off_where_speculation_cannot_run(kwargs, why):
    args = EngineArgs(speculative="default", **kwargs)
    assert args.create_engine_config().speculative is None
    line = args.default_speculation_line()
    assert "off by default" in line and why in line


def test_the_default_stays_on_over_ranks_and_stages():
    """Suffix, auto and draft trees run over tensor-parallel ranks and
    pipeline stages (tests/parallel/test_tp_suffix.py); the head, not over stages."""
    tp = EngineArgs(speculative="default", tensor_parallel_size=2).create_engine_config().speculative
    assert tp.method == "auto" and tp.draft_tree and tp.model == str(EMBEDDED_DRAFT_HEAD)
    pp = EngineArgs(speculative="default", pipeline_parallel_size=2).create_engine_config().speculative
    assert pp.method == "auto" and pp.draft_tree and pp.model is None
    # Attention/FFN disaggregation: the verify step's k + 1 rows a request go to the FFN workers as any rows.
    afd = EngineArgs(speculative="default", ffn=1).create_engine_config().speculative
    assert afd.method == "auto" and afd.model == str(EMBEDDED_DRAFT_HEAD)
    assert "auto" in EngineArgs(speculative="default", ffn=1).default_speculation_line()


def test_an_explicit_head_runs_over_stages_beside_a_transfer():
    # The default leaves the head out over stages (there it drafts ahead for every request, whatever auto
    # chooses: not measured as a default yet); an explicit auto with a head runs there, beside a KV transfer too.
    spec = EngineArgs(speculative=json.dumps({"method": "auto", "model": str(EMBEDDED_DRAFT_HEAD)}),
                      pipeline_parallel_size=2, kv_transfer_address="tcp://127.0.0.1:0").create_engine_config().speculative
    assert spec.method == "auto" and spec.model == str(EMBEDDED_DRAFT_HEAD)


def test_the_commands_flag_defaults_to_default_and_llm_to_off():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args([]))
    assert args.speculative == "default"
    assert args.create_engine_config().speculative.method == "auto"
    off = EngineArgs.from_cli_args(parser.parse_args(["--speculative-config", "off"]))
    assert off.create_engine_config().speculative is None
    assert EngineArgs().create_engine_config().speculative is None  # LLM(...): off unless asked


def test_default_speculation_reports_its_line():
    config = EngineArgs().create_engine_config()
    spec, line = default_speculation(config)
    assert spec.method == "auto" and "--speculative-config off" in line


# -- auto with a head --------------------------------------------------------------
def test_auto_with_a_head_builds_it_and_signs_it():
    config = SpeculativeConfig(method="auto", model="/some/head.safetensors")
    kwargs = speculation(config)
    proposer = kwargs["proposer"]
    assert isinstance(proposer, AutoProposer) and proposer.has_head
    assert kwargs["draft_budget"].on_verified == proposer.observe
    assert speculation_signature(config) == "auto+head"
    assert speculation_signature(SpeculativeConfig(method="auto")) == "auto"
    assert not speculation(SpeculativeConfig(method="auto"))["proposer"].has_head


def test_auto_drafts_with_the_head_where_the_others_have_nothing():
    proposer = AutoProposer(SuffixProposer(4), NgramProposer(4, 4, 2), head=ReservedDraftSlots(4))
    req = request("chat", list(range(100, 130)))  # no repeats: suffix and n-gram find no match
    assert proposer.propose(req) == [PLACEHOLDER_ID] * 4
    assert proposer.head_requests == {"chat"} and proposer.num_chosen["head"] == 1
    proposer.finished(req)
    assert proposer.head_requests == set()


def test_auto_follows_the_heads_verified_acceptance():
    """A repeated passage: suffix decoding drafts it (ties go to the cheaper
    proposers). Where those drafts keep failing and the head's verified
    drafts hold, the head wins the request; when the head fails, back."""
    passage = list(range(100, 140))
    proposer = AutoProposer(SuffixProposer(4), NgramProposer(4, 4, 2), head=ReservedDraftSlots(4))
    req = request("r", passage + passage[:5])
    assert proposer.propose(req) == passage[5:9] and "r" not in proposer.head_requests
    chose_head = False
    for token in range(1000, 1012):  # the output leaves the passage: suffix/n-gram drafts fail
        req.append_output_token(token)
        draft = proposer.propose(req)
        if "r" in proposer.head_requests:
            chose_head = True
            assert draft == [PLACEHOLDER_ID] * 4
            proposer.observe("r", 4, 3)  # the head's drafts held
    assert chose_head
    # Now the head fails and the passage repeats again: suffix decoding wins it back.
    for token in passage[:12]:
        req.append_output_token(token)
        proposer.propose(req)
        if "r" in proposer.head_requests:
            proposer.observe("r", 4, 0)
    assert "r" not in proposer.head_requests


def test_the_off_switch_at_a_large_batch_offers_no_drafts_and_measures_nothing():
    """From 13 running requests (24 // 13 - 1 = 0) the default's controller
    offers no request a draft, not even a probe, and keeps no figures: the
    scheduler then asks no proposer, reserves no slot, and hands the runner
    the plain step."""
    budget = speculation(EngineArgs(speculative="default").create_engine_config().speculative)["draft_budget"]
    for step in range(100):
        assert all(budget.num_drafts(f"r{i}", 13 + step % 52) == 0 for i in range(13))
    assert budget._costs == {} and budget._states == {}
    # Alone, a request may draft (the cap is k), once plain decoding is measured: first, as it costs nobody anything.
    assert budget.max_drafts(1) == 4 and budget.num_drafts("r0", 1) == 0


def test_max_drafts_is_the_batch_cap_without_side_effects():
    budget = speculation(SpeculativeConfig(method="auto"))["draft_budget"]
    assert [budget.max_drafts(n) for n in (1, 4, 8, 12, 13, 64)] == [4, 4, 2, 1, 0, 0]
    assert budget._costs == {}
