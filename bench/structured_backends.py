"""Grammar backends compared on the embedded model's vocabulary (49k tokens):
tokenizer setup, JSON-schema compile (fresh schemas, no cache) and the
per-token mask fill that runs every decode step.

    python bench/structured_backends.py     # needs xgrammar and llguidance installed

Both are run in one process, interleaved per repetition, so that the noise
of a shared machine falls on both alike.
"""
from __future__ import annotations

import json
import statistics
import time

import torch
from transformers import PreTrainedTokenizerFast

from kvferry.model.loader import resolve_model_folder

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                           "units": {"enum": ["c", "f"]},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["city", "days", "units"], "additionalProperties": False}
TARGET = '{"city": "Paris", "days": 3, "units": "c", "tags": ["rain", "wind"]}'
REPS = 8


def xgrammar_backend(hf, vocab):
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab), max_threads=1,
                                   cache_enabled=False)
    return (lambda schema: compiler.compile_json_schema(schema), xgr.GrammarMatcher,
            lambda m, mask: m.fill_next_token_bitmask(mask), lambda m, t: m.accept_token(t))


def llguidance_backend(hf, vocab):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)

    def compile_(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        llguidance.LLMatcher(tok, grammar)  # compiles
        return grammar

    return (compile_, lambda g: llguidance.LLMatcher(tok, g),
            lambda m, mask: llguidance.torch.fill_next_token_bitmask(m, mask, 0), lambda m, t: m.consume_token(t))


def main() -> None:
    hf = PreTrainedTokenizerFast(tokenizer_file=str(resolve_model_folder(None) / "tokenizer.json"))
    vocab = len(hf)
    ids = hf.encode(TARGET, add_special_tokens=False)
    backends, setup_s = {}, {}
    for name, make in (("xgrammar", xgrammar_backend), ("llguidance", llguidance_backend)):
        start = time.perf_counter()
        backends[name] = make(hf, vocab)
        setup_s[name] = time.perf_counter() - start
    compile_s = {n: [] for n in backends}
    fill_s = {n: [] for n in backends}
    for rep in range(REPS):
        for name, (compile_, matcher_of, fill, accept) in backends.items():
            variant = {**SCHEMA, "properties": {**SCHEMA["properties"], f"x{rep}": {"type": "number"}}}
            start = time.perf_counter()
            compile_(json.dumps(variant))
            compile_s[name].append(time.perf_counter() - start)
            matcher = matcher_of(compile_(json.dumps(SCHEMA)))
            mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
            for token in ids:
                start = time.perf_counter()
                fill(matcher, mask)
                fill_s[name].append(time.perf_counter() - start)
                accept(matcher, token)
    for name in backends:
        print(f"{name:10s} setup {setup_s[name] * 1e3:6.0f} ms  compile median "
              f"{statistics.median(compile_s[name]) * 1e3:5.2f} ms  mask fill median "
              f"{statistics.median(fill_s[name]) * 1e6:5.0f} us")


if __name__ == "__main__":
    main()
