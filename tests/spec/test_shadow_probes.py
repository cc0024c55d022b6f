"""Shadow probes (``spec.shadow``): a request that stopped drafting probes
with a text proposer's draft scored against its next tokens, never
verified, so that a request whose drafts fail decodes at plain decoding's
cost between probes (the tail of the default's TPOT at batch 1 was such
requests' verified one-draft probes)."""
from __future__ import annotations

import pytest

from kvferry import LLM, SamplingParams
from kvferry.spec.adaptive import AdaptiveSpecController
from tests.tiny_models import make_tiny_checkpoint

TOKENS = 96


def test_a_shadow_draft_is_scored_once_its_tokens_decide_it():
    from kvferry.spec.shadow import ShadowDraft
    from kvferry.spec.tree import DraftTree

    chain = ShadowDraft.of("suffix", [7, 8, 9], num_tokens=10)
    context = list(range(10))
    assert chain.score(context) is None and chain.score(context + [7, 8]) is None  # all held so far
    assert chain.score(context + [7, 8, 9]) == 3
    assert chain.score(context + [7, 5]) == 1  # decided by its first miss
    # A tree: 7 -> 8, and 6 -> 2 -> 3 (depth 3): the branch that held counts.
    tree = ShadowDraft.of("suffix", DraftTree([7, 6, 8, 2, 3], [-1, -1, 0, 1, 3]), num_tokens=10)
    assert tree.depth == 3
    assert tree.score(context + [6, 2]) is None
    assert tree.score(context + [7, 8, 1]) == 2  # a leaf, then a token past it
    assert tree.score(context + [6, 2, 3]) == 3
    assert tree.score(context + [4]) == 0


def test_a_shadow_probe_verifies_nothing_and_wins_drafts_back_where_it_holds():
    c = AdaptiveSpecController(4, 64, cost_aware=False, ewma_alpha=1.0, probe_interval=2, prior_acceptance=1.0,
                               shadow_methods=("",))
    tokens = list(range(20))
    assert c.num_drafts("r", 1) == 4
    c.observe("r", 4, 0)  # failed: acceptance 0
    assert [c.num_drafts("r", 1) for _ in range(2)] == [0, 1]  # a one-draft probe 2 steps on
    assert c.shadowed("r", [1], len(tokens))  # scored at the next step, not verified
    c.score_shadow("r", tokens)  # no token after it yet: undecided
    assert c.record("r") == {"": 0.0}
    c.score_shadow("r", tokens + [9])  # failed: the wait doubles to 4
    assert [c.num_drafts("r", 1) for _ in range(4)] == [0, 0, 0, 1]
    assert c.shadowed("r", [5], 30)
    c.score_shadow("r", list(range(30)) + [5])  # held: as a verified one-draft probe that held
    assert c.acceptance("r") == 1.0 and c.num_drafts("r", 1) == 4  # drafting again
    assert not c.shadowed("r", [5, 6, 7, 8], 31)  # not a probe: verified
    # A controller with no shadow methods verifies its probes.
    c = AdaptiveSpecController(4, 64, cost_aware=False, ewma_alpha=1.0, probe_interval=2, prior_acceptance=1.0)
    c.num_drafts("r", 1)
    c.observe("r", 4, 0)
    assert [c.num_drafts("r", 1) for _ in range(2)] == [0, 1] and not c.shadowed("r", [1], 20)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("shadow"), arch="llama", max_position_embeddings=1024))


def steps_drafts(llm: LLM) -> list[int]:
    """Draft tokens verified in each of the engine's steps from now on."""
    sched = llm.engine.core.scheduler
    schedule, drafts = sched.schedule, []

    def noting():
        out = schedule()
        if out.num_scheduled_tokens:
            drafts.append(sum(len(d) for d in out.spec_token_ids.values()))
        return out

    sched.schedule = noting
    return drafts


@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_a_request_whose_drafts_fail_verifies_no_probe(model, method):
    """A sampled request over a prompt of every token id: each sampled token
    has occurred, so suffix decoding and prompt lookup draft the prompt's
    next tokens, which a draw at temperature 2 almost never is. The
    controller stops its drafts within a few steps; from then on no step
    verifies a draft (its probes are scored, not verified: a verified probe
    cost a verify step each), and its probes were made and scored."""
    llm = LLM(model=model, dtype="float32",
              speculative={"method": method, "num_speculative_tokens": 4, "cost_aware": False, "probe_interval": 4})
    drafts = steps_drafts(llm)
    budget = llm.engine.core.scheduler.draft_budget
    shadowed, shadows = budget.shadowed, []

    def noting_shadows(*args):  # noqa: ANN002
        shadows.append(shadowed(*args))
        return shadows[-1]

    budget.shadowed = noting_shadows
    prompt = list(range(3, 384)) * 2
    params = SamplingParams(max_tokens=TOKENS, temperature=2.0, seed=7, ignore_eos=True)
    assert len(llm.generate([prompt], params)[0].token_ids) == TOKENS
    first_plain = drafts.index(0, 1)  # step 0 is the prefill
    assert first_plain < 16, drafts
    assert sum(drafts[first_plain:]) == 0, drafts
    assert shadows.count(True) >= 3, shadows  # probes at 4, 8, 16, 32, 64 steps' waits, where a match was found
    record = budget.history.get("")
    assert record is not None  # its drafts, the shadow probes' among them, are on its tenant's record
    stats = llm.engine.stats()
    assert stats.num_accepted_tokens <= stats.num_draft_tokens == sum(drafts)
