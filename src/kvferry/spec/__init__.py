"""Speculative decoding: draft proposers and the adaptive controller.

No torch here (the scheduler calls into this package): proposers work on
token ids with numpy. The runner verifies drafts losslessly, so a proposer
only decides speed, never output.
"""
from kvferry.config import SpeculativeConfig
from kvferry.spec.adaptive import AdaptiveSpecController
from kvferry.spec.ngram import NgramProposer

__all__ = ["AdaptiveSpecController", "NgramProposer", "speculation"]


def speculation(config: SpeculativeConfig | None) -> dict:
    """The scheduler's speculation keyword arguments for ``config`` (none when off)."""
    if config is None:
        return {}
    k = config.num_speculative_tokens
    return {
        "proposer": NgramProposer(k, config.prompt_lookup_max, config.prompt_lookup_min),
        "num_speculative_tokens": k,
        "draft_budget": AdaptiveSpecController(k, config.batch_token_threshold,
                                               probe_interval=config.probe_interval, adaptive=config.adaptive),
    }
