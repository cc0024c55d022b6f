"""The suffix proposer on hand-built requests: its own text, its tenant's
finished requests (and never another tenant's, read from the drafts
themselves), the adaptive draft length, the memory bound and LRU order."""
from __future__ import annotations

import random

import pytest

from kvferry.config import EngineArgs, SpeculativeConfig
from kvferry.core.request import Request, RequestStatus
from kvferry.sampling import SamplingParams
from kvferry.spec import AutoProposer, NgramProposer, SuffixProposer, speculation
from kvferry.types.cache_scope import CacheScope

rng = random.Random(5)
SECRET = rng.sample(range(1000, 2000), 40)  # tenant A's text: distinct ids no other text uses


def request(rid: str, tokens: list[int], tenant: str = "", namespace: str | None = None) -> Request:
    scope = CacheScope(namespace=tenant if namespace is None else namespace, tenant=tenant)
    return Request(rid, list(tokens), SamplingParams(), cache_scope=scope)


def finish(proposer: SuffixProposer, req: Request, status=RequestStatus.FINISHED_STOPPED) -> None:
    req.status = status
    proposer.finished(req)
    proposer.work(None)


def decode_through(proposer: SuffixProposer, req: Request, continuation: list[int]) -> list[list[int]]:
    """Propose at every position of ``continuation`` (appending it token by
    token, as accepted output); returns every draft."""
    drafts = []
    for token in continuation:
        drafts.append(proposer.propose(req))
        req.append_output_token(token)
    return drafts


def assert_only_own_text(proposer: SuffixProposer, req: Request, continuation: list[int]) -> list[list[int]]:
    """Decode through ``continuation``: no draft holds a secret token that
    the request's own text did not hold when it was drafted."""
    drafts = []
    for token in continuation:
        draft = proposer.propose(req)
        leaked = set(draft) & set(SECRET) - set(req.all_token_ids)
        assert not leaked, (req.request_id, draft, leaked)
        drafts.append(draft)
        req.append_output_token(token)
    return drafts


def test_own_text_drafts_a_repeated_passage():
    passage = list(range(100, 130))
    proposer = SuffixProposer(4)
    req = request("r", passage + passage[:5])
    assert proposer.propose(req) == passage[5:9]
    req.append_output_token(passage[5])
    assert proposer.propose(req) == passage[6:10]
    assert proposer.propose(request("fresh", list(range(300, 340)))) == []


def test_a_long_prompt_enters_its_own_trie_in_slices():
    passage = list(range(100, 400))
    proposer = SuffixProposer(4, work_per_call=64)  # 256 tokens a proposal
    req = request("r", passage * 3 + passage[:5])
    # Only the first 256 tokens are in, but they hold the first copy: its continuation.
    assert proposer.propose(req) == passage[5:9]
    assert proposer._local["r"].tree.num_tokens == 256
    for _ in range(3):
        proposer.propose(req)
    assert proposer._local["r"].tree.num_tokens == len(req.all_token_ids)
    proposer.check_integrity()


def test_draft_length_follows_the_match_length():
    """max_spec = factor x match length: a 2-token match drafts 2 at factor 1."""
    proposer = SuffixProposer(8, max_spec_factor=1.0)
    assert proposer.propose(request("r", [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2])) == [3, 4]
    proposer = SuffixProposer(8, max_spec_factor=2.0)
    assert proposer.propose(request("r", [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2])) == [3, 4, 5, 6]


def test_a_finished_request_drafts_for_its_tenant_only():
    """Tenant A's secret, once finished, drafts for A's next request; for
    tenant B, and for A under another cache salt (namespace), with the
    same context, no draft ever holds a token of it."""
    proposer = SuffixProposer(4)
    finish(proposer, request("a1", [1, 2, 3] + SECRET, tenant="A"))
    lead = [9, 1, 2, 3]  # the context that led into the secret
    a2 = request("a2", lead, tenant="A")
    assert decode_through(proposer, a2, SECRET[:10])[0] == SECRET[:3]  # factor 1 x match [1, 2, 3]
    for other in (request("b1", lead, tenant="B"), request("a3", lead, tenant="A", namespace="A/salt")):
        assert not any(assert_only_own_text(proposer, other, SECRET))
    # Nor once B has finished requests of its own with the same lead, nor
    # once B's own request repeats a part of the secret.
    finish(proposer, request("b2", [1, 2, 3, 4, 5, 6], tenant="B"))
    drafts = assert_only_own_text(proposer, request("b3", lead, tenant="B"), SECRET[:20] + [1, 2, 3] + SECRET)
    assert drafts[0] == [4, 5, 6] and any(drafts[24:])  # it drafts from its own text


def test_tenant_trie_wins_when_its_draft_is_likelier():
    proposer = SuffixProposer(4)
    for i in range(3):
        finish(proposer, request(f"old{i}", [5, 6, 7, 8, 9, 10], tenant="A"))
    # Its own text once says 5 6 -> 1; the tenant's three times 5 6 -> 7.
    req = request("r", [5, 6, 1, 2, 40, 41, 5, 6], tenant="A")
    assert proposer.propose(req) == [7, 8]


