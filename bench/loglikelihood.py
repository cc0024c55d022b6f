"""A small loglikelihood task against a running kvferry server and against
HF transformers on the same model: the largest |difference| of the summed
continuation logprobs.

Each of the 50 items is a multiple choice: a context (the start of a sentence
from a local corpus) and four continuations (its true ending and three
endings of other sentences). Every (context, continuation) pair is sent as
lm-eval's ``local-completions`` sends a loglikelihood request: the token ids
of context + continuation as the prompt, ``echo=true, logprobs=1,
max_tokens=1, temperature=0``; the score is ``sum(token_logprobs[ctxlen:-1])``
(the last entry is the generated token's). The same sums are computed by
transformers in float32 (run the server with ``--dtype float32`` for a
like-for-like comparison), and the accuracy of both is printed.

    kvferry serve --dtype float32 --port 8000 &
    python bench/loglikelihood.py --url http://127.0.0.1:8000

Corpus, the first found: the PyPI package chitchat-dataset, Debian's
python3.11-doc text, else sentences made of the bundled word list.
"""
from __future__ import annotations

import argparse
import gzip
import random
import re
import time
from pathlib import Path

import httpx

WORDS = Path(__file__).resolve().parents[1] / "src/kvferry/bench/data/words.txt"
PYTHON_DOC = Path("/usr/share/doc/python3.11")


def sentences(min_words: int = 10, max_words: int = 30, limit: int = 5000) -> tuple[str, list[str]]:
    """(corpus name, sentences of min_words..max_words words)."""
    try:
        import chitchat_dataset

        out = []
        for conversation in chitchat_dataset.ConversationDataset():
            for message in conversation:
                if min_words <= len(message.split()) <= max_words:
                    out.append(" ".join(message.split()))
            if len(out) >= limit:
                break
        if out:
            return "chitchat-dataset", out
    except ImportError:
        pass
    texts = [p for p in sorted(PYTHON_DOC.rglob("*.txt*")) if p.is_file()] if PYTHON_DOC.is_dir() else []
    out = []
    for path in texts:
        raw = gzip.open(path, "rt", errors="replace").read() if path.suffix == ".gz" else path.read_text(errors="replace")
        for s in re.split(r"(?<=[.!?])\s+", " ".join(raw.split())):
            if min_words <= len(s.split()) <= max_words and re.fullmatch(r"[A-Za-z0-9 ,.;:'()!?-]+", s):
                out.append(s)
        if len(out) >= limit:
            break
    if len(out) >= 200:
        return "python3.11-doc", out
    rng = random.Random(0)
    words = WORDS.read_text().split()
    return "bundled words", [" ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words))) + "."
                             for _ in range(limit)]


def build_items(corpus: list[str], num_items: int, num_choices: int, seed: int) -> list[tuple[str, list[str], int]]:
    """(context, continuations, index of the true one): each sentence cut
    after about 60% of its words; distractors are other sentences' endings."""
    rng = random.Random(seed)
    pool = rng.sample(corpus, min(len(corpus), num_items * num_choices))
    splits = []
    for s in pool:
        words = s.split()
        cut = max(2, int(len(words) * 0.6))
        splits.append((" ".join(words[:cut]), " " + " ".join(words[cut:])))
    items = []
    for i in range(num_items):
        context, truth = splits[i]
        others = [splits[(i + k * num_items) % len(splits)][1] for k in range(1, num_choices)]
        choices = [truth, *others]
        rng.shuffle(choices)
        items.append((context, choices, choices.index(truth)))
    return items


def tokenize(client: httpx.Client, text: str) -> list[int]:
    r = client.post("/tokenize", json={"prompt": text})
    r.raise_for_status()
    return r.json()["tokens"]


def served_scores(client: httpx.Client, model: str, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """lm-eval local-completions' loglikelihood request and parse, one pair a request."""
    scores = []
    for context, continuation in pairs:
        body = {"model": model, "prompt": [context + continuation], "temperature": 0, "max_tokens": 1,
                "logprobs": 1, "seed": 1234, "echo": True}
        r = client.post("/v1/completions", json=body)
        r.raise_for_status()
        token_logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        scores.append(sum(token_logprobs[len(context):-1]))
    return scores


def hf_scores(model_path: str, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for context, continuation in pairs:
            ids = context + continuation
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            scores.append(sum(lp[i - 1, ids[i]].item() for i in range(len(context), len(ids))))
    return scores


def accuracy(scores: list[float], items: list[tuple[str, list[str], int]], num_choices: int) -> float:
    right = 0
    for i, (_, _, truth) in enumerate(items):
        row = scores[i * num_choices:(i + 1) * num_choices]
        right += row.index(max(row)) == truth
    return right / len(items)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running kvferry server")
    p.add_argument("--items", type=int, default=50)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-path", default=None, help="the HF folder for transformers (default: the server's "
                                                      "model card root where it is a folder, else the embedded "
                                                      "model's converted folder)")
    args = p.parse_args()
    with httpx.Client(base_url=args.url, timeout=300) as client:
        card = client.get("/v1/models").json()["data"][0]
        model, model_path = card["id"], args.model_path or card["root"]
        if not Path(model_path).is_dir():  # the embedded default model: its GGUF's converted HF folder
            from kvferry.model.gguf_convert import convert_gguf, embedded_gguf_path

            model_path = str(convert_gguf(embedded_gguf_path()))
        name, corpus = sentences()
        items = build_items(corpus, args.items, args.choices, args.seed)
        pairs = [(tokenize(client, context), tokenize(client, choice)) for context, choices, _ in items
                 for choice in choices]
        start = time.perf_counter()
        reference = hf_scores(model_path, pairs)
        hf_s = time.perf_counter() - start
        start = time.perf_counter()
        served = served_scores(client, model, pairs)
        served_s = time.perf_counter() - start
    diffs = [abs(a - b) for a, b in zip(served, reference)]
    print(f"corpus: {name}; {len(items)} items x {args.choices} choices = {len(pairs)} requests; model {model}")
    print(f"kvferry: {served_s:.1f} s, accuracy {accuracy(served, items, args.choices):.2f}")
    print(f"transformers: {hf_s:.1f} s, accuracy {accuracy(reference, items, args.choices):.2f}")
    print(f"max |summed logprob difference|: {max(diffs):.2e} (mean {sum(diffs) / len(diffs):.2e})")


if __name__ == "__main__":
    main()
