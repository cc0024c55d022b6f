"""Structured generation: constrain sampling so the output matches a grammar.

    spec = GrammarSpec.from_response_format({"type": "json_schema", ...})   # no heavy imports
    compiler = GrammarCompiler(tokenizer, vocab_size)       # once per model (xgrammar)
    matcher = compiler.matcher(spec)                          # once per request
    matcher.fill_bitmask(bitmask, row)                        # each step, before sampling
    logits = apply_token_bitmask(logits, bitmask)             # pure: disallowed -> -inf
    matcher.accept_token(token_id)                            # after sampling

The backend is xgrammar, chosen by measurement on this machine
(bench/structured_backends.py: SmolLM2's 49k vocabulary, a JSON schema,
both interleaved in one process): the per-token mask fill, which sits on
every decode step's critical path, takes ~2 us median against ~14 us for
llguidance. llguidance compiles a fresh schema faster (0.7 ms vs ~10 ms
uncached), but compiling happens once per request, off the step path, and
repeated schemas hit the compile cache.

Wiring into the sampler is separate: the engine asks each request's matcher
for its row of the bitmask and applies it before sampling.
"""
from kvferry.structured.spec import GrammarSpec

__all__ = ["GrammarSpec", "apply_token_bitmask", "allocate_bitmask", "bitmask_width"]


def __getattr__(name: str):
    # The bitmask helpers need torch; the HTTP side imports only the spec.
    if name in ("apply_token_bitmask", "allocate_bitmask", "bitmask_width"):
        from kvferry.structured import bitmask

        return getattr(bitmask, name)
    raise AttributeError(name)
