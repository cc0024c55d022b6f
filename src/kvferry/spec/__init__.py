"""Speculative decoding: draft proposers and the adaptive controller.

No torch in what this package imports (the scheduler calls into it):
proposers work on token ids with numpy. The runner-side modules
(``rejection``, ``draft_model``) use torch and are imported by the runner.
The runner verifies drafts losslessly, so a proposer only decides speed,
never output.
"""
from kvferry.config import SpeculativeConfig
from kvferry.spec.adaptive import AdaptiveSpecController
from kvferry.spec.auto import HEAD, AutoProposer
from kvferry.spec.ngram import NgramProposer
from kvferry.spec.reserved import ReservedDraftSlots
from kvferry.spec.suffix import SuffixProposer

__all__ = ["AdaptiveSpecController", "AutoProposer", "NgramProposer", "ReservedDraftSlots", "SuffixProposer",
           "auto_with_head", "runs_head", "shipped", "speculation", "speculation_signature"]


def speculation_signature(config: SpeculativeConfig | None, draft_fingerprint: str = "") -> str:
    """What a prefill core ships besides the target's KV, as a string both
    cores of a disaggregated pair compare: "" (off), "ngram", "suffix" or "auto"
    (nothing: the decode core has the whole context), "head" or "auto+head"
    (the hidden state), or
    "draft:<fingerprint>" (the draft model's KV, so its layers' shapes)."""
    if config is None:
        return ""
    if config.method == "draft":
        return f"draft:{draft_fingerprint}"
    if auto_with_head(config):
        return "auto+head"  # the hidden state travels, as for "head"
    return config.method


def shipped(signature: str) -> str:
    """What a core with this signature needs from its pair's other side: ""
    for off and the token-only methods (whose drafts come from the context
    the decode core already has), else the signature itself. Two cores of
    a pair agree when this does: a prefill pool that does not speculate
    serves a decode pool running auto."""
    return "" if signature in ("", "ngram", "suffix", "auto") else signature


def auto_with_head(config: SpeculativeConfig | None) -> bool:
    """Method auto with a draft head among its choices (``model``: the head file)."""
    return config is not None and config.method == "auto" and config.model is not None


def runs_head(config: SpeculativeConfig | None) -> bool:
    """The runner keeps a draft head: method head, or auto with one."""
    return config is not None and (config.method == "head" or auto_with_head(config))


def speculation(config: SpeculativeConfig | None) -> dict:
    """The scheduler's speculation keyword arguments for ``config`` (none when off)."""
    if config is None:
        return {}
    k = config.num_speculative_tokens
    if config.method == "ngram":
        proposer = NgramProposer(k, config.prompt_lookup_max, config.prompt_lookup_min)
    elif config.method == "suffix":
        proposer = _suffix(config)
    elif config.method == "auto":
        proposer = AutoProposer(_suffix(config), NgramProposer(k, config.prompt_lookup_max, config.prompt_lookup_min),
                                head=ReservedDraftSlots(k) if auto_with_head(config) else None)
    else:  # the runner drafts (kvferry.spec.draft_model); the scheduler reserves slots
        proposer = ReservedDraftSlots(k)
    auto = isinstance(proposer, AutoProposer)
    on_verified = proposer.observe if auto and proposer.has_head else None
    # Records per tenant and per method: auto's choices kept apart (it names each proposal's method).
    methods = tuple(proposer.proposers) if auto else (config.method,)
    budget = AdaptiveSpecController(k, config.batch_token_threshold, probe_interval=config.probe_interval,
                                    adaptive=config.adaptive, cost_aware=config.cost_aware, on_verified=on_verified,
                                    methods=methods, blind_methods=(HEAD,) if auto else ())
    if auto:
        proposer.selection = budget
    return {"proposer": proposer, "num_speculative_tokens": k, "draft_budget": budget}


def _suffix(config: SpeculativeConfig) -> SuffixProposer:
    return SuffixProposer(config.num_speculative_tokens, config.suffix_decoding_max_tree_depth,
                          config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob,
                          config.suffix_decoding_max_cached_tokens, config.suffix_decoding_max_cached_requests,
                          tree=config.draft_tree)
