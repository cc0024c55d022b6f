"""The code blocks of README.md and docs/*.md, as tests/test_docs_examples.py
runs them.

A fenced block is runnable when its language is a shell one (bash, sh,
shell, console) or python. An HTML comment on the line right before the
fence says how the test treats it (it is invisible in the rendered page):

    <!-- docs-test: skip (WHY) -->   not run; the reason is required
    <!-- docs-test: serve -->        a shell block whose last command is
                                     `kvferry serve ...`: the lines before it
                                     run, then the server is started (on a
                                     free port, with the test's small
                                     settings) and answers /health; the
                                     blocks after it in the same page talk to
                                     it instead of the shared server
    <!-- docs-test: file NAME -->    the block's text is written to NAME in
                                     the page's working directory (any
                                     language: a key file, a module); a
                                     python block is then also run

Without a comment a runnable block is run. Any other ``docs-test:`` comment
is an error, so that a typo cannot silently skip a block.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
RUNNABLE_LANGS = SHELL_LANGS | {"python"}

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
_SKIP = re.compile(r"^skip\s*\((?P<reason>.*\S.*)\)$")
_FILE = re.compile(r"^file\s+(?P<name>[\w.-]+)$")
# Where the docs address "the server" (make serve's default address).
_DEFAULT_SERVER = re.compile(r"(?:https?://)?(?:localhost|127\.0\.0\.1):8000\b")


class DirectiveError(ValueError):
    """A ``docs-test:`` comment that is not one of the forms above."""


@dataclass(frozen=True)
class Block:
    page: Path          # relative to the repository
    line: int           # the opening fence's line, 1-based
    lang: str           # lower case; "" for a bare fence
    text: str           # the block's lines, fence and indentation removed
    action: str         # "run", "skip", "serve" or "file"
    reason: str = ""    # skip: why
    file_name: str = ""  # file: where the text goes

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_python(self) -> bool:
        return self.lang == "python"

    def script(self, base_url: str) -> str:
        """The text to run: a console block reduced to its commands, and the
        docs' default address (localhost:8000) replaced by ``base_url``."""
        text = console_commands(self.text) if self.lang == "console" else self.text
        return _DEFAULT_SERVER.sub(base_url, text)


def doc_pages(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def parse_page(path: Path, repo: Path = REPO) -> list[Block]:
    """Every block of one page that is runnable or carries a directive."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent, lang = m["fence"], len(m["indent"]), m["lang"].lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].lstrip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
            i += 1
        i += 1  # the closing fence
        directive = _directive_before(lines, start, path)
        if directive is None and lang not in RUNNABLE_LANGS:
            continue
        action, reason, file_name = directive or ("run", "", "")
        if action == "serve" and lang not in SHELL_LANGS:
            raise DirectiveError(f"{path}:{start + 1}: docs-test: serve marks a shell block, not {lang or 'a bare one'}")
        if action == "run" and lang not in RUNNABLE_LANGS:
            raise DirectiveError(f"{path}:{start + 1}: a {lang or 'bare'} block cannot run")
        text = "\n".join(body) + "\n"
        if action == "serve":
            try:
                split_serve(text)
            except (DirectiveError, ValueError) as exc:  # ValueError: shlex, unbalanced quotes
                raise DirectiveError(f"{path}:{start + 1}: {exc}") from None
        blocks.append(Block(path.relative_to(repo), start + 1, lang, text, action, reason, file_name))
    return blocks


def _directive_before(lines: list[str], fence_index: int, path: Path) -> tuple[str, str, str] | None:
    if fence_index == 0:
        return None
    m = _DIRECTIVE.match(lines[fence_index - 1])
    if not m:
        return None
    body = m["body"]
    if skip := _SKIP.match(body):
        return "skip", skip["reason"].strip(), ""
    if body == "serve":
        return "serve", "", ""
    if file := _FILE.match(body):
        return "file", "", file["name"]
    raise DirectiveError(f"{path}:{fence_index}: unknown docs-test comment {body!r} (skip (WHY), serve or file NAME)")


def console_commands(text: str) -> str:
    """The commands of a console transcript: lines after ``$ ``, and the
    continuation lines of a command ending in a backslash; output is dropped."""
    out: list[str] = []
    continued = False
    for line in text.splitlines():
        if continued or line.startswith("$ "):
            command = line if continued else line[2:]
            out.append(command)
            continued = command.rstrip().endswith("\\")
    return "\n".join(out) + "\n"


def split_serve(script: str) -> tuple[str, list[str]]:
    """A serve block: (the shell lines before its last command, the
    ``kvferry serve`` command's arguments after ``serve``)."""
    lines = script.replace("\\\n", " ").splitlines()  # continuation lines joined
    commands = [(i, words) for i, line in enumerate(lines) if (words := shlex.split(line, comments=True))]
    if not commands or commands[-1][1][:2] != ["kvferry", "serve"]:
        raise DirectiveError("a docs-test: serve block must end with a `kvferry serve` command")
    last, words = commands[-1]
    return "\n".join(lines[:last]) + "\n", words[2:]
