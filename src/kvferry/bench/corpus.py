"""Long documents from a local text corpus, for the ``long-doc`` workload.

Sources, in the order tried by ``auto``:
- Debian's ``python3.11-doc``: the HTML (tags stripped) or text pages under
  /usr/share/doc/python3.11;
- Debian's ``bible-kjv``: chapters printed by its ``bible`` program;
- any folder of .txt / .html / .md files (``--corpus DIR``).
"""
from __future__ import annotations

import html
import random
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from kvferry.bench.workloads import BenchError, RequestSpec, Session, user

PYTHON_DOC_DIR = Path("/usr/share/doc/python3.11")
_SUFFIXES = (".txt", ".html", ".htm", ".md", ".rst")
_BIBLE_BOOKS = ["Gen", "Ex", "Lev", "Num", "Deut", "Josh", "Judg", "Ruth", "Ps", "Prov", "Isa", "Jer",
                "Matt", "Mark", "Luke", "John", "Acts", "Rom"]
QUESTIONS = [
    "Summarize the document above in three sentences.",
    "What is the main topic of the document above?",
    "List five important terms used in the document above.",
    "Which part of the document above is hardest to understand, and why?",
    "Write one question a reader could answer from the document above.",
]
# Characters per token of English prose for BPE tokenizers (a rough, safe guess).
CHARS_PER_TOKEN = 4


def load_documents(corpus: str, num_docs: int, min_chars: int, seed: int) -> list[str]:
    """``num_docs`` documents of at least ``min_chars`` characters (fewer if the
    corpus holds fewer). Raises BenchError naming the package to install."""
    if corpus == "auto":
        if _python_doc_files():
            corpus = "python3.11-doc"
        elif shutil.which("bible"):
            corpus = "bible-kjv"
        else:
            raise BenchError("long-doc needs a text corpus: apt-get install python3.11-doc (or bible-kjv), "
                             "or pass --corpus DIR")
    if corpus == "python3.11-doc":
        files = _python_doc_files()
        if not files:
            raise BenchError("--corpus python3.11-doc: not installed (apt-get install python3.11-doc)")
        return _docs_from_files(files, num_docs, min_chars, seed)
    if corpus == "bible-kjv":
        if not shutil.which("bible"):
            raise BenchError("--corpus bible-kjv: not installed (apt-get install bible-kjv)")
        return _bible_docs(num_docs, min_chars)
    folder = Path(corpus)
    if not folder.is_dir():
        raise BenchError(f"--corpus: {corpus} is not a folder (or python3.11-doc, bible-kjv, auto)")
    files = sorted(p for p in folder.rglob("*") if p.suffix in _SUFFIXES and p.is_file())
    if not files:
        raise BenchError(f"--corpus: no {'/'.join(_SUFFIXES)} files under {corpus}")
    return _docs_from_files(files, num_docs, min_chars, seed)


def _python_doc_files() -> list[Path]:
    if not PYTHON_DOC_DIR.is_dir():
        return []
    return sorted(p for p in PYTHON_DOC_DIR.rglob("*") if p.suffix in (".html", ".txt") and p.is_file())


def _plain_text(path: Path) -> str:
    text = path.read_text(errors="replace")
    if path.suffix in (".html", ".htm"):
        text = re.sub(r"(?is)<(script|style).*?</\1>", " ", text)
        text = html.unescape(re.sub(r"<[^>]+>", " ", text))
    return re.sub(r"[ \t]+", " ", re.sub(r"\n\s*\n+", "\n\n", text)).strip()


def _docs_from_files(files: list[Path], num_docs: int, min_chars: int, seed: int) -> list[str]:
    """Documents in a seeded order; short files are joined until long enough."""
    order = list(files)
    random.Random(seed).shuffle(order)
    docs, current = [], ""
    for f in order:
        current = (current + "\n\n" + _plain_text(f)).strip()
        if len(current) >= min_chars:
            docs.append(current)
            current = ""
            if len(docs) == num_docs:
                break
    return docs or ([current] if current else [])


def _bible_docs(num_docs: int, min_chars: int) -> list[str]:
    docs = []
    for book in _BIBLE_BOOKS[:num_docs]:
        chapters = 1
        while True:  # whole chapters until long enough (a chapter is 2-6 k characters)
            ref = f"{book}1:1-{chapters}:999"
            out = subprocess.run(["bible", "-f", ref], capture_output=True, text=True, timeout=30).stdout
            if len(out) >= min_chars or chapters >= 40:
                break
            chapters += 1
        docs.append(out)
    return docs


def long_doc_workload(docs: list[str], doc_len: int, questions_per_doc: int, output_len_sampler,
                      seed: int) -> Iterator[Session]:
    """Each document (clipped to about ``doc_len`` tokens) is asked
    ``questions_per_doc`` questions, in a seeded interleaved order, so later
    questions find the document in the prefix cache."""
    rng = random.Random(seed)
    clipped = [d[: doc_len * CHARS_PER_TOKEN] for d in docs]
    while True:
        order = [(d, q) for d in range(len(clipped)) for q in range(questions_per_doc)]
        rng.shuffle(order)
        for d, q in order:
            prompt = f"{clipped[d]}\n\nQuestion: {QUESTIONS[q % len(QUESTIONS)]}"
            yield Session([RequestSpec(user(prompt), output_len_sampler(rng),
                                       len(clipped[d]) // CHARS_PER_TOKEN, tenant=f"doc-{d}")])
