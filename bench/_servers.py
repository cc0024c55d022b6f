"""Start and stop a real ``kvferry serve`` process for a benchmark script.

The server binds port 0 and prints ``kvferry serve: ready on URL`` once it
answers; the scripts read the URL from its log. Shared by the bench scripts
that run their own servers (imported as ``_servers``: ``python bench/x.py``
puts ``bench/`` first on the path).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

READY_PREFIX = "kvferry serve: ready on "


def start_server(flags: list[str], log: Path, timeout_s: float = 600,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """``kvferry serve --port 0 FLAGS`` with its output in ``log`` and ``env``
    added to this environment; the process and its base URL once it is
    ready (killed if it never is)."""
    cmd = [sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(READY_PREFIX):
                return proc, line[len(READY_PREFIX):].split()[0]
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    stop_server(proc)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then kill after 60 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def served(flags: list[str], log: Path, timeout_s: float = 600, env: dict[str, str] | None = None) -> Iterator[str]:
    """A ready server's base URL for the ``with`` block; stopped after."""
    proc, url = start_server(flags, log, timeout_s, env)
    try:
        yield url
    finally:
        stop_server(proc)
