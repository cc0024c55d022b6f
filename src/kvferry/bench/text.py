"""Deterministic filler text whose length in tokens is known.

The words in data/words.txt are common English words that a byte-level BPE
tokenizer (SmolLM2's, like GPT-2's and Llama 3's) encodes as one token each
when preceded by a space, so ``n`` words are about ``n`` tokens and equal
seeds give equal token blocks on any server.
"""
from __future__ import annotations

import random
from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=1)
def words() -> tuple[str, ...]:
    text = resources.files("kvferry.bench").joinpath("data/words.txt").read_text()
    return tuple(w for w in text.split() if w)


def random_words(rng: random.Random, num_words: int) -> str:
    """``num_words`` space-led random words (about as many tokens)."""
    vocab = words()
    return "".join(" " + vocab[rng.randrange(len(vocab))] for _ in range(num_words))


def block_text(key: int | str, num_words: int, salt: str = "block") -> str:
    """The text of block ``key``: the same key always gives the same words, and a
    shorter block is a prefix of a longer one (a trace's partial last block)."""
    return random_words(random.Random(f"{salt}:{key}"), num_words)
