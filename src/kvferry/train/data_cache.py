"""``train-draft --data-cache DIR``: the target's replies and hidden states
on disk, generated once and reused by every later training run.

Generating the replies and recording the target's hidden states is most
of a small run's CPU time, and it is the same for every recipe tried on
the same prompts. The cache is kept in chunks of CHUNK_PROMPTS prompts,
each written as soon as it is done, so an interrupted run keeps what it
generated, and a run asking for more prompts than are cached generates
only the missing ones. ``corpus_prompts`` is prefix-stable (the first N
prompts are the same for any larger count), so a cache of M prompts
serves any run of N <= M.

Only the hidden states training reads are stored: those of the last
prompt position onward (the prompt's other states are never read, and
they are most of a chat sequence). ``load`` hands back each sequence cut
the same way, its prompt one token long, which ``features_of`` trains on
exactly as on the whole sequence; the whole token ids are kept for
``draft_vocabulary`` (it breaks ties with the prompts' token counts).

Chunks are named by their place in the run's prompt list, so a run past
the first prompts (``--prompt-offset``) keeps a folder of its own (the
offset is in ``meta.json`` and the folder's name). Each chunk also
records a digest of each of its prompts, and reading one back checks
them against the prompts asked for: a chunk never hands back the
replies to other prompts.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

CHUNK_PROMPTS = 64  # prompts per file: what an interrupted run may lose at most

Sequence = tuple[list[int], int]  # (prompt + answer token ids, prompt length)


@dataclass(slots=True)
class CachedData:
    sequences: list[Sequence]  # whole token ids (for the draft vocabulary)
    trimmed: list[Sequence]  # ids from the last prompt token on, prompt length 1
    hidden: list[torch.Tensor]  # [len(trimmed ids), H] bf16 each


class DataCache:
    """One folder per (target, corpus, seed, max_tokens): ``meta.json`` says
    which, and a mismatch is an error rather than silently wrong data."""

    def __init__(self, root: Path, meta: dict) -> None:
        offset = f"-from{meta['prompt_offset']}" if meta.get("prompt_offset") else ""
        self.root = root / (f"{meta['corpus']}-seed{meta['seed']}-t{meta['max_tokens']}{offset}-"
                            f"{meta['target_fingerprint'][:16]}")
        self.meta = meta

    def _check_meta(self) -> None:
        path = self.root / "meta.json"
        if path.exists():
            found = json.loads(path.read_text())
            if found != self.meta:
                raise ValueError(f"--data-cache {self.root} was made for {found}, not {self.meta}")
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.meta, indent=2) + "\n")

    def _chunk_path(self, index: int) -> Path:
        return self.root / f"chunk-{index:05d}.safetensors"

    def fill(self, prompts: list, record: Callable[[list], tuple[list[Sequence], list[torch.Tensor]]]) -> None:
        """Generate and save the chunks of ``prompts`` not cached yet;
        ``record(prompts)`` gives their sequences and whole hidden states."""
        self._check_meta()
        for index in range(-(-len(prompts) // CHUNK_PROMPTS)):
            chunk = prompts[index * CHUNK_PROMPTS : (index + 1) * CHUNK_PROMPTS]
            path = self._chunk_path(index)
            if path.exists() and _chunk_prompts(path) >= len(chunk):
                _check_prompts(path, chunk)
                continue
            sequences, hidden = record(chunk)
            _save_chunk(path, sequences, hidden, chunk)
            print(f"data cache: {path.name} ({len(chunk)} prompts) written")

    def load(self, num_prompts: int, prompts: list | None = None) -> CachedData:
        """The first ``num_prompts`` cached replies; given ``prompts`` (those
        of the run), each chunk's recorded prompts must be them."""
        data = CachedData([], [], [])
        for index in range(-(-num_prompts // CHUNK_PROMPTS)):
            want = min(CHUNK_PROMPTS, num_prompts - index * CHUNK_PROMPTS)
            path = self._chunk_path(index)
            if prompts is not None:
                _check_prompts(path, prompts[index * CHUNK_PROMPTS : index * CHUNK_PROMPTS + want])
            seqs, trimmed, hidden = _load_chunk(path)
            data.sequences += seqs[:want]
            data.trimmed += trimmed[:want]
            data.hidden += hidden[:want]
        return data


def prompt_digest(prompt: list) -> str:
    """A short digest of one chat prompt (its messages)."""
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


def _check_prompts(path: Path, prompts: list) -> None:
    """The chunk at ``path`` must start with the replies to ``prompts``
    (a chunk written before digests were recorded is taken as it is)."""
    with safe_open(str(path), "pt") as f:
        recorded = (f.metadata() or {}).get("prompt_digests")
    if recorded is None:
        return
    found, wanted = recorded.split(",")[: len(prompts)], [prompt_digest(p) for p in prompts]
    if found != wanted:
        bad = next(i for i, (a, b) in enumerate(zip(found, wanted)) if a != b) if len(found) == len(wanted) else -1
        raise ValueError(f"--data-cache: {path} holds the replies to other prompts than this run's "
                         f"(prompt {bad} of the chunk differs); use another --data-cache folder")


def _save_chunk(path: Path, sequences: list[Sequence], hidden: list[torch.Tensor], prompts: list) -> None:
    kept = [h[n - 1 :].to(torch.bfloat16).contiguous() for (_, n), h in zip(sequences, hidden)]
    tensors = {
        "ids": torch.tensor([t for ids, _ in sequences for t in ids], dtype=torch.int64),
        "lengths": torch.tensor([len(ids) for ids, _ in sequences], dtype=torch.int64),
        "prompt_lengths": torch.tensor([n for _, n in sequences], dtype=torch.int64),
        "hidden": torch.cat(kept),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"prompt_digests": ",".join(prompt_digest(p) for p in prompts)})
    tmp.replace(path)  # a chunk is there whole or not at all


def _chunk_prompts(path: Path) -> int:
    with safe_open(str(path), "pt") as f:
        return f.get_slice("lengths").get_shape()[0]


def _load_chunk(path: Path) -> tuple[list[Sequence], list[Sequence], list[torch.Tensor]]:
    t = load_file(str(path))
    ids = t["ids"].split(t["lengths"].tolist())
    sequences = [(x.tolist(), int(n)) for x, n in zip(ids, t["prompt_lengths"])]
    trimmed = [(x[n - 1 :], 1) for x, n in sequences]
    hidden = list(t["hidden"].split([len(x) for x, _ in trimmed]))
    return sequences, trimmed, hidden
