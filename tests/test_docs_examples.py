"""Every shell and Python example of README.md and docs/*.md runs.

Shell blocks run under ``bash -e -o pipefail`` in a working directory of
their page (shared by the page's blocks, so a file one block writes is there
for the next), with this venv's ``kvferry`` first on PATH and ``curl``
failing on an HTTP error. Python blocks run in a subprocess of this
interpreter in the same directory. The docs' server address
(``localhost:8000`` / ``127.0.0.1:8000``) is replaced by a live server's:
one shared ``kvferry serve`` with the embedded model for the session, or the
server a ``docs-test: serve`` block of the same page started.
tests/docs_blocks.py describes the ``<!-- docs-test: ... -->`` comments that
skip a block (with the reason) or mark it as a server or a file.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.docs_blocks import REPO, Block, DirectiveError, doc_pages, parse_page, split_serve
from tests.serve.server_process import READY_PREFIX, SERVE_ARGS, START_TIMEOUT_S, ServerProcess

# An offline LLM(...) example builds an engine with its defaults (a warm-up
# prefill included): 10-30 s on a loaded 2-core CPU.
BLOCK_TIMEOUT_S = 300
VENV_BIN = Path(sys.executable).parent
# A curl in the docs is shown without -f; an HTTP error must still fail the block.
SHELL_PRELUDE = 'curl() { command curl --fail-with-body --show-error --max-time 120 "$@"; }\n'


def _collect() -> tuple[dict[Path, list[Block]], list[str]]:
    pages: dict[Path, list[Block]] = {}
    errors: list[str] = []
    for path in doc_pages():
        try:
            pages[path.relative_to(REPO)] = parse_page(path)
        except DirectiveError as exc:
            errors.append(str(exc))
    return pages, errors


PAGES, DIRECTIVE_ERRORS = _collect()
BLOCKS = [b for blocks in PAGES.values() for b in blocks]


def test_every_docs_test_comment_parses() -> None:
    assert not DIRECTIVE_ERRORS, "\n".join(DIRECTIVE_ERRORS)


def test_the_first_hour_examples_are_not_skipped() -> None:
    """The README's first request (curl and the openai client) and its
    offline example are what a newcomer runs first: they must run here."""
    readme = PAGES[Path("README.md")]
    for needle in ("curl ", "from openai import OpenAI", "llm = LLM("):
        found = [b for b in readme if needle in b.text]
        assert found, f"no README block has {needle!r}"
        assert all(b.action == "run" for b in found), [b.id for b in found if b.action != "run"]


class DocSession:
    """Runs blocks; holds each page's working directory and the servers that
    serve blocks started (stopped, and their exit code checked, at the end)."""

    def __init__(self, shared: ServerProcess, root: Path) -> None:
        self.shared = shared
        self.root = root
        self.servers: dict[str, ServerProcess] = {}  # by the id of the serve block that started it
        self.done: set[str] = set()    # blocks that ran (a file or a serve block runs once)
        self.failed: set[str] = set()  # blocks that failed: a file or serve block fails those after it

    def workdir(self, page: Path) -> Path:
        d = self.root / str(page).replace("/", "_")
        d.mkdir(exist_ok=True)
        return d

    def server_for(self, block: Block) -> ServerProcess:
        """The server of the last serve block above this one on its page, else the shared one."""
        above = [b for b in PAGES.get(block.page, []) if b.action == "serve" and b.line < block.line]
        return self.servers[above[-1].id] if above else self.shared

    def env(self, server: ServerProcess) -> dict[str, str]:
        return dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    PYTHONUNBUFFERED="1", OPENAI_BASE_URL=server.api_url, OPENAI_API_KEY="unused")

    def run(self, block: Block) -> None:
        # A block may rely on the files and the server of the page's earlier
        # blocks: run those first when this block runs alone (pytest -k).
        for earlier in PAGES.get(block.page, []):
            if earlier.line >= block.line:
                break
            if earlier.action not in ("file", "serve"):
                continue
            if earlier.id in self.failed:
                pytest.fail(f"{block.id} needs {earlier.id}, which failed")
            if earlier.id not in self.done:
                self.run(earlier)
        if block.id in self.done:
            return
        self.failed.add(block.id)
        self._run(block)
        self.failed.discard(block.id)
        self.done.add(block.id)

    def _run(self, block: Block) -> None:
        if block.action == "file":
            (self.workdir(block.page) / block.file_name).write_text(block.text)
            if block.is_python:
                self._python(block, block.file_name)
        elif block.action == "serve":
            self._serve(block)
        elif block.is_python:
            name = f"example_{block.line}.py"
            (self.workdir(block.page) / name).write_text(block.script(self.server_for(block).base_url))
            self._python(block, name)
        else:
            self._shell(block, block.script(self.server_for(block).base_url))

    def _python(self, block: Block, name: str) -> None:
        self._check(block, [sys.executable, name])

    def _shell(self, block: Block, script: str) -> None:
        self._check(block, ["bash", "-e", "-o", "pipefail", "-c", SHELL_PRELUDE + script])

    def _check(self, block: Block, cmd: list[str]) -> None:
        proc = subprocess.run(cmd, cwd=self.workdir(block.page), env=self.env(self.server_for(block)),
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        assert proc.returncode == 0, (f"{block.id} exited with {proc.returncode}\n--- block\n{block.text}"
                                      f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")

    def _serve(self, block: Block) -> None:
        """The block's setup lines, then its `kvferry serve` with the test's
        small settings on a free port, until it answers /health."""
        setup, args = split_serve(block.script(self.shared.base_url))
        if setup.strip():
            self._shell(block, setup)
        log_path = self.workdir(block.page) / f"server_{block.line}.log"
        # The doc's flags first: --port 0 and the small settings win over its defaults.
        cmd = [str(VENV_BIN / "kvferry"), "serve", *args, "--port", "0", *SERVE_ARGS]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=self.workdir(block.page), stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env(self.shared))
        server = ServerProcess(proc, _wait_ready(proc, log_path, block), log_path)
        self.servers[block.id] = server
        r = httpx.get(f"{server.base_url}/health", timeout=30)
        assert r.status_code == 200, f"{block.id}: /health {r.status_code} {r.text}\n{server.log()[-3000:]}"

    def close(self) -> None:
        codes = {block_id: server.stop() for block_id, server in self.servers.items()}
        bad = {block_id: code for block_id, code in codes.items() if code != 0}
        assert not bad, "\n".join(f"the server of {i} exited with {c}:\n{self.servers[i].log()[-3000:]}"
                                   for i, c in bad.items())


def _wait_ready(proc: subprocess.Popen, log_path: Path, block: Block) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX):].split()[0]
        if proc.poll() is not None:
            raise AssertionError(f"{block.id}: kvferry serve exited with {proc.returncode}:\n"
                                 f"{log_path.read_text(errors='replace')[-4000:]}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"{block.id}: kvferry serve not ready after {START_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def docs(tmp_path_factory, default_server):
    # The session's default server (tests/conftest.py) serves the blocks
    # that start none; it is stopped, and its exit code checked, at the end.
    session = DocSession(default_server, tmp_path_factory.mktemp("docs"))
    try:
        yield session
    finally:
        session.close()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_docs_example(block: Block, request: pytest.FixtureRequest) -> None:
    if block.action == "skip":
        pytest.skip(block.reason)
    docs: DocSession = request.getfixturevalue("docs")  # no server for a run that only skips
    docs.run(block)


@pytest.mark.parametrize(("lang", "text"), [
    ("bash", "curl -s localhost:8000/v1/no-such-route\n"),  # an HTTP error, though curl is shown without -f
    ("bash", "false\necho never\n"),
    ("bash", "false | cat\n"),
    ("python", "raise SystemExit(3)\n"),
])
def test_a_failing_example_fails(lang: str, text: str, docs: DocSession) -> None:
    block = Block(Path("synthetic.md"), 1, lang, text, "run")
    with pytest.raises(AssertionError, match="synthetic.md:1 exited with"):
        docs.run(block)
