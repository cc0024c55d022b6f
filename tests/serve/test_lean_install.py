"""What ``make serve`` installs is enough to serve: a server whose Python
cannot see the extras' packages (Ray, Redis, Mooncake, the test and bench
tools, and triton, which xgrammar declares but only its CUDA kernel uses)
starts, answers a chat and a JSON-schema request. A feature whose extra is
missing is refused in one line naming the extra: ``--ray``, ``--kv-remote``,
and structured outputs without xgrammar (a 400, the server keeps serving).

The packages are hidden from the server's processes (the engine core's
too) by a ``sitecustomize`` that sets ``sys.modules[name] = None``: for
Python that is a module that is not installed (``import`` raises
ImportError and ``importlib.util.find_spec`` answers None)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serve.server_process import MODEL_NAME, start_server

NOT_FOR_SERVING = ("ray", "redis", "mooncake", "pytest", "triton", "matplotlib", "scipy", "openai", "ollama",
                   "hypothesis", "chitchat_dataset", "rich")
ARGS = ["--max-model-len", "512", "--max-num-seqs", "2", "--kv-cache-memory-gb", "0.05", "--dtype", "float32",
        "--no-warm-up", "--disable-uvicorn-access-log", "--log-level", "warning"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def hiding(tmp_path: Path, modules: tuple[str, ...]) -> dict[str, str]:
    """Environment for a subprocess in which ``modules`` are not installed."""
    site = tmp_path / f"hide-{len(modules)}-{modules[0]}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in modules))
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", ""), os.getcwd()])}


def chat(base_url: str, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "A JSON object, please."}],
            "max_tokens": 12, "temperature": 0, **extra}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)


@pytest.fixture(scope="module")
def lean_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lean")
    server = start_server(tmp / "serve.log", serve_args=ARGS, env=hiding(tmp, NOT_FOR_SERVING))
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log()


def test_a_server_without_the_extras_answers_a_chat_and_a_json_schema_request(lean_server):
    r = chat(lean_server.base_url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    r = chat(lean_server.base_url, response_format={"type": "json_schema",
                                                    "json_schema": {"name": "a", "schema": SCHEMA}})
    assert r.status_code == 200, r.text
    assert "Traceback" not in lean_server.log()


def test_without_xgrammar_a_structured_request_is_a_400_naming_the_extra(tmp_path):
    server = start_server(tmp_path / "serve.log", serve_args=ARGS, env=hiding(tmp_path, ("xgrammar",)))
    try:
        r = chat(server.base_url, response_format={"type": "json_schema",
                                                   "json_schema": {"name": "a", "schema": SCHEMA}})
        assert r.status_code == 400, r.text
        assert "pip install 'kvferry[structured]'" in r.json()["error"]["message"]
        assert chat(server.base_url).status_code == 200  # and it keeps serving
        assert "structured outputs" in server.log() and "Traceback" not in server.log()
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.parametrize("flags, module, extra", [
    (["--ray", "auto"], "ray", "ray"),
    (["--kv-remote", "redis://127.0.0.1:1", "--kv-dram-gb", "0.05"], "redis", "remote"),
])
def test_a_feature_whose_extra_is_missing_is_refused_in_one_line(tmp_path, flags, module, extra):
    env = dict(os.environ, **hiding(tmp_path, (module,)))
    done = subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", *ARGS, *flags],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvferry serve: error: ")]
    assert len(errors) == 1 and f"pip install 'kvferry[{extra}]'" in errors[0], done.stderr
