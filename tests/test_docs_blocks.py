"""tests/docs_blocks.py: which blocks of a page run, and how its comments read."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs_blocks import DirectiveError, parse_page, split_serve


def page(tmp_path: Path, text: str) -> list:
    path = tmp_path / "page.md"
    path.write_text(text)
    return parse_page(path, repo=tmp_path)


def test_runnable_blocks_and_directives(tmp_path):
    blocks = page(tmp_path, """# Title

```
a diagram, not run
```

```bash
curl -s localhost:8000/health
```

<!-- docs-test: skip (needs a GPU) -->
```python
LLM(device="cuda")
```

<!-- docs-test: file keys.json -->
```json
{"sk-1": {"tenant": "a"}}
```

<!-- docs-test: serve -->
```sh
kvferry serve --api-keys keys.json
```
""")
    assert [(b.line, b.lang, b.action) for b in blocks] == [
        (7, "bash", "run"), (12, "python", "skip"), (17, "json", "file"), (22, "sh", "serve")]
    assert blocks[1].reason == "needs a GPU"
    assert blocks[2].file_name == "keys.json" and blocks[2].text == '{"sk-1": {"tenant": "a"}}\n'
    assert blocks[0].script("http://127.0.0.1:4242") == "curl -s http://127.0.0.1:4242/health\n"


@pytest.mark.parametrize("comment", [
    "<!-- docs-test: skip -->",              # no reason
    "<!-- docs-test: skip () -->",
    "<!-- docs-test: skipp (typo) -->",
    "<!-- docs-test: file -->",
])
def test_a_bad_comment_is_an_error(tmp_path, comment):
    with pytest.raises(DirectiveError, match="page.md"):
        page(tmp_path, f"{comment}\n```bash\necho\n```\n")


def test_serve_marks_only_a_shell_block_ending_in_kvferry_serve(tmp_path):
    with pytest.raises(DirectiveError, match="shell block"):
        page(tmp_path, "<!-- docs-test: serve -->\n```python\nprint()\n```\n")
    with pytest.raises(DirectiveError, match="page.md:2: .*must end with"):
        page(tmp_path, "<!-- docs-test: serve -->\n```bash\nkvferry serve\necho after\n```\n")


def test_console_blocks_run_their_commands_only(tmp_path):
    [block] = page(tmp_path, "```console\n$ echo a \\\n    b\na b\n$ curl -s 127.0.0.1:8000/health\nOK\n```\n")
    assert block.script("http://h:1") == "echo a \\\n    b\ncurl -s http://h:1/health\n"


def test_split_serve():
    setup, args = split_serve("head -c 32 /dev/urandom > secret  # why\n"
                              "kvferry serve --api-keys keys.json \\\n    --cache-secret-file secret   # [--x y]\n")
    assert setup.strip().startswith("head -c 32")
    assert args == ["--api-keys", "keys.json", "--cache-secret-file", "secret"]
    with pytest.raises(DirectiveError):
        split_serve("kvferry serve\necho after\n")