def test_tenant_budget_in_tokens_evicts_least_recently_used():
    proposer = SuffixProposer(4, max_cached_tokens=100)
    passages = [[1000 * (i + 1) + j for j in range(30)] for i in range(4)]
    for i in range(3):
        finish(proposer, request(f"p{i}", passages[i], tenant="A"))
    assert proposer.cached_tokens("A") == 90
    # Reading p0 in a draft makes it the most recently used...
    assert proposer.propose(request("q", passages[0][:3], tenant="A")) == passages[0][3:6]
    finish(proposer, request("p3", passages[3], tenant="A"))  # ...so p1 goes, not p0
    assert proposer.cached_tokens("A") == 90
    assert proposer.propose(request("q1", passages[1][:3], tenant="A")) == []
    for i in (0, 2, 3):
        assert proposer.propose(request(f"q{i}", passages[i][:3], tenant="A")) == passages[i][3:6]
    proposer.check_integrity()
    # Another tenant's requests never evict A's.
    for i in range(10):
        finish(proposer, request(f"b{i}", [5000 + 40 * i + j for j in range(30)], tenant="B"))
    assert proposer.cached_tokens("A") == 90 and proposer.cached_tokens("B") == 90


def test_budget_in_requests_and_too_long_requests():
    proposer = SuffixProposer(4, max_cached_requests=2, max_cached_tokens=50)
    for i in range(5):
        finish(proposer, request(f"p{i}", [100 * i + j for j in range(10)], tenant="A"))
    assert proposer.cached_tokens("A") == 20
    finish(proposer, request("long", list(range(60)), tenant="A"))  # alone over the budget: not kept
    assert proposer.cached_tokens("A") == 20
    proposer.check_integrity()


def test_finished_requests_are_added_in_slices_and_evictions_run_first():
    proposer = SuffixProposer(4, max_cached_tokens=1000, work_per_call=64)
    req = request("big", list(range(800)), tenant="A")
    req.status = RequestStatus.FINISHED_STOPPED
    proposer.finished(req)
    assert proposer.cached_tokens("A") == 0  # queued, not added on the finishing step
    proposer.propose(request("q", [1], tenant="A"))
    assert proposer.cached_tokens("A") == 64
    req2 = request("big2", list(range(5000, 5500)), tenant="A")
    req2.status = RequestStatus.FINISHED_STOPPED
    proposer.finished(req2)  # over budget: "big" (half added) goes first
    proposer.propose(request("q", [1], tenant="A"))
    assert proposer.cached_tokens("A") == 0
    proposer.work(None)
    assert proposer.cached_tokens("A") == 500
    proposer.check_integrity()


def test_prefilled_and_failed_requests_are_not_kept_and_purge_forgets():
    proposer = SuffixProposer(4)
    finish(proposer, request("p", list(range(50)), tenant="A"), RequestStatus.FINISHED_PREFILLED)
    finish(proposer, request("e", list(range(50)), tenant="A"), RequestStatus.FINISHED_ERROR)
    assert proposer.cached_tokens("A") == 0
    finish(proposer, request("ok", list(range(50)), tenant="A"), RequestStatus.FINISHED_ABORTED)
    assert proposer.cached_tokens("A") == 50
    assert proposer.purge_tenant("A") == 50
    assert proposer.cached_tokens("A") == 0
    assert proposer.propose(request("q", [1, 2, 3], tenant="A")) == []


def test_config_builds_the_proposer_and_checks_its_keys():
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=6, suffix_decoding_max_tree_depth=32,
                             suffix_decoding_max_cached_tokens=4096)
    proposer = speculation(spec)["proposer"]
    assert isinstance(proposer, SuffixProposer)
    assert (proposer.k, proposer.max_depth, proposer.max_cached_tokens) == (6, 32, 4096)
    assert EngineArgs(speculative='{"method": "suffix"}').create_engine_config().speculative.method == "suffix"


@pytest.mark.parametrize("bad, field", [
    ({"method": "suffix", "num_speculative_tokens": 24}, "speculative.num_speculative_tokens"),
    ({"suffix_decoding_max_tree_depth": 0}, "speculative.suffix_decoding_max_tree_depth"),
    ({"suffix_decoding_max_spec_factor": 0}, "speculative.suffix_decoding_max_spec_factor"),
    ({"suffix_decoding_min_token_prob": 1.5}, "speculative.suffix_decoding_min_token_prob"),
    ({"suffix_decoding_min_token_prob": "x"}, "speculative.suffix_decoding_min_token_prob"),
    ({"suffix_decoding_max_cached_tokens": -1}, "speculative.suffix_decoding_max_cached_tokens"),
    ({"suffix_decoding_max_cached_requests": 1.5}, "speculative.suffix_decoding_max_cached_requests"),
])
def test_bad_suffix_config_is_a_value_error_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EngineArgs(speculative=bad).create_engine_config()


def test_auto_follows_the_proposer_whose_drafts_held():
    """A file edited over turns: the old version occurs more often (suffix
    decoding's most frequent continuation), the new one last (prompt
    lookup's latest). Re-emitting the new version, auto moves to n-gram."""
    old = list(range(100, 140))
    new = old[:20] + [7, 7, 7] + old[23:]  # an edit in the middle
    proposer = AutoProposer(SuffixProposer(4), NgramProposer(4, 4, 2))
    req = request("r", old + [1] + old + [2] + new + [3])
    decode_through(proposer, req, new[:30])
    assert proposer.num_chosen["ngram"] > 0
    # After the edit point the new version's tokens are drafted.
    assert proposer.propose(req) == new[30:34]
    proposer.finished(req)
    assert proposer._states == {}


def test_auto_config_builds_both():
    proposer = speculation(SpeculativeConfig(method="auto"))["proposer"]
    assert isinstance(proposer, AutoProposer)
