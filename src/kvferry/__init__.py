"""kvferry: LLM serving with paged KV, prefix sharing, tiering, disaggregation
and speculative decoding.

``LLM`` is imported lazily so that ``import kvferry.core`` (the torch-free
bookkeeping) never pulls in torch.
"""
from kvferry.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "LLMEngine"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy (PEP 562): `import kvferry` (the CLI, the front end) must not load
    # torch; the engine loads when LLM or LLMEngine is first named.
    if name == "LLM":
        from kvferry.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvferry.engine.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
